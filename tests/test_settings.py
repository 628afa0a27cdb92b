"""Settings: defaults written once, the environment, GPU defaults where only memory is at stake, and the
rules over several settings raised by the Python API as the command line reports them."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import Any, get_args

import pytest
import torch

from slotread.api.systemone import DEFAULT_MAX_SAMPLES, to_decision
from slotread.cli import build_parser
from slotread.cli.flags import default, settings_of
from slotread.errors import SettingsError
from slotread.models.registry import DEFAULT_MODEL
from slotread.quality.examples.retrieval import RETRIEVALS
from slotread.settings import (
    GATEWAY_CONCURRENCY,
    GPU_DEFAULTS,
    CalibrateSettings,
    DeciderSettings,
    EngineSettings,
    EvalSettings,
    FitSettings,
    ModelSettings,
    Retrieval,
    Settings,
)


def test_cpu_defaults_run_on_a_laptop() -> None:
    settings = Settings()
    assert (settings.device, settings.dtype, settings.max_concurrency, settings.queue_size) == (
        "cpu",
        "bfloat16",
        1,
        16,
    )
    assert settings.prefix_cache_bytes is None and settings.max_batch is None


def test_a_gpu_raises_the_limits_not_set_explicitly() -> None:
    gpu = Settings(device="cuda")
    assert (gpu.max_concurrency, gpu.queue_size) == (GPU_DEFAULTS["max_concurrency"], GPU_DEFAULTS["queue_size"])
    assert gpu.engine_process and not Settings().engine_process  # its own process on a GPU only
    assert not Settings(device="cuda", engine_process=False).engine_process
    assert Settings(device="cuda:1", queue_size=8).queue_size == 8  # an explicit value wins
    gateway = Settings(device="cuda", upstreams=["http://127.0.0.1:8001"])  # the replicas hold the GPU
    assert (gateway.max_concurrency, gateway.queue_size, gateway.engine_process) == (GATEWAY_CONCURRENCY, 16, False)


def test_a_gateway_runs_what_its_replicas_take() -> None:
    def upstreams(count: int) -> list[str]:
        return [f"http://127.0.0.1:{8001 + index}" for index in range(count)]

    assert GPU_DEFAULTS["max_concurrency"] == GATEWAY_CONCURRENCY  # a replica batches what one GPU server runs
    assert Settings(upstreams=upstreams(1)).max_concurrency == 32
    assert Settings(upstreams=upstreams(3)).max_concurrency == 96
    assert Settings(upstreams=upstreams(9)).max_concurrency == 256  # the field's limit
    assert Settings(upstreams=upstreams(3), max_concurrency=4).max_concurrency == 4  # an explicit value wins


# Each default written once: the Decider's keyword defaults and the wire format's limits are the Settings'.


def test_the_deciders_keyword_defaults_are_the_settings_defaults() -> None:
    from slotread.decider import Decider

    settings = DeciderSettings()
    parameters = inspect.signature(Decider.__init__).parameters
    for name in ("model", "upstream_timeout_s", "health_interval_s", "device", "deterministic", "max_questions"):
        assert parameters[name].default == getattr(settings, name), name
    for name in ("max_samples", "max_options", "max_permutations", "image_limits"):
        assert parameters[name].default == getattr(settings, name), name
    assert parameters["dtype"].default == getattr(torch, settings.dtype)
    limits = inspect.signature(to_decision).parameters
    assert [limits[name].default for name in ("max_questions", "max_samples", "max_permutations", "max_options")] == [
        settings.max_questions,
        settings.max_samples,
        settings.max_permutations,
        settings.max_options,
    ]


def test_fit_readouts_keyword_defaults_are_the_fit_settings_defaults() -> None:
    from slotread.quality.readouts.train import fit_readout

    settings = FitSettings(dataset="d", out="o")
    parameters = inspect.signature(fit_readout).parameters
    for name in ("features", "layout", "per_class", "holdout", "vote", "lexical", "batch_size"):
        assert parameters[name].default == getattr(settings, name), name
    assert list(parameters["l2"].default) == settings.l2
    assert parameters["seed"].default == settings.sample_seed


@pytest.mark.parametrize(
    ("argv", "settings"),
    [
        (["decide"], DeciderSettings),
        (["serve"], Settings),
        (["engine", "--model", "m"], EngineSettings),
        (["eval", "--dataset", "d", "--out", "o"], EvalSettings),
        (["calibrate", "--dataset", "d", "--out", "o"], CalibrateSettings),
        (["fit", "--dataset", "d", "--out", "o"], FitSettings),
    ],
)
def test_the_command_line_writes_no_default_of_its_own(argv: list[str], settings: type[ModelSettings]) -> None:
    args = build_parser().parse_args(argv)
    given = {name for name in ("model", "dataset", "out") if name in argv[1:] or f"--{name}" in argv}
    flags = {name: value for name, value in vars(args).items() if name in settings.model_fields}
    assert {name for name, value in flags.items() if value is not None} == given
    assert len(flags) >= 4  # the flags are named after the fields: --model, --device, --dtype, ...
    assert settings_of(settings, args).device == default(settings, "device") == "cpu"


def test_the_help_quotes_the_settings_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help = " ".join(capsys.readouterr().out.split())
    assert f"port to listen on (default {Settings().port})" in help
    assert f"largest x_samples (default {DEFAULT_MAX_SAMPLES})" in help
    assert f"else {DEFAULT_MODEL})" in help


# The environment


def test_the_environment_sets_what_no_flag_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTREAD_PORT", "9000")
    monkeypatch.setenv("SLOTREAD_DEVICE", "cuda:1")
    monkeypatch.setenv("SLOTREAD_UPSTREAMS", "http://a:1/, https://b:2")
    monkeypatch.setenv("SLOTREAD_MAX_QUESTIONS", "7")
    settings = settings_of(Settings, build_parser().parse_args(["serve", "--max-questions", "9"]))
    assert (settings.port, settings.device, settings.upstreams) == (9000, "cuda:1", ["http://a:1", "https://b:2"])
    assert settings.max_questions == 9  # a flag wins
    decide = settings_of(DeciderSettings, build_parser().parse_args(["decide"]))
    assert (decide.device, decide.max_questions) == ("cuda:1", 7)  # decide answers as the server would


def test_the_engine_server_reads_its_own_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTREAD_PORT", "9000")  # a gateway's port on the same host
    assert EngineSettings().port == 8001
    monkeypatch.setenv("SLOTREAD_ENGINE_PORT", "9100")
    monkeypatch.setenv("SLOTREAD_ENGINE_DETERMINISTIC", "true")
    settings = EngineSettings()
    assert (settings.port, settings.deterministic) == (9100, True)


def test_a_bad_environment_value_is_a_settings_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTREAD_QUEUE_SIZE", "-1")
    with pytest.raises(SettingsError, match="queue_size: Input should be greater than or equal to 0"):
        Settings()


# The flag rules, raised by the Python API


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"max_concurrency": 0}, "max_concurrency: Input should be greater than or equal to 1"),
        ({"port": 70000}, "port: Input should be less than or equal to 65535"),
        ({"upstreams": ["ftp://a"]}, "upstream 'ftp://a' is not an http:// or https:// URL"),
        ({"api_keys": "/no/such/file"}, "api_keys: /no/such/file is not a file"),
        ({"calibration_dir": "/no/such/dir"}, "calibration_dir: /no/such/dir is not a directory"),
        ({"example_banks": ["/no/such/bank.jsonl"]}, "example_banks: /no/such/bank.jsonl is not a file"),
        (
            {"engine_process": True, "upstreams": ["http://a:1"]},
            "engine_process: with upstreams the engines are the replicas",
        ),
    ],
)
def test_bad_server_settings_raise_settings_errors(values: dict[str, Any], message: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(message)):
        Settings(**values)


EVAL = {"dataset": "banking77", "out": "run"}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"dataset": "banking77"}, "--dataset and --out are required"),
        ({**EVAL, "baseline": "tfidf", "shuffle_options": 1}, "the baseline reads none"),
        ({**EVAL, "baseline": "knn", "shuffle_options": 1}, "the baseline reads none"),
        ({**EVAL, "baseline": "tfidf", "examples": 3}, "the TF-IDF baseline shows no examples"),
        ({**EVAL, "baseline": "tfidf", "shortlist": 3}, "the TF-IDF baseline shows no examples"),
        ({**EVAL, "baseline": "tfidf", "example_bank": "bank.jsonl"}, "the TF-IDF baseline shows no examples"),
        ({**EVAL, "baseline": "knn", "examples": 3, "shortlist": 2}, "the neighbour vote reads no shortlist"),
        ({**EVAL, "baseline": "knn", "examples": 3, "example_bank": "bank.jsonl"}, None),
        ({**EVAL, "examples": 3, "shortlist": 2, "shuffle_options": 1}, None),
    ],
)
def test_eval_option_rules(values: dict[str, Any], message: str | None) -> None:
    if message is None:
        EvalSettings(**values)
        return
    with pytest.raises(SettingsError, match=re.escape(message)):
        EvalSettings(**values)


@pytest.mark.parametrize(("holdout", "vote"), [(0.0, 0), (1.0, 0), (0.2, -1)])
def test_fit_refuses_a_holdout_outside_0_1_and_a_negative_vote(holdout: float, vote: int) -> None:
    with pytest.raises(SettingsError, match="--holdout must be between 0 and 1 and --vote must not be negative"):
        FitSettings(dataset="d", out="o", holdout=holdout, vote=vote)
    assert FitSettings(dataset="d", out="o", holdout=0.5, vote=3).vote == 3


def test_evaluate_refuses_an_example_bank_nothing_reads(tmp_path: Path) -> None:
    from slotread.eval.evaluate import evaluate

    folder = tmp_path / "banking77"
    folder.mkdir()
    (folder / "categories.json").write_text(json.dumps(["card_arrival", "request_refund"]))
    (folder / "test.csv").write_text("text,category\nwhere is my card,card_arrival\nrefund me,request_refund\n")
    settings = EvalSettings(
        dataset="banking77", data_dir=tmp_path, out=tmp_path / "run", example_bank=tmp_path / "bank.jsonl"
    )
    with pytest.raises(SettingsError, match="--example-bank serves --examples, --shortlist, --baseline knn"):
        evaluate(settings)  # before any model loads or the bank is read
    assert not (tmp_path / "run").exists()


def test_a_decider_from_settings_has_the_settings_limits(tiny_diffusion_dir: Path) -> None:
    from slotread.decider import Decider

    settings = DeciderSettings(model=str(tiny_diffusion_dir), max_questions=2, max_images=1, max_batch=4)
    decider = Decider.from_settings(settings)
    assert (decider.max_questions, decider.image_limits.count) == (2, 1)
    assert decider.engine.max_canvases == 4 and not decider.engine.deterministic  # type: ignore[attr-defined]
    assert Decider.from_settings(
        DeciderSettings(model=str(tiny_diffusion_dir), deterministic=True)
    ).engine.deterministic
    job = FitSettings(model=str(tiny_diffusion_dir), dataset="d", out="o").decider()
    assert (job.model, job.max_questions) == (str(tiny_diffusion_dir), DeciderSettings().max_questions)


def test_the_retrieval_setting_names_the_retrievals_banks_know() -> None:
    assert get_args(Retrieval) == RETRIEVALS
    for settings in (DeciderSettings, EvalSettings, FitSettings):
        assert settings.model_fields["retrieval"].default == "bm25"
