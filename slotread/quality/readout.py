"""Learned readouts: a small head per (model, question schema) that answers from the model's own read.

A read's features are the slot's final hidden state h (``SlotScores.hidden``, the vector ``lm_head``
sees) followed by the label log-probabilities ℓ = z − logsumexp(z) of its label logits z in option
order; a readout fitted with ``features="logits"`` uses ℓ alone, which a remote engine (no hidden
states over vLLM's API) can serve. The head is a multinomial logistic regression on the standardised
features (``quality.logistic``) with a temperature fitted on held-out items:

    p(read) = softmax((W z + b) / T),   z = (x − μ) / σ,   x = [h, ℓ]

and the answer is the mean of p over the question's reads (its draws), like any other answer.

A readout fitted with partners (``slotread fit --vote K``, ``--lexical``) also reads the schema's
example bank: it adds w_v · log v, v the smoothed label vote of the state's K BM25-nearest bank
examples (``quality.examples``), and w_l · log q̃, q̃ the class probabilities of a TF-IDF + logistic
regression classifier trained on the bank (``quality.lexical``), and w_e · log ẽ, ẽ the class
probabilities of a logistic regression on the state's sentence embedding trained on the bank
(``quality.dense``, ``slotread fit --encoder``), with T and the weights fitted together on the
held-out items (``quality.fusion``):

    p(read) = softmax((W z + b) / T + w_v · log v + w_l · log q̃ + w_e · log ẽ)

The vote and the model err on different items (BANKING77, 1.5B: of 3,080 test messages, a 40-per-intent
head alone was right on 323 that a 24-neighbour vote got wrong, the vote on 210 the head got wrong), so
the product of the two beats both; so do the readout and the text classifier. Such a readout answers
only where its schema's bank is served; the store fits the lexical classifier on the served bank as
it loads the readout (the artifact records the bank's size at fit time, and a served bank of another
size is logged as a warning).
``slotread fit`` writes the artifact as two files side by side in a directory:

    <model>.<schema[:16]>.readout.json  {"format": "slotread-readout/1", "model", "schema",
                                         "question": {"type", "options"}, "features", "hidden_size",
                                         "layout", "temperature", "l2", "vote": null | {"neighbours",
                                         "weight"}, "lexical": null | {"weight", "examples"},
                                         "encoder": null | {"name", "weight", "examples"},
                                         "arrays": "<the .npz file name>",
                                         "fitted_on": {data, items, held-out metrics, ...}}
    <model>.<schema[:16]>.readout.npz   float64 arrays mean (d,), scale (d,), weight (n, d), bias (n,)

The schema is ``quality.artifact.schema_hash``, as for calibration artifacts. ``layout`` is the prompt
layout the head was fitted on (its features depend on it): requests with ``x_readout`` are rendered
in it. A causal model's plain reads are state-first; a readout may be fitted schema-first instead,
so that one schema's KV is cached for every state (a 77-option schema is ~600 tokens, a message
~20: reads become many times cheaper on a CPU).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from slotread.core.aggregate import aggregate_reads, softmax
from slotread.core.answers import Answer
from slotread.core.questions import Decision
from slotread.errors import CalibrationError, ExampleBankError, InvalidRequest
from slotread.prompt.render import Layout
from slotread.quality.artifact import schema_hash
from slotread.quality.dense import EmbeddingClassifier, bank_embedding_classifier
from slotread.quality.examples import ExampleBank, ExampleBanks
from slotread.quality.lexical import TextClassifier, bank_classifier, floored
from slotread.quality.logistic import LogisticHead
from slotread.quality.meaning import Embed

logger = logging.getLogger(__name__)

FORMAT = "slotread-readout/1"
#: What a head reads: the slot's hidden state and the label log-probabilities, or the latter alone.
Features = Literal["hidden+logits", "logits"]
FEATURES: tuple[Features, ...] = ("hidden+logits", "logits")


def read_features(logits: np.ndarray, hidden: np.ndarray | None, features: Features) -> np.ndarray:
    """The features (R, d) of reads with label logits (R, n) and hidden states (R, H) (None for "logits")."""
    z = np.asarray(logits, dtype=np.float64)
    peak = z.max(axis=-1, keepdims=True)
    log_p = z - peak - np.log(np.exp(z - peak).sum(axis=-1, keepdims=True))
    if features == "logits":
        return log_p
    assert hidden is not None
    return np.concatenate([np.asarray(hidden, dtype=np.float64), log_p], axis=-1)


@dataclass(frozen=True, eq=False)
class Readout:
    """One (model, schema)'s fitted readout (see the module docstring)."""

    model: str
    schema: str
    kind: str
    options: tuple[str, ...]
    features: Features
    hidden_size: int | None
    #: the prompt layout the reads were rendered in (``prompt.render.LAYOUTS``); answers are read in it too
    layout: Layout
    head: LogisticHead
    temperature: float
    l2: float
    #: the bank neighbours whose vote the answer adds (0: none), and its weight w_v
    vote_neighbours: int = 0
    vote_weight: float = 0.0
    #: the weight w_l of the lexical classifier's log q̃ (None: the readout has no lexical partner), and
    #: the size of the bank it was fitted with
    lexical_weight: float | None = None
    lexical_examples: int = 0
    #: the sentence encoder of the encoder partner (None: none), its weight w_e and the bank size it was
    #: fitted with
    encoder: str | None = None
    encoder_weight: float = 0.0
    encoder_examples: int = 0
    fitted_on: Mapping[str, Any] = field(default_factory=dict)

    @property
    def banked(self) -> bool:
        """Whether the readout reads its schema's example bank (a vote, a lexical or an encoder partner)."""
        return bool(self.vote_neighbours) or self.lexical_weight is not None or self.encoder is not None

    def probabilities(
        self,
        logits: np.ndarray,
        hidden: np.ndarray | None,
        vote: np.ndarray | None = None,
        lexical: np.ndarray | None = None,
        dense: np.ndarray | None = None,
    ) -> np.ndarray:
        """Each read's answer distribution (R, n) from its label logits (R, n), hidden states (R, H) and,
        for a readout with partners, the bank's vote v (n,), the lexical classifier's q̃ (n,) and the
        embedding classifier's ẽ (n,)."""
        scores = self.head.scores(read_features(logits, hidden, self.features)) / self.temperature
        if self.vote_neighbours:
            if vote is None:
                raise ValueError(f"this readout adds the vote of {self.vote_neighbours} bank examples; none was given")
            scores = scores + self.vote_weight * np.log(vote)
        if self.lexical_weight is not None:
            if lexical is None:
                raise ValueError("this readout adds its lexical classifier's probabilities; none were given")
            scores = scores + self.lexical_weight * np.log(lexical)
        if self.encoder is not None:
            if dense is None:
                raise ValueError("this readout adds its embedding classifier's probabilities; none were given")
            scores = scores + self.encoder_weight * np.log(dense)
        return softmax(scores)

    def answer(
        self,
        answer: Answer,
        vote: np.ndarray | None = None,
        lexical: np.ndarray | None = None,
        dense: np.ndarray | None = None,
    ) -> Answer:
        """``answer`` with its probabilities from this head: the mean of each read's ``probabilities``.

        Raises ValueError when the reads lack the hidden states this head reads, or have another size,
        or a readout with partners is not given theirs.
        """
        logits = np.stack([read.logits for read in answer.reads])
        hidden = None
        if self.features == "hidden+logits":
            states = [read.hidden for read in answer.reads]
            if any(state is None or state.shape != (self.hidden_size,) for state in states):
                raise ValueError(f"this readout reads hidden states of size {self.hidden_size}; the reads differ")
            hidden = np.stack([state for state in states if state is not None])
        return replace(answer, summary=aggregate_reads(self.probabilities(logits, hidden, vote, lexical, dense)))

    def to_json(self, arrays: str) -> dict[str, Any]:
        """The artifact's JSON part, naming its ``arrays`` file."""
        return {
            "format": FORMAT,
            "model": self.model,
            "schema": self.schema,
            "question": {"type": self.kind, "options": list(self.options)},
            "features": self.features,
            "hidden_size": self.hidden_size,
            "layout": self.layout,
            "temperature": self.temperature,
            "l2": self.l2,
            "vote": {"neighbours": self.vote_neighbours, "weight": self.vote_weight} if self.vote_neighbours else None,
            "lexical": None
            if self.lexical_weight is None
            else {"weight": self.lexical_weight, "examples": self.lexical_examples},
            "encoder": None
            if self.encoder is None
            else {"name": self.encoder, "weight": self.encoder_weight, "examples": self.encoder_examples},
            "arrays": arrays,
            "fitted_on": dict(self.fitted_on),
        }

    def save(self, directory: Path) -> Path:
        """Write the two files into ``directory`` (arrays first, each atomically); returns the JSON path."""
        directory.mkdir(parents=True, exist_ok=True)
        stem = artifact_stem(self.model, self.schema)
        arrays = directory / f"{stem}.npz"
        with tempfile.NamedTemporaryFile(dir=directory, suffix=".tmp", delete=False) as out:
            np.savez(out, mean=self.head.mean, scale=self.head.scale, weight=self.head.weight, bias=self.head.bias)
        os.replace(out.name, arrays)
        path = directory / f"{stem}.json"
        with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False, encoding="utf-8") as text:
            json.dump(self.to_json(arrays.name), text, ensure_ascii=False, indent=1)
        os.replace(text.name, path)
        return path

    @classmethod
    def load(cls, path: Path) -> Readout:
        """Read an artifact from its JSON file; raises CalibrationError naming the file and the problem."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            with np.load(path.parent / data["arrays"], allow_pickle=False) as arrays:
                head = LogisticHead(
                    *(np.asarray(arrays[name], np.float64) for name in ("mean", "scale", "weight", "bias"))
                )
            return _parse(data, head)
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CalibrationError(f"{path}: not a readable slotread readout artifact: {exc}") from None


def banked_in(directory: Path) -> bool:
    """Whether any readout artifact in ``directory`` reads its example bank (so one must be served)."""
    return any(Readout.load(path).banked for path in sorted(directory.glob("*.readout.json")))


def artifact_stem(model: str, schema: str) -> str:
    """``<model>.<schema[:16]>.readout``, the model name made file-safe."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-.") or "model"
    return f"{slug}.{schema[:16]}.readout"


