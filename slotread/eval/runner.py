"""Run a dataset through a predictor, one item at a time, into a run folder that resumes.

A model is driven through the public ``Decider.decide``: one System One request per item, carrying
the same fields a client would send the server (``x_seed``, and whatever ``request_fields`` adds,
such as ``x_samples`` or ``x_calibration``), so a run measures what the server serves. The run folder
holds ``run.json`` (what was run), ``predictions.csv`` (appended per item, see predictions.py),
and, once every item is done, ``metrics.json`` and ``reliability.png`` (report.py). Running the same
command again reads only the items that have no row yet; a run folder holding a different run is
refused.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from slotread.api.systemone import parse_request, to_decision
from slotread.errors import EvalError
from slotread.eval.datasets import Dataset, Item, Task
from slotread.eval.predictions import Prediction, PredictionsFile
from slotread.eval.report import PREDICTIONS, RUN_INFO, write_report
from slotread.serve.batcher import BatchingEngine
from slotread.settings import Dtype, EvalSettings

if TYPE_CHECKING:
    from slotread.decider import Decider
    from slotread.quality.examples.bank import ExampleBank

logger = logging.getLogger(__name__)

#: A predictor answers one item; the runner times the call.
Predictor = Callable[[Item], Prediction]

#: The question's id in every request: caller data, it never reaches the model.
QUESTION_ID = "answer"

#: the defaults of ``evaluate_model``'s keyword arguments, written once in ``settings`` (no environment)
DEFAULTS = EvalSettings.model_construct()


def build_request(
    task: Task, item: Item, request_fields: dict[str, Any], question: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The System One request for one item: its state, the task's question (or ``question``, the same
    question asked another way, see ``shuffle_options``), and the extra fields."""
    asked = dict(task.question if question is None else question)
    return {**request_fields, "state": item.state, "questions": {QUESTION_ID: asked}}


def shuffle_options(task: Task, seed: int) -> dict[str, Any]:
    """The task's choice question with its options in a seeded random order (``random.Random(seed)``).

    Only the order the prompt shows changes: answers key probabilities by option name, so they read
    back in class order. A score's levels are ordinal and a noul has no options, so both are refused.
    """
    if task.kind != "choice":
        raise EvalError(f"--shuffle-options reorders a choice question's options; this task is a {task.kind}")
    names = list(task.question["criteria"])
    random.Random(seed).shuffle(names)
    return {**task.question, "criteria": {name: task.question["criteria"][name] for name in names}}


def option_names(task: Task) -> list[str]:
    """The answer's option names in class order (how a response keys its probabilities)."""
    if task.kind == "choice":
        return list(task.question["criteria"])
    return ["yes", "no"] if task.kind == "noul" else list(task.classes)


def read_answer(task: Task, response: dict[str, Any]) -> Prediction:
    """A response's answer as a Prediction in class order, with the read's diagnostics."""
    answer = response["answers"][QUESTION_ID]
    names = option_names(task)
    if task.kind == "noul":
        p = np.array([answer["noul"], 1.0 - answer["noul"]])
    else:
        p = np.array([answer["probabilities"][name] for name in names])
    stderr = answer.get("x_stderr")
    if isinstance(stderr, dict):
        stderr = stderr[names[int(p.argmax())]]
    members = answer.get("x_set")  # present when the request asked for x_coverage
    return Prediction(
        probabilities=p,
        reads=answer.get("x_reads"),
        input_tokens=response["usage"]["input_tokens"],
        label_mass=answer.get("x_label_mass"),
        entropy=answer.get("x_entropy"),
        stderr=stderr,
        prediction_set=None if members is None else tuple(sorted(names.index(name) for name in members)),
    )


class DeciderPredictor:
    """Answers items with ``Decider.decide``, one request each, asking ``question`` (default: the task's).

    One warm-up decision on a placeholder state runs first (as the server warms up before it is
    ready), so the first item's latency does not include one-off start-up work.
    """

    def __init__(
        self, decider: Decider, task: Task, request_fields: dict[str, Any], question: dict[str, Any] | None = None
    ) -> None:
        self.decider = decider
        self.task = task
        self.request_fields = request_fields
        self.question = question
        decider.decide(self.request(Item("warm-up", "warm-up", 0)))

    def request(self, item: Item) -> dict[str, Any]:
        """The request this predictor sends for ``item``."""
        return build_request(self.task, item, self.request_fields, self.question)

    def __call__(self, item: Item) -> Prediction:
        return read_answer(self.task, self.decider.decide(self.request(item)))


