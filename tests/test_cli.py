"""The slotread command line, run in process on the tiny DiffusionGemma."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from slotread.cli import build_parser, main
from tests.engines.remote.replicas import Replica, free_port

REQUEST = {"state": "the server is down", "questions": {"urgent": {"type": "noul"}}}


def test_decide_prints_the_response(
    tiny_diffusion_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    request = tmp_path / "request.json"
    request.write_text(json.dumps(REQUEST))
    assert main(["decide", "--model", str(tiny_diffusion_dir), "--seed", "5", "--device", "cpu", str(request)]) == 0
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


def test_decide_names_a_request_file_it_cannot_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["decide", str(tmp_path / "missing.json")]) == 1
    err = capsys.readouterr().err
    assert err == f"slotread: cannot read the request {tmp_path / 'missing.json'}: No such file or directory\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["--log-level", "INFO", "--cache-dir", "/c", "decide", "r.json"],
        ["decide", "r.json", "--log-level", "INFO", "--cache-dir", "/c"],
        ["--log-level", "DEBUG", "--cache-dir", "/top", "decide", "--log-level", "INFO", "--cache-dir", "/c", "r.json"],
    ],
)
def test_the_common_flags_go_before_or_after_the_subcommand(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert (args.log_level, args.cache_dir) == ("INFO", Path("/c"))


def test_the_common_flags_reach_nested_subcommands_and_default_to_none() -> None:
    args = build_parser().parse_args(["models", "list", "--cache-dir", "/c"])
    assert args.cache_dir == Path("/c") and args.log_level is None
    assert build_parser().parse_args(["eval", "table", "run", "--log-level", "ERROR"]).log_level == "ERROR"
    assert build_parser().parse_args(["engine", "--model", "m", "--cache-dir", "/e"]).cache_dir == Path("/e")


@pytest.mark.parametrize("command", ["eval", "calibrate", "fit"])
@pytest.mark.parametrize("spelling", ["--question", "--questions"])
def test_eval_calibrate_and_fit_take_either_spelling_of_the_question_file(command: str, spelling: str) -> None:
    args = build_parser().parse_args([command, "--dataset", "d.jsonl", spelling, "q.json", "--out", "o"])
    assert args.question == Path("q.json")


def test_eval_help_suggests_only_valid_request_fields(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "x_calibration=true" not in out and "x_calibration='\"contextual\"'" in out


def test_models_list_names_the_registry(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cache-dir", str(cache_dir), "models", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "gemma-3-270m"):
        assert name in out


def test_models_fetch_prints_the_converted_checkpoint(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cache-dir", str(cache_dir), "models", "fetch", "smollm2-135m-instruct", "--dtype", "float32"]) == 0
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


def test_serve_exits_1_naming_a_model_it_cannot_load_before_announcing_itself(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--model", "no-such-model", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("slotread: cannot load model 'no-such-model': no registry model, directory or file")
    assert "http://" not in err and "Traceback" not in err


def test_a_gateway_without_a_model_serves_its_replicas_says_when_ready_and_exits_0_on_sigterm(
    diffusion_replicas: list[Replica], tmp_path: Path
) -> None:
    replica = diffusion_replicas[0]
    port = free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("SLOTREAD_MODEL", None)
    command = [sys.executable, "-m", "slotread.cli", "serve", "--upstream", replica.url, "--port", str(port)]
    with log.open("w") as stderr:
        process = subprocess.Popen(command, stderr=stderr, env=env)
    try:
        deadline = time.monotonic() + 120
        while "ready: serving" not in log.read_text():  # said at the default log level
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert f"loading {replica.model} through 1 upstreams" in log.read_text()
        listing = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        assert listing["models"][0]["name"] == replica.model
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)
    assert code == 0, log.read_text()


def test_a_gateway_without_a_model_names_upstreams_that_do_not_say_theirs(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    assert main(["serve", "--upstream", url, "--upstream-timeout", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"slotread: no upstream said which one model it serves ({url}: ")
    assert err.rstrip().endswith("name it with --model")


@pytest.mark.parametrize(
    "flags",
    [
        ["--max-concurrency", "0"],
        ["--api-keys", "/no/such/file"],
        ["--port", "70000"],
        ["--calibration", "/no/such/dir"],
        ["--max-permutations", "0"],
        ["--example-bank", "/no/such/bank.jsonl"],
        ["--engine-process", "--upstream", "http://127.0.0.1:9"],
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
