"""Fit a learned readout from labelled examples: the Python API behind ``slotread fit``
(``eval.fitting.write_readout`` calls it with the data, model and options its settings name).

The data is an evaluation ``Dataset`` (a built-in split or a labelled file with its question), as for
``slotread calibrate``, and each item is asked the request ``slotread eval`` sends for it with
``x_readout`` on, so the readout's schema is the one the evaluation asks. Like ``slotread calibrate``'s
``quality.calibration.train`` it reads through the ``Decider``, above the rest of ``quality``. Steps:

1. refuse data that overlaps the evaluation data (``exclude``, ``eval.training.refuse_overlap``; or
   drop those items), then keep at most ``per_class`` items of each class (seeded);
2. read every item once (its draws on a noisy model), ``batch_size`` items per engine call
   (``core.reads.read_each``), keeping each read's label logits and slot hidden state;
3. split the items, stratified by class and seeded, into a training part and ``holdout`` share; when
   that share would hold fewer than ``MIN_HELD_OUT`` items (few labels), cross-fit instead: every item
   is held out once, its scores from a head fitted on the other ``CROSS_FOLDS`` − 1 folds;
4. fit the logistic head (``logistic``) on the training reads for each L2 strength given and keep
   the one with the lowest held-out NLL (cross-fitting: refit on every item), then fit its
   temperature on the held-out items (``fusion.fit_fusion``, shrunk toward T = 1 and unit weights by
   a prior worth ``PRIOR_ITEMS`` items); with ``vote``, ``lexical`` or ``encoder``, the
   temperature and the partners' weights together, on a bank of all the data (before per-class
   sampling): each held-out item's vote without the item's own text, its lexical and embedding
   classifiers' q̃ cross-fitted (``quality.examples.lexical.cross_fitted``, ``quality.examples.dense``);
5. report held-out accuracy, NLL and ECE of the readout beside the plain read (the label softmax)
   on the same items (with partners, also the head alone and each partner alone), with the accuracy's
   95% half-width; ``metrics["trusted"]`` is 0 when they rest on fewer than ``TRUSTED_ITEMS`` items.
   The temperature (and weights) are fitted on those items too (one to four parameters, shrunk), so
   their numbers are slightly optimistic: judge a readout with ``slotread eval``.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from slotread.api.systemone import parse_request, to_decision
from slotread.core.aggregate import softmax
from slotread.core.reads import read_each
from slotread.decider import Decider
from slotread.errors import ExampleBankError, InvalidRequest
from slotread.eval.datasets import Dataset, per_class_sample
from slotread.eval.metrics import expected_calibration_error
from slotread.eval.runner import build_request, option_names
from slotread.eval.training import drop_overlap as overlap_dropped
from slotread.eval.training import refuse_overlap
from slotread.models.encoder import SentenceEncoder
from slotread.prompt.render import Layout, Renderer
from slotread.quality.artifact import schema_hash
from slotread.quality.calibration.methods import mean_nll
from slotread.quality.examples.bank import ExampleBank
from slotread.quality.examples.dense import cross_fitted_dense
from slotread.quality.examples.lexical import FOLDS as LEXICAL_FOLDS
from slotread.quality.examples.lexical import cross_fitted
from slotread.quality.examples.retrieval import Retrieval
from slotread.quality.readouts.fusion import fit_fusion
from slotread.quality.readouts.logistic import LogisticHead, fit_logistic
from slotread.quality.readouts.readout import Features, Readout, read_features
from slotread.settings import FitSettings

#: ``slotread fit``'s defaults, written once in ``FitSettings``
DEFAULTS = FitSettings.model_construct()
#: A held-out share smaller than this many items is replaced by cross-fitting over every item ...
MIN_HELD_OUT = 200
#: ... in this many folds.
CROSS_FOLDS = 5
#: The prior that keeps T and the partners' weights near 1, in items (``quality.readouts.fusion``). With 8 per
#: class on TREC-6 (10 held out) the unshrunk fit ran to T = 0.095 and both weights to the cap.
PRIOR_ITEMS = 20.0
#: Held-out figures from fewer items are flagged (``metrics["trusted"]`` = 0, a warning in ``slotread fit``).
TRUSTED_ITEMS = 300


@dataclass(frozen=True)
class ReadoutFit:
    """A fitted readout and its held-out numbers (``readout.fitted_on["metrics"]``)."""

    readout: Readout
    metrics: dict[str, float]


def holdout_split(gold: np.ndarray, share: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Item indices (train, held out), seeded: round(share · N) items held out, spread over the classes
    in proportion (each class's items shuffled, the k-th of n ranked (k + ½)/n, the lowest ranks held)."""
    rng = np.random.default_rng(seed)
    rank = np.empty(len(gold))
    for label in np.unique(gold):
        members = rng.permutation(np.flatnonzero(gold == label))
        rank[members] = (np.arange(len(members)) + 0.5) / len(members)
    order = np.lexsort((rng.random(len(gold)), rank))  # ties between classes broken at random
    cut = round(share * len(gold))
    return np.sort(order[cut:]), np.sort(order[:cut])


