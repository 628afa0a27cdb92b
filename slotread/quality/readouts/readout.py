"""A learned readout: the head fitted for one (model, schema), how it answers a read, and its artifact.

A read's features are the slot's final hidden state h (``SlotScores.hidden``, the vector ``lm_head``
sees) followed by the label log-probabilities ℓ = z − logsumexp(z) of its label logits z in option
order; a readout fitted with ``features="logits"`` uses ℓ alone, which a remote engine (no hidden
states over vLLM's API) can serve. The head is a multinomial logistic regression on the standardised
features (``quality.readouts.logistic``) with a temperature fitted on held-out items:

    p(read) = softmax((W z + b) / T),   z = (x − μ) / σ,   x = [h, ℓ]

and the answer is the mean of p over the question's reads (its draws), like any other answer.

A readout fitted with partners (``slotread fit --vote K``, ``--lexical``) also reads the schema's
example bank: it adds w_v · log v, v the smoothed label vote of the state's K nearest bank
examples (``quality.examples``; nearest by the retrieval it was fitted with, BM25 unless
``slotread fit --retrieval`` said otherwise, and it serves only under that one), and w_l · log q̃,
q̃ the class probabilities of a TF-IDF + logistic regression classifier trained on the bank
(``quality.examples.lexical``), and w_e · log ẽ, ẽ the class probabilities of a logistic regression
on the state's sentence embedding trained on the bank (``quality.examples.dense``, ``slotread fit
--encoder``), with T and the weights fitted together on the
held-out items (``quality.readouts.fusion``):

    p(read) = softmax((W z + b) / T + w_v · log v + w_l · log q̃ + w_e · log ẽ)

The vote and the model err on different items (BANKING77, 1.5B: of 3,080 test messages, a 40-per-intent
head alone was right on 323 that a 24-neighbour vote got wrong, the vote on 210 the head got wrong), so
the product of the two beats both; so do the readout and the text classifier. Such a readout answers
only where its schema's bank is served; the store (``quality.readouts.store``) fits the partners'
classifiers on the served bank as it loads the readout (the artifact records the bank's size at fit
time, and a served bank of another size is logged as a warning).

``slotread fit`` (``quality.readouts.train``) writes the artifact as two files side by side in a directory:

    <model>.<schema[:16]>.readout.json  {"format": "slotread-readout/1", "model", "schema",
                                         "question": {"type", "options"}, "features", "hidden_size",
                                         "layout", "temperature", "l2", "vote": null | {"neighbours",
                                         "weight", "retrieval"?}, "lexical": null | {"weight", "examples"},
                                         "encoder": null | {"name", "weight", "examples"},
                                         "arrays": "<the .npz file name>",
                                         "fitted_on": {data, items, held-out metrics, ...}}
    <model>.<schema[:16]>.readout.npz   float64 arrays mean (d,), scale (d,), weight (n, d), bias (n,)

The header (``format`` to ``question``, and ``fitted_on``) is every artifact's (``quality.artifact``);
the schema is ``quality.artifact.schema_hash``, as for calibration artifacts. The vote's ``retrieval``
(``quality.examples.retrieval``) is written when it is not BM25; absent, it is BM25. ``layout`` is the prompt
layout the head was fitted on (its features depend on it): requests with ``x_readout`` are rendered
in it. A causal model's plain reads are state-first; a readout may be fitted schema-first instead,
so that one schema's KV is cached for every state (a 77-option schema is ~600 tokens, a message
~20: reads become many times cheaper on a CPU).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from slotread.core.aggregate import aggregate_reads, softmax
from slotread.core.answers import Answer
from slotread.errors import CalibrationError
from slotread.prompt.render import Layout
from slotread.quality.artifact import Artifact, file_stem, parse_header, write_json
from slotread.quality.examples.retrieval import RETRIEVALS, Retrieval
from slotread.quality.readouts.logistic import LogisticHead

FORMAT = "slotread-readout/1"
#: The JSON files of a directory that are readouts (each beside its ``.npz``).
READOUT_FILES = "*.readout.json"
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
class Readout(Artifact):
    """One (model, schema)'s fitted readout (see the module docstring)."""

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
    #: how the vote's neighbours were ranked (``quality.examples.retrieval``); served only under the same
    vote_retrieval: Retrieval = "bm25"
    #: the weight w_l of the lexical classifier's log q̃ (None: the readout has no lexical partner), and
    #: the size of the bank it was fitted with
    lexical_weight: float | None = None
    lexical_examples: int = 0
    #: the sentence encoder of the encoder partner (None: none), its weight w_e and the bank size it was
    #: fitted with
    encoder: str | None = None
    encoder_weight: float = 0.0
    encoder_examples: int = 0

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
            **self.header(FORMAT),
            "features": self.features,
            "hidden_size": self.hidden_size,
            "layout": self.layout,
            "temperature": self.temperature,
            "l2": self.l2,
            "vote": self._vote() if self.vote_neighbours else None,
            "lexical": None
            if self.lexical_weight is None
            else {"weight": self.lexical_weight, "examples": self.lexical_examples},
            "encoder": None
            if self.encoder is None
            else {"name": self.encoder, "weight": self.encoder_weight, "examples": self.encoder_examples},
            "arrays": arrays,
            "fitted_on": dict(self.fitted_on),
        }

    def _vote(self) -> dict[str, Any]:
        """The artifact's vote; its retrieval only when not BM25, so a BM25 readout's file reads as before."""
        vote: dict[str, Any] = {"neighbours": self.vote_neighbours, "weight": self.vote_weight}
        return vote | ({"retrieval": self.vote_retrieval} if self.vote_retrieval != "bm25" else {})

    def save(self, directory: Path) -> Path:
        """Write the two files into ``directory`` (arrays first, each atomically); returns the JSON path."""
        directory.mkdir(parents=True, exist_ok=True)
        stem = artifact_stem(self.model, self.schema)
        arrays = directory / f"{stem}.npz"
        with tempfile.NamedTemporaryFile(dir=directory, suffix=".tmp", delete=False) as out:
            np.savez(out, mean=self.head.mean, scale=self.head.scale, weight=self.head.weight, bias=self.head.bias)
        os.replace(out.name, arrays)
        path = directory / f"{stem}.json"
        write_json(path, self.to_json(arrays.name))
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
    return any(Readout.load(path).banked for path in sorted(directory.glob(READOUT_FILES)))


def artifact_stem(model: str, schema: str) -> str:
    """``<model>.<schema[:16]>.readout``, the model name made file-safe."""
    return f"{file_stem(model, schema)}.readout"


def _parse(data: Any, head: LogisticHead) -> Readout:
    header = parse_header(data, FORMAT)
    options = header["options"]
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
    retrieval = vote.get("retrieval", "bm25")  # absent from artifacts fitted before dense retrieval: BM25
    if retrieval not in RETRIEVALS:
        raise ValueError(f"the vote's retrieval must be one of {', '.join(RETRIEVALS)}, got {retrieval!r}")
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
        **header,
        features=features,
        hidden_size=hidden_size,
        layout=layout,
        head=head,
        temperature=temperature,
        l2=float(data["l2"]),
        vote_neighbours=neighbours,
        vote_weight=weight,
        vote_retrieval=retrieval,
        lexical_weight=lexical_weight,
        lexical_examples=lexical_examples,
        encoder=None if encoder is None else str(encoder["name"]),
        encoder_weight=encoder_weight,
        encoder_examples=encoder_examples,
    )
