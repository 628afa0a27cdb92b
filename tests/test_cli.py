"""The slotread command line, run in process on the tiny DiffusionGemma."""

import json
import socket
from pathlib import Path

import pytest

from slotread.cli import main

REQUEST = {"state": "the server is down", "questions": {"urgent": {"type": "noul"}}}


def test_decide_prints_the_response(
    tiny_diffusion_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    request = tmp_path / "request.json"
    request.write_text(json.dumps(REQUEST))
    assert main(["decide", "--model", str(tiny_diffusion_dir), "--seed", "5", str(request)]) == 0
    response = json.loads(capsys.readouterr().out)
    assert set(response["answers"]) == {"urgent"} and type(response["answers"]["urgent"]["noul"]) is float
    assert main(["decide", "--model", str(tiny_diffusion_dir), "--seed", "5", str(request)]) == 0
    assert json.loads(capsys.readouterr().out) == response
    assert main(["decide", "--model", str(tiny_diffusion_dir), "--seed", "6", str(request)]) == 0
    assert json.loads(capsys.readouterr().out) != response


def test_decide_serves_an_example_bank(
    tiny_diffusion_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    question = {"type": "choice", "criteria": {"outage": None, "billing": None, "other": None}}
    lines = [{"question": question}, {"state": "the site is down", "answer": "outage"}]
    lines += [{"state": "i was billed twice", "answer": "billing"}, {"state": "hello", "answer": "other"}]
    (tmp_path / "bank.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"state": "the server is down", "questions": {"kind": question}, "x_examples": 2}))
    argv = ["decide", "--model", str(tiny_diffusion_dir), str(request)]
    assert main([*argv, "--example-bank", str(tmp_path / "bank.jsonl")]) == 0
    answer = json.loads(capsys.readouterr().out)["answers"]["kind"]
    assert sum(answer["probabilities"].values()) == pytest.approx(1.0)
    assert main(argv) == 2  # no bank serves the question
    assert "no example bank serves question 'kind'" in capsys.readouterr().err


def test_decide_reads_stdin(
    tiny_diffusion_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO(json.dumps(REQUEST)))
    assert main(["decide", "--model", str(tiny_diffusion_dir)]) == 0
    assert "urgent" in json.loads(capsys.readouterr().out)["answers"]


@pytest.mark.parametrize(
    ("text", "loc"),
    [
        (
            '{"state": "s", "questions": {"q": {"type": "choice", "criteria": {"a": null}}}}',
            ["body", "questions", "q", "choice", "criteria"],
        ),
        ('{"state": "s", "questions": ', ["body", 28]),  # json's position: the end of the text
    ],
)
def test_an_invalid_request_exits_2_with_the_detail_on_stderr(
    tiny_diffusion_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, loc: list[object]
) -> None:
    request = tmp_path / "bad.json"
    request.write_text(text)
    assert main(["decide", "--model", str(tiny_diffusion_dir), str(request)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    # Loading the model may draw transformers' progress bar on stderr before the detail.
    detail = captured.err[captured.err.index('{\n  "detail"') :]
    assert json.loads(detail)["detail"][0]["loc"] == loc


def test_an_unloadable_model_exits_1_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    request = tmp_path / "request.json"
    request.write_text(json.dumps(REQUEST))
    assert main(["decide", "--model", "no-such-model", str(request)]) == 1
    assert "no-such-model" in capsys.readouterr().err


def test_models_list_names_the_registry(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cache-dir", str(cache_dir), "models", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "gemma-3-270m"):
        assert name in out


def test_models_fetch_prints_the_converted_checkpoint(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cache-dir", str(cache_dir), "models", "fetch", "smollm2-135m-instruct"]) == 0
    folder = Path(capsys.readouterr().out.strip().split(": ", 1)[1])
    assert folder == cache_dir / "models" / "smollm2-135m-instruct" and (folder / "config.json").is_file()
    assert main(["--cache-dir", str(cache_dir), "models", "fetch", "no-such-model"]) == 1


@pytest.mark.parametrize("architecture", ["diffusion-gemma", "bert", "modernbert"])
def test_models_tiny_writes_a_loadable_checkpoint(
    architecture: str, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tiny"
    assert main(["--cache-dir", str(cache_dir), "models", "tiny", architecture, "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    request = tmp_path / "request.json"
    request.write_text(json.dumps(REQUEST))
    assert main(["--cache-dir", str(cache_dir), "decide", "--model", str(out), str(request)]) == 0


def test_serve_exits_1_naming_a_model_it_cannot_load(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "no-such-model", "--port", "0"]) == 1
    assert "no-such-model" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [
        ["--max-concurrency", "0"],
        ["--api-keys", "/no/such/file"],
        ["--port", "70000"],
        ["--calibration", "/no/such/dir"],
        ["--max-permutations", "0"],
        ["--example-bank", "/no/such/bank.jsonl"],
    ],
)
def test_serve_refuses_bad_settings_before_starting(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", *flags]) == 1
    assert "slotread serve:" in capsys.readouterr().err


def test_serve_exits_1_naming_an_example_bank_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bank = tmp_path / "bank.jsonl"
    bank.write_text('{"question": {"type": "noul"}}\n{"state": "s", "answer": "maybe"}\n')
    assert main(["serve", "--example-bank", str(bank), "--port", "0"]) == 1
    assert f"{bank}:2: 'maybe' is not an answer" in capsys.readouterr().err


def test_serve_refuses_an_api_key_file_without_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# none yet\n")
    assert main(["serve", "--api-keys", str(keys)]) == 1
    assert "holds no API keys" in capsys.readouterr().err


def test_engine_exits_1_naming_a_model_it_cannot_load(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["engine", "--model", "no-such-model", "--port", "0"]) == 1
    assert "no-such-model" in capsys.readouterr().err


def test_engine_refuses_a_taken_port_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["engine", "--model", "no-such-model", "--port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
