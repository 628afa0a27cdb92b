"""A request's calibration, around its reads: refuse what the store cannot serve, then finish each answer.

Before reading, ``refuse_unfitted`` answers 422 for a temperature or bins never fitted for a question,
or conformal scores missing or fitted under other read options. After each read, ``calibrate``
calibrates every read by ``x_calibration`` and averages them again (for ``binned``: contextually, then
the fitted top-label bins on the mean), and ``conformal_set`` adds the prediction set at ``x_coverage``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from slotread.core.aggregate import aggregate_reads, normalised_entropy, softmax
from slotread.core.answers import Answer
from slotread.core.questions import CalibrationMethod, Decision, Question
from slotread.core.reads import question_shifts
from slotread.errors import ErrorDetail, InvalidRequest
from slotread.quality.calibration.artifact import Calibration
from slotread.quality.calibration.conformal import conformal_threshold, prediction_set
from slotread.quality.calibration.methods import apply_top_label_bins, calibrate_reads, divide_prior
from slotread.quality.calibration.store import CalibrationStore


def refuse_unfitted(decision: Decision, store: CalibrationStore, schemas: Mapping[str, str]) -> None:
    """Raise InvalidRequest naming every fit ``decision`` needs and ``store`` lacks (``schemas``: each
    question's schema hash by question id)."""
    problems: list[ErrorDetail] = []
    for question in decision.questions:
        schema = schemas[question.id]
        fitted = store.artifact(schema)
        if decision.quality.calibration == "temperature" and (fitted is None or fitted.temperature is None):
            msg = (
                f"no temperature is fitted for question {question.id!r} on {store.model} (schema {schema[:16]}); "
                "fit one with `slotread calibrate` and serve it with --calibration, or ask for 'contextual' or 'batch'"
            )
            problems.append({"loc": ["body", "x_calibration"], "msg": msg, "type": "value_error"})
        if decision.quality.calibration == "binned" and (fitted is None or fitted.bins is None):
            msg = (
                f"no top-label bins are fitted for question {question.id!r} on {store.model} (schema {schema[:16]}); "
                "fit them with `slotread calibrate` and serve them with --calibration, or ask for 'contextual'"
            )
            problems.append({"loc": ["body", "x_calibration"], "msg": msg, "type": "value_error"})
        unset = _conformal_problem(question, decision, fitted, store.model, schema)
        if decision.quality.coverage is not None and question.kind != "noul" and unset:
            problems.append({"loc": ["body", "x_coverage"], "msg": unset, "type": "value_error"})
    if problems:
        raise InvalidRequest(problems)


def _conformal_problem(
    question: Question, decision: Decision, fitted: Calibration | None, model: str, schema: str
) -> str | None:
    """Why no prediction set can be given for ``question``, or None if one can."""
    where = f"question {question.id!r} on {model} (schema {schema[:16]})"
    if fitted is None or decision.quality.calibration not in fitted.conformal:
        return (
            f"no conformal scores for x_calibration {decision.quality.calibration!r} are fitted for {where}; "
            "fit them with `slotread calibrate` and serve them with --calibration"
        )
    fitted_shifts = question_shifts(question, fitted.permutations)
    if fitted_shifts != question_shifts(question, decision.permutations):
        return (
            f"the conformal scores of {where} were fitted with x_permutations {fitted.permutations} "
            f"({len(fitted_shifts)} assignments); this request reads others, so their coverage would not hold"
        )
    return None


def calibrate(
    answer: Answer,
    method: CalibrationMethod,
    schema: str,
    store: CalibrationStore,
    fitted: Calibration | None,
    content_free: Mapping[int, np.ndarray],
) -> Answer:
    """The answer with each read calibrated by ``method``, then averaged again (for ``binned``: contextually,
    then the mean's top probability binned; the reads' stderr and agreement stay those of the
    contextual reads).

    ``fitted`` and ``content_free`` are the schema's artifact and content-free distributions; ``store``
    keeps the batch priors.
    """
    logits = np.stack([read.logits for read in answer.reads])  # (R, n)
    shifts = [read.shift for read in answer.reads]
    if method == "batch":
        priors = store.batch.priors_then_update([(schema, s) for s in shifts], softmax(logits))
        per_read = divide_prior(logits, priors)
    else:
        temperature = fitted.temperature if fitted else None
        per_read_method = "contextual" if method == "binned" else method
        per_read = calibrate_reads(logits, shifts, per_read_method, temperature, content_free)
    summary = aggregate_reads(per_read)
    if method == "binned":
        assert fitted is not None and fitted.bins is not None  # refuse_unfitted refused the decision otherwise
        binned = apply_top_label_bins(summary.probabilities, fitted.bins)
        summary = replace(summary, probabilities=binned, entropy=normalised_entropy(binned))
    return replace(answer, summary=summary)


def conformal_set(answer: Answer, decision: Decision, fitted: Calibration | None) -> Answer:
    """The answer with its prediction set at ``decision.quality.coverage`` when one is asked for (a choice
    or a score; a noul has none)."""
    found = None
    if decision.quality.coverage is not None and answer.question.kind != "noul":
        assert fitted is not None  # refuse_unfitted refused the decision otherwise
        threshold = conformal_threshold(fitted.conformal[decision.quality.calibration], decision.quality.coverage)
        found = prediction_set(answer.summary.probabilities, threshold)
    return replace(answer, prediction_set=found)