def _parse(data: Any, head: LogisticHead) -> Readout:
    if data.get("format") != FORMAT:
        raise ValueError(f"format must be {FORMAT!r}, got {data.get('format')!r}")
    options = tuple(str(o) for o in data["question"]["options"])
    features = data["features"]
    if features not in FEATURES:
        raise ValueError(f"features must be one of {FEATURES}, got {features!r}")
    hidden_size = None if data["hidden_size"] is None else int(data["hidden_size"])
    if features == "hidden+logits" and not (hidden_size and hidden_size > 0):
        raise ValueError("a hidden+logits readout needs a positive hidden_size")
    width = len(options) + (hidden_size if features == "hidden+logits" and hidden_size else 0)
    shapes = (head.mean.shape, head.scale.shape, head.weight.shape, head.bias.shape)
    if shapes != ((width,), (width,), (len(options), width), (len(options),)):
        raise ValueError(f"arrays of shapes {shapes} do not fit {len(options)} options and {width} features")
    layout = data["layout"]
    if layout not in ("schema_first", "state_first"):
        raise ValueError(f"layout must be schema_first or state_first, got {layout!r}")
    temperature = float(data["temperature"])
    if not (math.isfinite(temperature) and temperature > 0) or not np.all(head.scale > 0):
        raise ValueError("the temperature and every feature scale must be positive")
    vote = data.get("vote") or {"neighbours": 0, "weight": 0.0}
    neighbours, weight = int(vote["neighbours"]), float(vote["weight"])
    if neighbours < 0 or not (math.isfinite(weight) and weight >= 0):
        raise ValueError(f"the vote's neighbours and weight must not be negative, got {neighbours} and {weight}")
    lexical = data.get("lexical")  # absent from artifacts fitted before the lexical partner
    lexical_weight = None if lexical is None else float(lexical["weight"])
    lexical_examples = 0 if lexical is None else int(lexical["examples"])
    if lexical_weight is not None and not (
        math.isfinite(lexical_weight) and lexical_weight >= 0 and lexical_examples > 0
    ):
        raise ValueError(f"the lexical weight must not be negative nor its bank empty, got {lexical}")
    encoder = data.get("encoder")  # absent from artifacts fitted before the encoder partner
    encoder_weight = 0.0 if encoder is None else float(encoder["weight"])
    encoder_examples = 0 if encoder is None else int(encoder["examples"])
    if encoder is not None and not (math.isfinite(encoder_weight) and encoder_weight >= 0 and encoder_examples > 0):
        raise ValueError(f"the encoder weight must not be negative nor its bank empty, got {encoder}")
    return Readout(
        model=str(data["model"]),
        schema=str(data["schema"]),
        kind=str(data["question"]["type"]),
        options=options,
        features=features,
        hidden_size=hidden_size,
        layout=layout,
        head=head,
        temperature=temperature,
        l2=float(data["l2"]),
        vote_neighbours=neighbours,
        vote_weight=weight,
        lexical_weight=lexical_weight,
        lexical_examples=lexical_examples,
        encoder=None if encoder is None else str(encoder["name"]),
        encoder_weight=encoder_weight,
        encoder_examples=encoder_examples,
        fitted_on=dict(data.get("fitted_on", {})),
    )


