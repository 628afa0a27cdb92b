"""Fit one question's calibration from labelled examples: the Python API behind ``slotread calibrate``
(``eval.fitting.write_calibration`` calls it with the data and model its settings name).

The data is an evaluation ``Dataset`` (``slotread.eval.datasets``: a built-in split, or a labelled file
with its question), and each item is asked exactly the request ``slotread eval`` sends for it, so the
artifact's schema is the one the evaluation asks. Every item is read through the Decider with
``x_calibration: contextual``, so the content-free distributions are read on the way (once). The raw
reads (label logits in option order) give the temperature (``methods.fit_temperature``), the
top-label bins of the contextual answers (``fit_top_label_bins``: ``x_calibration: binned``) and,
under each of none, contextual, temperature and binned calibration, the items' conformal scores
1 − p(gold). The result is one artifact for (model, schema); ``fitted_on.ece`` records the in-sample
ECE of the contextual answers before and after binning, ``fitted_on.class_counts`` the label prior the
data had (a temperature fitted on one prior and served on another is off: ``datasets.balance`` draws
data with the same count of every class, ``fitted_on.balanced``).

Data that overlaps the evaluation split named by ``exclude`` is refused before anything is read
(``eval.training.refuse_overlap``): a calibration fitted on the items it is judged on would look better
than it is. It reads through the ``Decider`` like an evaluation, so it sits above the rest of
``quality`` (``tests/test_layering.py``): nothing that serves a request imports it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from slotread.api.systemone import parse_request, to_decision
from slotread.decider import Decider
from slotread.errors import InvalidRequest
from slotread.eval.datasets import Dataset, class_counts
from slotread.eval.metrics import expected_calibration_error
from slotread.eval.runner import QUESTION_ID, build_request
from slotread.eval.training import refuse_overlap
from slotread.quality.artifact import schema_hash
from slotread.quality.calibration.artifact import CONFORMAL_METHODS, Calibration
from slotread.quality.calibration.conformal import nonconformity
from slotread.quality.calibration.content_free import CONTENT_FREE_STATES
from slotread.quality.calibration.methods import (
    apply_top_label_bins,
    calibrate_reads,
    fit_temperature,
    fit_top_label_bins,
    mean_nll,
    temperature_scale,
)


@dataclass(frozen=True)
class Fit:
    """A fitted artifact and what it was fitted on: raw read logits (N, R, n) and gold option indices (N,)."""

    calibration: Calibration
    logits: np.ndarray
    gold: np.ndarray

    def summary(self) -> dict[str, float]:
        """In-sample numbers: accuracy of the raw answers, NLL before (T = 1) and after the fitted temperature."""
        temperature = self.calibration.temperature or 1.0
        answers = temperature_scale(self.logits, 1.0).mean(axis=1)  # (N, n)
        return {
            "accuracy": float((answers.argmax(axis=1) == self.gold).mean()),
            "nll_raw": mean_nll(self.logits, self.gold),
            "nll_fitted": mean_nll(self.logits, self.gold, temperature),
        }


def calibrate(
    decider: Decider,
    data: Dataset,
    *,
    request_fields: dict[str, Any] | None = None,
    exclude: Dataset | None = None,
) -> Fit:
    """Fit the calibration of ``data``'s question on its items, each asked as ``slotread eval`` asks it
    with ``request_fields`` (read options such as ``x_permutations``).

    Raises InvalidRequest (nothing is read) for data that overlaps ``exclude``, no items, or bad fields.
    """
    if exclude is not None:
        refuse_overlap(data, exclude)
    if not data.items:
        raise InvalidRequest.at(["data"], f"{data.title} has no items")
    fields = {key: value for key, value in (request_fields or {}).items() if key != "x_coverage"}
    fields["x_calibration"] = "contextual"
    requests = [build_request(data.task, item, fields) for item in data.items]
    decision = to_decision(parse_request(requests[0]))
    if decision.samples == "auto":
        raise InvalidRequest.at(["x_samples"], "'auto' reads items unevenly; calibrate with a number of samples")
    (question,) = decision.questions
    logits = []
    for request in requests:
        answer = decider.answer(request).answers[QUESTION_ID]
        assert answer is not None  # one question, no ask_if: always asked
        logits.append(np.stack([read.logits for read in answer.reads]))
        shifts = [read.shift for read in answer.reads]  # the same for every item
    stacked, gold = np.stack(logits), np.array([item.gold for item in data.items])
    schema = schema_hash(question, decision.instructions)
    temperature = fit_temperature(stacked, gold)
    content_free = decider.calibrations.content_free(schema)
    answers = {
        method: np.stack([calibrate_reads(z, shifts, method, temperature, content_free).mean(axis=0) for z in stacked])
        for method in ("none", "contextual", "temperature")
    }
    bins = fit_top_label_bins(answers["contextual"], gold)
    answers["binned"] = apply_top_label_bins(answers["contextual"], bins)
    conformal: dict[str, np.ndarray] = {method: nonconformity(answers[method], gold) for method in CONFORMAL_METHODS}
    ids = [item.id for item in data.items]
    fitted_on = {
        "data": data.title,
        "sample": list(data.sample) if data.sample else None,
        "balanced": data.balanced,
        "class_counts": class_counts(data),
        "items": len(ids),
        "ids": ids,
        "ids_sha256": hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest(),
        "excluded": exclude.title if exclude else None,
        "excluded_items": len(exclude.items) if exclude else 0,
        "request": {"x_permutations": decision.permutations, "x_samples": decision.samples, "x_seed": decision.seed},
        "ece": {method: expected_calibration_error(answers[method], gold) for method in ("contextual", "binned")},
    }
    calibration = Calibration(
        model=decider.name,
        schema=schema,
        kind=question.kind,
        options=tuple(o.name for o in question.options),
        temperature=temperature,
        content_free=content_free,
        content_free_states=CONTENT_FREE_STATES,
        bins=bins,
        conformal=conformal,
        fitted_on=fitted_on,
    )
    return Fit(calibration, stacked, gold)
