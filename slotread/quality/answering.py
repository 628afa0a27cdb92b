"""Answer a decision with what ``quality`` adds: examples, shortlists, calibration, sets or readouts.

``decide_calibrated`` is the one path a request takes through ``quality`` (the Decider calls it):
``examples.shortlist.retrieve``, then either the readouts or the calibration checks and content-free
reads below, then ``core.decide`` with the hook that adjusts each answer.

Before reading: refuse (422) what the store cannot serve (a temperature or bins never fitted for a
question, conformal scores missing or fitted under other read options). For ``contextual`` and
``binned`` (contextual, then the fitted top-label bins on the answer), read the
content-free prompts the store lacks: each question without the state (``CONTENT_FREE_STATES`` in
its place), without earlier answers, under the same assignments, as isolated branches; p_cf per
shift is the mean of their softmaxes. Then ``core.decide`` reads the decision and hands each raw
answer to ``calibrate_answer`` before later stages see it.

With ``x_examples`` or ``x_shortlist`` (``quality.examples.shortlist``) each question is first given its solved
examples and shortlisted options; a shortlisted answer is expanded to every option after calibration.
Their content-free reads show the same examples and options, so they are read for each request and
not kept in the store (they depend on the state through the retrieved examples). A decision
with ``readout`` is answered by its schemas' learned readouts instead (``quality.readouts``;
refused before reading if one is missing).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from slotread.core.aggregate import aggregate_reads, normalised_entropy, softmax
from slotread.core.answers import Answer
from slotread.core.decide import DecisionResult, decide, question_shifts
from slotread.core.questions import Decision, Question
from slotread.engines.base import Engine
from slotread.errors import ErrorDetail, InvalidRequest
from slotread.prompt.render import Renderer
from slotread.quality.artifact import schema_hash
from slotread.quality.calibration.artifact import Calibration
from slotread.quality.calibration.conformal import conformal_threshold, prediction_set
from slotread.quality.calibration.methods import apply_top_label_bins, calibrate_reads, divide_prior
from slotread.quality.calibration.store import CalibrationStore
from slotread.quality.examples.bank import ExampleBanks
from slotread.quality.examples.meaning import Embed
from slotread.quality.examples.shortlist import expand_answer, retrieve
from slotread.quality.readouts.store import ReadoutStore

#: What stands in for the state in a content-free read (Zhao et al. 2021 use "N/A", "" and "[MASK]";
#: "[empty]" replaces the mask token, which is not plain text to a chat model).
CONTENT_FREE_STATES = ("N/A", "", "[empty]")
#: Draws per content-free read on a noisy (diffusion) model, always from seed 0, so the cached
#: distribution does not depend on which request read it first.
CONTENT_FREE_DRAWS = 4


def decide_calibrated(
    decision: Decision,
    engine: Engine,
    renderer: Renderer,
    store: CalibrationStore,
    max_tokens: int | None = None,
    banks: ExampleBanks | None = None,
    readouts: ReadoutStore | None = None,
    embed: Embed | None = None,
) -> DecisionResult:
    """``core.decide`` with ``decision.quality.examples``/``shortlist`` from ``banks`` (a shortlist of a question
    no bank serves from meaning, with a sentence encoder's ``embed``) and ``decision.quality.calibration``
    applied; usage includes any content-free reads. With ``decision.readout`` every answer comes from its
    schema's learned readout in ``readouts`` instead (the API allows no calibration, coverage, examples
    or shortlist beside it).

    Raises InvalidRequest when the store lacks a fit the decision needs, or no bank serves a question
    that needs one, besides core.decide's errors.
    """
    banks = banks or ExampleBanks()
    decision, shortlists = retrieve(decision, banks, embed)
    schemas = {q.id: schema_hash(q, decision.instructions) for q in decision.questions}
    if decision.readout:
        return _decide_readout(decision, engine, renderer, readouts, banks, schemas, max_tokens)
    _check(decision, store, schemas)
    spent = (0, 0)
    retrieved = bool(decision.quality.examples or decision.quality.shortlist)
    per_request: Mapping[str, Mapping[int, np.ndarray]] = {}
    if decision.quality.calibration == "contextual" and retrieved:
        questions = {q.id: replace(q, depends_on=(), ask_if=()) for q in decision.questions}
        per_request, read_in, read_out = _content_free_reads(questions, decision, engine, renderer, max_tokens)
        spent = (read_in, read_out)
    elif decision.quality.calibration in ("contextual", "binned"):
        spent = _read_content_free(decision, engine, renderer, store, schemas, max_tokens)
    if decision.quality.calibration == "none" and decision.quality.coverage is None and not shortlists:
        result = decide(decision, engine, renderer, max_tokens)
    else:
        # what each schema is calibrated with, taken once: the store may forget or add meanwhile
        fits = {schema: (store.artifact(schema), store.content_free(schema)) for schema in schemas.values()}

        def adjust(answer: Answer) -> Answer:
            qid = answer.question.id
            if decision.quality.calibration != "none" or decision.quality.coverage is not None:
                fitted, content_free = fits[schemas[qid]]
                content_free = per_request.get(qid, content_free)
                answer = calibrate_answer(answer, decision, schemas[qid], store, fitted, content_free)
            return expand_answer(answer, shortlists[qid]) if qid in shortlists else answer

        result = decide(decision, engine, renderer, max_tokens, adjust)
    return DecisionResult(result.answers, result.input_tokens + spent[0], result.output_tokens + spent[1])


def _decide_readout(
    decision: Decision,
    engine: Engine,
    renderer: Renderer,
    readouts: ReadoutStore | None,
    banks: ExampleBanks,
    schemas: dict[str, str],
    max_tokens: int | None,
) -> DecisionResult:
    """``core.decide`` with each answer taken from its schema's readout, given its bank's vote and its
    lexical classifier's q̃ where the readout adds them (refused before reading if a readout or such a
    bank is missing)."""
    if readouts is None:
        msg = "no readouts are loaded here; fit one with `slotread fit` and load it with --readout DIR"
        raise InvalidRequest.at(["body", "x_readout"], msg)
    problems: list[ErrorDetail] = []
    for question in decision.questions:
        problem = readouts.problem(question.id, schemas[question.id], banks.get(schemas[question.id]) is not None)
        if problem:
            problems.append({"loc": ["body", "x_readout"], "msg": problem, "type": "value_error"})
    if problems:
        raise InvalidRequest(problems)
    found = {schema: readouts.get(schema) for schema in schemas.values()}

    def adjust(answer: Answer) -> Answer:
        schema = schemas[answer.question.id]
        readout, bank = found[schema], banks.get(schema)
        assert readout is not None and readouts is not None  # refused above otherwise
        vote = lexical = None
        if readout.vote_neighbours:
            assert bank is not None  # refused above otherwise
            vote = bank.vote(decision.state, readout.vote_neighbours)
        if readout.lexical_weight is not None:
            lexical = readouts.lexical(schema, decision.state)
        dense = readouts.dense(schema, decision.state) if readout.encoder is not None else None
        return readout.answer(answer, vote, lexical, dense)

    return decide(decision, engine, renderer, max_tokens, adjust)


def calibrate_answer(
    answer: Answer,
    decision: Decision,
    schema: str,
    store: CalibrationStore,
    fitted: Calibration | None,
    content_free: Mapping[int, np.ndarray],
) -> Answer:
    """The answer with each read calibrated by ``decision.quality.calibration``, then averaged again (for
    ``binned``: contextually, then the mean's top probability binned; the reads' stderr and agreement
    stay those of the contextual reads), and for a choice or score its prediction set at
    ``decision.quality.coverage`` when one is asked for.

    ``fitted`` and ``content_free`` are the schema's artifact and content-free distributions; ``store``
    keeps the batch priors.
    """
    logits = np.stack([read.logits for read in answer.reads])  # (R, n)
    shifts = [read.shift for read in answer.reads]
    method = decision.quality.calibration
    if method == "batch":
        priors = store.batch.priors_then_update([(schema, s) for s in shifts], softmax(logits))
        per_read = divide_prior(logits, priors)
    else:
        temperature = fitted.temperature if fitted else None
        per_read_method = "contextual" if method == "binned" else method
        per_read = calibrate_reads(logits, shifts, per_read_method, temperature, content_free)
    summary = aggregate_reads(per_read)
    if method == "binned":
        assert fitted is not None and fitted.bins is not None  # _check refused the decision otherwise
        binned = apply_top_label_bins(summary.probabilities, fitted.bins)
        summary = replace(summary, probabilities=binned, entropy=normalised_entropy(binned))
    found = None
    if decision.quality.coverage is not None and answer.question.kind != "noul":
        assert fitted is not None  # _check refused the decision otherwise
        threshold = conformal_threshold(fitted.conformal[method], decision.quality.coverage)
        found = prediction_set(summary.probabilities, threshold)
    return replace(answer, summary=summary, prediction_set=found)


def _check(decision: Decision, store: CalibrationStore, schemas: dict[str, str]) -> None:
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


def _read_content_free(
    decision: Decision,
    engine: Engine,
    renderer: Renderer,
    store: CalibrationStore,
    schemas: dict[str, str],
    max_tokens: int | None,
) -> tuple[int, int]:
    """Read the content-free distributions the store lacks, keep them there; returns the tokens spent."""
    missing: dict[str, Question] = {}
    for question in decision.questions:
        schema = schemas[question.id]
        known = store.content_free(schema)
        if schema not in missing and any(s not in known for s in question_shifts(question, decision.permutations)):
            missing[schema] = replace(question, id=schema, depends_on=(), ask_if=())
    if not missing:
        return 0, 0
    found, input_tokens, output_tokens = _content_free_reads(missing, decision, engine, renderer, max_tokens)
    for schema, question in missing.items():
        learned = Calibration(
            model=store.model,
            schema=schema,
            kind=question.kind,
            options=tuple(o.name for o in question.options),
            content_free=found[schema],
            content_free_states=CONTENT_FREE_STATES,
        )
        store.learn_content_free(learned)
    return input_tokens, output_tokens


def _content_free_reads(
    questions: dict[str, Question], decision: Decision, engine: Engine, renderer: Renderer, max_tokens: int | None
) -> tuple[dict[str, dict[int, np.ndarray]], int, int]:
    """Read ``questions`` (keyed by their ids, asked unconditionally) on each content-free state; returns
    per question shift → mean distribution, and the input and output tokens spent."""
    reads: dict[str, list[tuple[int, np.ndarray]]] = {key: [] for key in questions}
    input_tokens = output_tokens = 0
    for state in CONTENT_FREE_STATES:
        blank = replace(
            decision,
            state=state,
            images=(),  # content-free: no image either
            questions=tuple(questions.values()),
            seed=0,
            samples=CONTENT_FREE_DRAWS,
            joint=False,
        )
        result = decide(blank, engine, renderer, max_tokens)
        input_tokens += result.input_tokens
        output_tokens += result.output_tokens
        for key, answer in result.answers.items():
            assert answer is not None  # no ask_if: every question is asked
            reads[key] += [(read.shift, softmax(read.logits)) for read in answer.reads]
    found = {}
    for key, question_reads in reads.items():
        by_shift: dict[int, list[np.ndarray]] = {}
        for shift, p in question_reads:
            by_shift.setdefault(shift, []).append(p)
        found[key] = {shift: np.mean(ps, axis=0) for shift, ps in by_shift.items()}
    return found, input_tokens, output_tokens