def cross_folds(gold: np.ndarray, folds: int, seed: int) -> np.ndarray:
    """Each item's fold in [0, folds), seeded and stratified: a class's items, shuffled, are dealt in turn."""
    rng = np.random.default_rng(seed)
    fold = np.empty(len(gold), dtype=np.int64)
    start = 0
    for label in np.unique(gold):
        members = rng.permutation(np.flatnonzero(gold == label))
        fold[members] = (start + np.arange(len(members))) % folds
        start += len(members)  # the next class continues the deal, so small classes fill the folds evenly
    return fold


def accuracy_half_width(accuracy: float, items: int) -> float:
    """The normal-approximation 95% half-width of an accuracy measured on ``items`` items."""
    return 1.96 * float(np.sqrt(accuracy * (1 - accuracy) / max(items, 1)))


def read_items(
    decider: Decider, renderer: Renderer, requests: Sequence[dict[str, Any]], batch_size: int, progress: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """Each request's reads of its one question: label logits (N, R, n) in option order and slot hidden
    states (N, R, H), None where the engine returns none (a remote one)."""
    decisions = [
        to_decision(
            parse_request(request),
            max_samples=decider.max_samples,
            max_options=decider.max_options,
            max_permutations=decider.max_permutations,
        )
        for request in requests
    ]
    logits: list[np.ndarray] = []
    hidden: list[list[np.ndarray | None]] = []
    with tqdm(total=len(decisions), desc="reading", unit="item", disable=not progress) as bar:
        for start in range(0, len(decisions), batch_size):
            chunk = decisions[start : start + batch_size]
            for (answer,) in read_each(chunk, decider.engine, renderer, decider.max_prompt_tokens):
                logits.append(np.stack([read.logits for read in answer.reads]))
                hidden.append([read.hidden for read in answer.reads])
            bar.update(len(chunk))
    states = [state for item in hidden for state in item]
    if any(state is None for state in states):
        return np.stack(logits), None
    return np.stack(logits), np.stack([np.stack(item) for item in hidden])  # type: ignore[arg-type]


def fit_readout(
    decider: Decider,
    data: Dataset,
    *,
    features: Features = DEFAULTS.features,
    layout: Layout | None = DEFAULTS.layout,
    per_class: int | None = DEFAULTS.per_class,
    holdout: float = DEFAULTS.holdout,
    seed: int = DEFAULTS.sample_seed,
    l2: Sequence[float] = tuple(DEFAULTS.l2),
    request_fields: dict[str, Any] | None = None,
    exclude: Dataset | None = None,
    drop_overlap: bool = False,
    vote: int = DEFAULTS.vote,
    retrieval: Retrieval = DEFAULTS.retrieval,
    lexical: bool = DEFAULTS.lexical,
    encoder: SentenceEncoder | None = None,
    batch_size: int = DEFAULTS.batch_size,
    progress: bool = True,
) -> ReadoutFit:
    """Fit the readout of ``data``'s question (the module docstring's steps); ``request_fields`` are read
    options such as ``x_seed`` or ``x_samples`` (the draws a noisy model reads per item). ``layout``
    renders the reads (default: the model family's, as plain reads; see ``quality.readouts.readout``).
    ``drop_overlap`` drops the items that ``exclude`` holds instead of refusing the data (BANKING77's
    train split repeats 7 of its test messages). ``vote`` > 0 fits a readout that adds the label vote
    of that many nearest example-bank examples (``quality.readouts.readout``), ranked by ``retrieval``
    (dense and hybrid embed with ``encoder``; recorded, and the readout serves only under it);
    ``lexical`` one that adds a TF-IDF + logistic regression classifier trained on the bank
    (``quality.examples.lexical``); ``encoder`` one that adds a logistic regression on that sentence
    encoder's embeddings of the bank (``quality.examples.dense``). Each is served with a bank (and the encoder).

    Raises InvalidRequest, before anything is read, for data that overlaps ``exclude`` or has no items,
    read options x_readout refuses, a holdout share outside (0, 1), a negative ``vote`` or an engine that
    returns no hidden states for a "hidden+logits" readout; and after reading, for items too few to
    split or a bank whose classifiers cannot be cross-fitted (a training part with one option).
    """
    if not 0 < holdout < 1:
        raise InvalidRequest.at(["holdout"], f"the holdout share must be between 0 and 1, got {holdout}")
    if vote < 0:
        raise InvalidRequest.at(["vote"], f"the vote's neighbours must not be negative, got {vote}")
    dropped = 0
    if exclude is not None:
        if drop_overlap:
            data, dropped = overlap_dropped(data, exclude)
        refuse_overlap(data, exclude)
    if not data.items:
        raise InvalidRequest.at(["data"], f"{data.title} has no items")
    everything = data
    data = per_class_sample(data, per_class, seed)
    fields = {**(request_fields or {}), "x_readout": True}
    requests = [build_request(data.task, item, fields) for item in data.items]
    decision = to_decision(parse_request(requests[0]))
    if decision.samples == "auto":
        raise InvalidRequest.at(["x_samples"], "'auto' reads items unevenly; fit with a number of samples")
    if features == "hidden+logits" and not decider.readouts.hidden_states:
        msg = "this engine returns no hidden states (a remote engine): fit with features 'logits'"
        raise InvalidRequest.at(["features"], msg)
    (question,) = decision.questions
    bank = None
    if (
        vote or lexical or encoder is not None
    ):  # all the data, before per-class sampling, as a served bank holds every example
        names = option_names(data.task)
        pairs = [(item.state, names[item.gold]) for item in everything.items]
        embed = encoder.embed if encoder is not None else None
        try:
            bank = ExampleBank.from_pairs(
                question, decision.instructions, pairs, everything.title, retrieval=retrieval, embed=embed
            )
        except ExampleBankError as exc:  # dense or hybrid retrieval without an encoder
            raise InvalidRequest.at(["retrieval"], str(exc)) from None

    started = time.perf_counter()
    renderer = decider.renderer_for(layout) if layout else decider.renderer
    logits, hidden = read_items(decider, renderer, requests, batch_size, progress)  # (N, R, n), (N, R, H)
    read_seconds = time.perf_counter() - started
    gold = np.array([item.gold for item in data.items])
    cross = round(holdout * len(gold)) < MIN_HELD_OUT
    head_folds = 0
    if cross:
        head_folds = min(CROSS_FOLDS, len(gold))
        if head_folds < 2:
            raise InvalidRequest.at(["data"], f"{len(gold)} items are too few to cross-fit")
        fold = cross_folds(gold, head_folds, seed)
        train, held = np.arange(len(gold)), np.arange(len(gold))
    else:
        train, held = holdout_split(gold, holdout, seed)
    if len(train) == 0 or len(held) == 0:
        msg = f"{len(gold)} items leave nothing to train on or to hold out at share {holdout}"
        raise InvalidRequest.at(["data"], msg)

    def rows(items: np.ndarray) -> np.ndarray:  # every read of the items, (items · R, d)
        states = None if features == "logits" or hidden is None else hidden[items].reshape(-1, hidden.shape[-1])
        return read_features(logits[items].reshape(-1, logits.shape[-1]), states, features)

    started = time.perf_counter()
    reads = logits.shape[1]
    x_train, y_train, x_held = rows(train), np.repeat(gold[train], reads), rows(held)
    classes = len(question.options)

    def held_scores(head: LogisticHead) -> np.ndarray:  # (held, R, n)
        return head.scores(x_held).reshape(len(held), reads, classes)

    if cross:  # every item's scores from a head that never saw it; the kept strength refitted on all
        by_read = np.repeat(fold, reads)

        def out_of_fold(strength: float) -> np.ndarray:  # (N, R, n)
            found = np.zeros((len(gold) * reads, classes))
            for f in range(head_folds):
                part = by_read == f
                found[part] = fit_logistic(x_train[~part], y_train[~part], classes, strength).scores(x_train[part])
            return found.reshape(len(gold), reads, classes)

        tried = [(out_of_fold(strength), strength) for strength in l2]
        scores, strength = min(tried, key=lambda pair: mean_nll(pair[0], gold))
        head = fit_logistic(x_train, y_train, classes, strength)
    else:
        fitted = [(fit_logistic(x_train, y_train, classes, strength), strength) for strength in l2]
        head, strength = min(fitted, key=lambda pair: mean_nll(held_scores(pair[0]), gold[held]))
        scores = held_scores(head)
    partners: dict[str, np.ndarray] = {}  # each partner's distributions over the held-out items, (held, n)
    lexical_seconds = 0.0
    if bank is not None and vote:
        partners["vote"] = np.stack([bank.vote(data.items[i].state, vote, leave_out=True) for i in held])
    if bank is not None and lexical:
        lexical_started = time.perf_counter()
        folds = min(LEXICAL_FOLDS, len(held))
        with tqdm(total=folds, desc="cross-fitting the lexical classifier", unit="fold", disable=not progress) as bar:
            states = [data.items[i].state for i in held]
            partners["lexical"] = _cross_fit("lexical", bank, lambda: cross_fitted(bank, states, folds, bar.update))
        lexical_seconds = time.perf_counter() - lexical_started
    if bank is not None and encoder is not None:
        folds = min(LEXICAL_FOLDS, len(held))
        with tqdm(total=folds, desc="cross-fitting the embedding classifier", unit="fold", disable=not progress) as bar:
            states = [data.items[i].state for i in held]
            embed = encoder.embed
            dense = _cross_fit("embedding", bank, lambda: cross_fitted_dense(bank, states, embed, folds, bar.update))
            partners["encoder"] = dense
    temperature, fitted_weights = fit_fusion(scores, list(partners.values()), gold[held], PRIOR_ITEMS)
    weights = dict(zip(partners, fitted_weights, strict=True))
    fused = scores / temperature  # the readout's logits on the held-out items, (held, R, n)
    for name, p in partners.items():
        fused = fused + weights[name] * np.log(p)[:, None, :]
    train_seconds = time.perf_counter() - started

    def accuracy(p: np.ndarray) -> float:
        return float((p.argmax(axis=-1) == gold[held]).mean())

    readout_p = softmax(fused).mean(axis=1)  # (held, n)
    plain_p = softmax(logits[held]).mean(axis=1)
    metrics = {
        "held_out_items": float(len(held)),
        "cross_fitted": float(cross),
        "trusted": float(len(held) >= TRUSTED_ITEMS),
        "accuracy": accuracy(readout_p),
        "accuracy_half_width": accuracy_half_width(accuracy(readout_p), len(held)),
        "nll": mean_nll(fused, gold[held]),
        "ece": expected_calibration_error(readout_p, gold[held]),
        "plain_accuracy": accuracy(plain_p),
        "plain_ece": expected_calibration_error(plain_p, gold[held]),
        "read_seconds": read_seconds,
        "train_seconds": train_seconds,
    }
    if partners:
        metrics["head_accuracy"] = accuracy(scores.mean(axis=1))
        metrics |= {f"{name}_accuracy": accuracy(p) for name, p in partners.items()}
    if lexical:
        metrics["lexical_seconds"] = lexical_seconds
    ids = [item.id for item in data.items]
    readout = Readout(
        model=decider.name,
        schema=schema_hash(question, decision.instructions),
        kind=question.kind,
        options=tuple(o.name for o in question.options),
        features=features,
        hidden_size=None if features == "logits" or hidden is None else int(hidden.shape[-1]),
        layout=renderer.layout,
        head=head,
        temperature=temperature,
        l2=strength,
        vote_neighbours=vote,
        vote_weight=weights.get("vote", 0.0),
        vote_retrieval=retrieval if vote else "bm25",
        lexical_weight=weights.get("lexical"),
        lexical_examples=len(bank) if lexical and bank is not None else 0,
        encoder=None if encoder is None else encoder.name,
        encoder_weight=weights.get("encoder", 0.0),
        encoder_examples=len(bank) if encoder is not None and bank is not None else 0,
        fitted_on={
            "data": data.title,
            "items": len(ids),
            "per_class": per_class,
            "holdout": holdout,
            "cross_folds": head_folds if cross else None,
            "prior_items": PRIOR_ITEMS,
            "seed": seed,
            "ids_sha256": hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest(),
            "excluded": exclude.title if exclude else None,
            "dropped_overlap": dropped,
            "l2_tried": list(l2),
            "request": {"x_samples": decision.samples, "x_seed": decision.seed},
            "metrics": metrics,
        },
    )
    return ReadoutFit(readout, metrics)


def _cross_fit(name: str, bank: ExampleBank, fit: Callable[[], np.ndarray]) -> np.ndarray:
    """``fit()``, a partner's cross-fitted distributions; InvalidRequest when a fold's part of ``bank``
    is left with one option (the classifier's ValueError)."""
    try:
        return fit()
    except ValueError as exc:
        raise InvalidRequest.at(["data"], f"cannot cross-fit the {name} classifier on {bank.source}: {exc}") from None