class ReadoutStore:
    """The readouts of one model, by schema, from a directory of ``slotread fit`` artifacts.

    ``hidden_states`` says whether the engine returns hidden states (a remote one does not: only
    "logits" readouts can answer there). The lexical classifier of a readout with one is fitted on its
    schema's bank in ``banks`` here, once (logged with the time it took). Raises CalibrationError if an
    artifact cannot be read or two claim one schema; artifacts of other models are skipped.
    """

    def __init__(
        self,
        model: str,
        directory: Path | None = None,
        *,
        hidden_states: bool = True,
        banks: ExampleBanks | None = None,
        encoder: str | None = None,
        embed: Embed | None = None,
    ) -> None:
        self.model = model
        self.encoder = encoder
        self.hidden_states = hidden_states
        self._readouts: dict[str, tuple[Readout, Path]] = {}
        self._lexical: dict[str, TextClassifier] = {}
        self._dense: dict[str, EmbeddingClassifier] = {}
        for path in sorted(directory.glob("*.readout.json")) if directory is not None else []:
            readout = Readout.load(path)
            if readout.model != model:
                logger.info("%s reads out %s, not %s: skipped", path, readout.model, model)
                continue
            if readout.schema in self._readouts:
                other = self._readouts[readout.schema][1]
                raise CalibrationError(f"{path} and {other} are both readouts of schema {readout.schema} of {model}")
            self._readouts[readout.schema] = (readout, path)
        if directory is not None:
            logger.info("%d readouts for %s from %s", len(self._readouts), model, directory)
        for schema, (readout, path) in self._readouts.items():
            bank = banks.get(schema) if banks is not None else None
            if readout.lexical_weight is not None and bank is not None:
                self._lexical[schema] = fit_lexical(readout, bank, path)
            if readout.encoder is not None and readout.encoder == encoder and embed is not None and bank is not None:
                self._dense[schema] = fit_dense(readout, bank, path, embed)

    def lexical(self, schema: str, state: str) -> np.ndarray:
        """q̃ (n,) of ``state`` from the lexical classifier of ``schema``'s readout (KeyError if none was fitted)."""
        return floored(self._lexical[schema].probabilities([state])[0])

    def dense(self, schema: str, state: str) -> np.ndarray:
        """ẽ (n,) of ``state`` from the embedding classifier of ``schema``'s readout (KeyError if none)."""
        return floored(self._dense[schema].probabilities([state])[0])

    def get(self, schema: str) -> Readout | None:
        """The readout of a schema, if one was loaded."""
        found = self._readouts.get(schema)
        return found[0] if found else None

    def layout_for(self, decision: Decision) -> Layout | None:
        """The prompt layout the readouts of ``decision``'s questions were fitted in (None if one is
        missing: answering refuses that). Raises InvalidRequest when they differ: one decision is
        rendered in one layout."""
        found = [self.get(schema_hash(q, decision.instructions)) for q in decision.questions]
        layouts = {readout.layout for readout in found if readout is not None}
        if len(layouts) > 1:
            msg = (
                f"the readouts of these questions were fitted in different prompt layouts {sorted(layouts)}: ask apart"
            )
            raise InvalidRequest.at(["body", "x_readout"], msg)
        return layouts.pop() if layouts and None not in found else None

    def problem(self, question_id: str, schema: str, banked: bool) -> str | None:
        """Why question ``question_id`` (of ``schema``; ``banked``: an example bank serves it) cannot be
        answered with a readout here, or None."""
        readout = self.get(schema)
        where = f"question {question_id!r} on {self.model} (schema {schema[:16]})"
        if readout is None:
            return f"no readout is loaded for {where}; fit one with `slotread fit` and load it with --readout DIR"
        if readout.banked and not banked:
            partners = []
            if readout.vote_neighbours:
                partners.append(f"the vote of its {readout.vote_neighbours} nearest example-bank examples")
            if readout.lexical_weight is not None:
                partners.append("a text classifier trained on its example bank")
            if readout.encoder is not None:
                partners.append("an embedding classifier trained on its example bank")
            return (
                f"the readout of {where} adds {' and '.join(partners)}, and no bank serves this question; "
                "serve one with --example-bank"
            )
        if readout.lexical_weight is not None and schema not in self._lexical:
            return f"the readout of {where} has no lexical classifier: its readouts were loaded without its bank"
        if readout.encoder is not None and schema not in self._dense:
            return (
                f"the readout of {where} adds an embedding classifier of the sentence encoder {readout.encoder}: "
                f"serve that encoder (--encoder {readout.encoder}) and its bank"
            )
        if readout.features == "hidden+logits" and not self.hidden_states:
            return (
                f"the readout of {where} reads hidden states, which a remote engine does not return; "
                "fit one with `slotread fit --features logits` for this server"
            )
        return None