def run_info(dataset: Dataset, system: str, request_fields: dict[str, Any] | None) -> dict[str, Any]:
    """What a run is, as run.json records it: a rerun must match it to resume."""
    task = dataset.task
    limit, sample_seed = dataset.sample or (None, None)
    return {
        "system": system,
        "dataset": dataset.name,
        "split": dataset.split,
        "limit": limit,
        "sample_seed": sample_seed,
        "request": request_fields,
        "task": {"kind": task.kind, "question": task.question, "classes": task.classes, "positive": task.positive},
    }


def _claim(out: Path, info: dict[str, Any]) -> None:
    """Write run.json, or check that the one there describes the same run."""
    path = out / RUN_INFO
    wanted = json.loads(json.dumps(info))  # tuples as lists, as they read back
    if path.exists():
        found = json.loads(path.read_text(encoding="utf-8"))
        differ = sorted(key for key in wanted.keys() | found.keys() if wanted.get(key) != found.get(key))
        if differ:
            raise EvalError(f"{out} holds another run (it differs in {', '.join(differ)}); use another --out")
        return
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(wanted, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def run(
    dataset: Dataset,
    out: Path,
    info: dict[str, Any],
    make_predictor: Callable[[], Predictor],
    *,
    progress: bool = True,
    concurrency: int = 1,
) -> dict[str, Any]:
    """Predict every item of ``dataset`` that ``out`` has no row for, then write the report.

    ``make_predictor`` is called only when some item is left (a finished run loads no model).
    ``concurrency`` > 1 predicts that many items at once, from as many threads (the predictor must be
    thread-safe); rows are written in item order, each with its own latency.
    Returns the metrics as written to metrics.json.
    """
    _claim(out, info)
    with PredictionsFile(out / PREDICTIONS, dataset.task.classes) as predictions:
        stray = predictions.done - {item.id for item in dataset.items}
        if stray:
            raise EvalError(f"{out / PREDICTIONS} has rows for items not in this run, e.g. {min(stray)!r}")
        pending = [item for item in dataset.items if item.id not in predictions.done]
        logger.info("%s: %d of %d items done", out, len(dataset.items) - len(pending), len(dataset.items))
        if pending:
            predict = make_predictor()
            bar = tqdm(initial=len(dataset.items) - len(pending), total=len(dataset.items), disable=not progress)

            def timed(item: Item) -> tuple[Prediction, float]:
                start = time.perf_counter()
                prediction = predict(item)
                return prediction, (time.perf_counter() - start) * 1000

            correct = 0
            pool = ThreadPoolExecutor(concurrency) if concurrency > 1 else None
            try:
                answered = pool.map(timed, pending) if pool else map(timed, pending)
                for count, (item, (prediction, latency_ms)) in enumerate(zip(pending, answered, strict=True), start=1):
                    predictions.append(item.id, item.gold, prediction, latency_ms)
                    correct += int(prediction.probabilities.argmax()) == item.gold
                    bar.update()
                    bar.set_postfix(accuracy=f"{correct / count:.3f}")
            finally:  # an interrupt or error drops the items not started; the rows written so far stay
                if pool:
                    pool.shutdown(cancel_futures=True)
                bar.close()
    return write_report(out)


def evaluate_model(
    dataset: Dataset,
    out: Path,
    model: str | Decider,
    *,
    seed: int = DEFAULTS.seed,
    request_fields: dict[str, Any] | None = None,
    cache_dir: Path | None = None,
    device: str = DEFAULTS.device,
    dtype: Dtype = DEFAULTS.dtype,
    calibration_dir: Path | None = None,
    readout_dir: Path | None = None,
    shuffle_seed: int | None = None,
    example_bank: ExampleBank | None = None,
    encoder: str | None = None,
    progress: bool = True,
    concurrency: int = DEFAULTS.concurrency,
) -> dict[str, Any]:
    """Evaluate a model on ``dataset``: a Decider, or what Decider loads (registry name, checkpoint, .gguf).

    Every request carries ``x_seed=seed`` and ``request_fields``. The first item's request is
    checked before the model loads, so a bad field or question fails at once (InvalidRequest).
    ``calibration_dir`` (recorded in run.json when given) holds the calibration artifacts the loaded
    Decider serves (``x_calibration: temperature``, ``x_coverage``); ``readout_dir`` (recorded likewise)
    the learned readouts it answers ``x_readout`` with (``slotread fit``). ``shuffle_seed`` (recorded in
    run.json as ``shuffle_options``) asks a choice question with its options in that seeded order
    (``shuffle_options``); predictions stay in class order, so the run pairs with an unshuffled one
    in ``compare``, whose flip rate is then the option-order flip rate. ``example_bank`` (for
    ``x_examples``, ``x_shortlist``; described in run.json) must serve the dataset's question and hold
    none of its items (EvalError, before the model loads), and the Decider loaded ranks it by its own
    retrieval (dense and hybrid with ``encoder``); a Decider passed in serves its own banks.
    ``encoder`` (recorded likewise, with the pool exponent of ``quality.examples.meaning``) is the
    sentence encoder the loaded Decider serves shortlists from meaning with (``x_shortlist`` where no
    bank serves the question). ``concurrency`` decisions run at
    once, their reads and thoughts merged into shared engine calls as the server merges them
    (``serve.batcher``): faster on a GPU, where in bfloat16 an answer may then move within the
    engine's tolerance, as a served one does (a Decider passed in keeps the batching wrapper).
    """
    if concurrency < 1:
        raise EvalError(f"concurrency must be at least 1, not {concurrency}")
    fields = {"x_seed": seed, **(request_fields or {})}
    if {"state", "questions"} & fields.keys():
        raise EvalError("request fields may not replace the request's state or questions")
    if not dataset.items:
        raise EvalError(f"{dataset.name} has no items")
    question = None if shuffle_seed is None else shuffle_options(dataset.task, shuffle_seed)
    to_decision(parse_request(build_request(dataset.task, dataset.items[0], fields, question)))
    if example_bank is not None:
        from slotread.eval.banks import check_bank

        check_bank(example_bank, dataset)
    system = model if isinstance(model, str) else model.name

    if (
        not isinstance(model, str)
        and example_bank is not None
        and model.banks.get(example_bank.schema) is not example_bank
    ):
        raise EvalError("the Decider given does not serve the example bank given; build it with example_banks")

    def load() -> Predictor:
        decider = loaded(model) if isinstance(model, str) else model
        if concurrency > 1 and not isinstance(decider.engine, BatchingEngine):
            decider.engine = BatchingEngine(decider.engine)
        return DeciderPredictor(decider, dataset.task, fields, question)

    def loaded(name: str) -> Decider:
        import torch

        from slotread.decider import Decider

        decider = Decider(
            name,
            cache_dir=cache_dir,
            device=device,
            dtype=getattr(torch, dtype),
            calibration_dir=calibration_dir,
            readout_dir=readout_dir,
            example_banks=[example_bank] if example_bank is not None else [],
            encoder=encoder,
            retrieval=example_bank.retrieval if example_bank is not None else "bm25",
        )
        return decider

    info = run_info(dataset, system, fields)
    if calibration_dir is not None:
        info["calibration_dir"] = str(calibration_dir)
    if readout_dir is not None:
        info["readout_dir"] = str(readout_dir)
    if shuffle_seed is not None:
        info["shuffle_options"] = shuffle_seed
    if encoder is not None:
        from slotread.quality.examples.meaning import POOL_EXPONENT

        info["encoder"] = encoder
        info["pool_exponent"] = POOL_EXPONENT  # so a run's meaning-shortlist reads can be recovered (bench)
    if example_bank is not None:
        from slotread.eval.banks import bank_info

        info["example_bank"] = bank_info(example_bank)
    return run(dataset, out, info, load, progress=progress, concurrency=concurrency)
