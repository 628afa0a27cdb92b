"""``evaluate(settings)``: one evaluation as ``slotread eval`` runs it, the Python API behind the command.

It picks the system (a model, the TF-IDF baseline or the neighbour vote), builds the example bank the
run needs from the training data (``eval.training``; never the evaluated items) unless a bank file is
given, and runs it into ``settings.out``. The option rules that need no data are ``EvalSettings``'; the
one that reads the readouts (does a readout read a bank?) is here.
"""

from __future__ import annotations

from typing import Any

from slotread.errors import SettingsError
from slotread.eval.datasets import Dataset, load_dataset, subset
from slotread.eval.training import training_data
from slotread.quality.examples.bank import ExampleBank
from slotread.quality.readouts.readout import banked_in
from slotread.settings import EvalSettings


def evaluate(settings: EvalSettings) -> dict[str, Any]:
    """Run the evaluation ``settings`` describe; returns its metrics (also written to ``out``/metrics.json).

    SettingsError for options that make no sense together, EvalError for data that cannot be evaluated,
    InvalidRequest for request fields no request takes (all before a model loads).
    """
    dataset = subset(
        load_dataset(settings.dataset, settings.split, data_dir=settings.data_dir, question=settings.question),
        settings.limit,
        settings.sample_seed,
    )
    bank = _bank(settings, dataset)
    if settings.baseline == "knn":
        from slotread.eval.baseline import evaluate_knn

        assert bank is not None
        return evaluate_knn(dataset, bank, settings.examples, settings.out, progress=settings.progress)
    if settings.baseline == "tfidf":
        from slotread.eval.baseline import evaluate_baseline

        return evaluate_baseline(
            dataset, _train(settings, dataset, "the TF-IDF baseline"), settings.out, progress=settings.progress
        )
    from slotread.eval.runner import evaluate_model

    fields = dict(settings.request_fields)
    fields |= {"x_examples": settings.examples} if settings.examples else {}
    fields |= {"x_shortlist": settings.shortlist} if settings.shortlist else {}
    if settings.readout_dir is not None:
        fields.setdefault("x_readout", True)
    passed = {
        "seed",
        "cache_dir",
        "device",
        "dtype",
        "calibration_dir",
        "readout_dir",
        "encoder",
        "progress",
        "concurrency",
    }
    return evaluate_model(
        dataset,
        settings.out,
        settings.model,
        request_fields=fields,
        shuffle_seed=settings.shuffle_options,
        example_bank=bank,
        **settings.model_dump(include=passed),
    )


def _train(settings: EvalSettings, dataset: Dataset, purpose: str) -> Dataset:
    """The data ``purpose`` learns from: never the evaluated items (``eval.training``)."""
    return training_data(
        dataset,
        settings.train,
        data_dir=settings.data_dir,
        question=settings.question,
        per_class=settings.per_class,
        seed=settings.sample_seed,
        purpose=purpose,
    )


def _bank(settings: EvalSettings, dataset: Dataset) -> ExampleBank | None:
    """The example bank the run reads (a bank file, or one built from the training data), or None."""
    banked = settings.readout_dir is not None and settings.baseline is None and banked_in(settings.readout_dir)
    by_meaning = bool(  # dense or hybrid retrieval asks for a bank's shortlists, ranked by the encoder
        settings.encoder
        and settings.shortlist
        and not settings.examples
        and settings.example_bank is None
        and settings.retrieval == "bm25"
    )
    if not (settings.examples or (settings.shortlist and not by_meaning) or settings.baseline == "knn" or banked):
        if settings.example_bank is not None:
            raise SettingsError(
                "--example-bank serves --examples, --shortlist, --baseline knn or a --readout that reads a bank "
                "(--vote, --lexical)"
            )
        return None
    if settings.example_bank is not None:
        from slotread.decider import read_example_bank

        bank = read_example_bank(settings.example_bank)
    else:
        from slotread.eval.banks import bank_from_dataset

        bank = bank_from_dataset(_train(settings, dataset, _bank_purpose(settings)), dataset)
    if settings.retrieval == "bm25":
        return bank
    from slotread.models.encoder import load_encoder

    assert settings.encoder is not None  # EvalSettings requires one for dense and hybrid retrieval
    return bank.retrieving(
        settings.retrieval, load_encoder(settings.encoder, settings.cache_dir, settings.device).embed
    )


def _bank_purpose(settings: EvalSettings) -> str:
    """What an evaluation builds its example bank for, as its errors name it."""
    if settings.baseline == "knn":
        return "the neighbour vote (--baseline knn)"
    if settings.examples or settings.shortlist:
        return "the example bank of --examples/--shortlist"
    return "the bank of a --readout fitted with --vote, --lexical or --encoder"