def fit_dense(readout: Readout, bank: ExampleBank, path: Path, embed: Embed) -> EmbeddingClassifier:
    """The embedding classifier of ``readout`` (from ``path``), fitted on the served ``bank``; logs the time,
    and warns when the bank's size differs from the one the readout was fitted with."""
    started = time.perf_counter()
    try:
        classifier = bank_embedding_classifier(bank, embed)
    except ValueError as exc:
        raise ExampleBankError(f"{bank.source}: cannot fit the embedding classifier of {path}: {exc}") from None
    logger.info(
        "the embedding classifier of %s: %d examples in %.1f s", path.name, len(bank), time.perf_counter() - started
    )
    if len(bank) != readout.encoder_examples:
        logger.warning(
            "%s was fitted with a bank of %d examples; %s serves %d: its encoder weight may not fit",
            path,
            readout.encoder_examples,
            bank.source,
            len(bank),
        )
    return classifier


def fit_lexical(readout: Readout, bank: ExampleBank, path: Path) -> TextClassifier:
    """The lexical classifier of ``readout`` (from ``path``), fitted on the served ``bank``; logs the time,
    and warns when the bank's size differs from the one the readout was fitted with."""
    started = time.perf_counter()
    try:
        classifier = bank_classifier(bank)
    except ValueError as exc:
        raise ExampleBankError(f"{bank.source}: cannot fit the lexical classifier of {path}: {exc}") from None
    logger.info(
        "the lexical classifier of %s: fitted on %d examples of %s in %.1f s",
        path.name,
        len(bank),
        bank.source,
        time.perf_counter() - started,
    )
    if len(bank) != readout.lexical_examples:
        logger.warning(
            "%s was fitted with a bank of %d examples; %s serves %d: its lexical weight may not fit",
            path,
            readout.lexical_examples,
            bank.source,
            len(bank),
        )
    return classifier
