"""The evaluation grid behind RESULTS.md: models x datasets x read settings, run in parallel.

    python bench/eval_grid.py --out runs --device cuda --jobs 8      # run what is missing (resumes)
    python bench/eval_grid.py --out runs --table                      # print RESULTS.md's tables

Every cell is one plain ``slotread eval`` or ``slotread calibrate`` command, printed as it starts
(and kept in ``<out>/commands.txt``), so any row can be reproduced alone. Calibration is fitted on
data disjoint from the evaluated split (``--exclude``): BANKING77, CLINC150 and SST-5 on seeded
samples of their train splits, BoolQ on ``dev_rest``. ``--only`` picks models, datasets or settings
by name.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

MODELS = {"q15": "qwen2.5-coder-1.5b-instruct", "q05": "qwen2.5-coder-0.5b-instruct"}


@dataclass(frozen=True)
class Data:
    dataset: str
    split: str
    limit: int | None
    kind: str  # choice, score or noul
    fit_split: str
    fit_limit: int
    exclude_split: str


DATASETS = {
    "b77": Data("banking77", "test", None, "choice", "train", 1000, "test"),
    "clinc": Data("clinc150", "test_2per_label", None, "choice", "train", 1500, "test"),
    "sst5": Data("sst5", "test", 500, "score", "train", 1000, "test"),
    "boolq": Data("boolq", "dev_500", None, "noul", "dev_rest", 1000, "dev_500"),
    "b77-154": Data("banking77", "subset154", None, "choice", "train", 1000, "test"),
}

#: read settings: request fields, the permutations their calibration is fitted under (None: no
#: artifact needed), whether the options are shown shuffled (the flip-rate twin of a setting)
SETTINGS: dict[str, tuple[dict[str, object], int | None, bool]] = {
    "plain": ({}, None, False),
    "contextual": ({"x_calibration": "contextual"}, None, False),
    "temperature": ({"x_calibration": "temperature", "x_coverage": 0.9}, 1, False),
    "perm4": ({"x_permutations": 4}, None, False),
    "perm4-temperature": ({"x_permutations": 4, "x_calibration": "temperature", "x_coverage": 0.9}, 4, False),
    "plain-shuffled": ({}, None, True),
    "perm4-shuffled": ({"x_permutations": 4}, None, True),
}


def applies(setting: str, kind: str) -> bool:
    """Scores are never permuted; only choices can be shown in another order."""
    if kind == "score" and "perm" in setting:
        return False
    return kind == "choice" or "shuffled" not in setting


@dataclass
class Job:
    name: str
    command: list[str]
    needs: list[str] = field(default_factory=list)
    process: subprocess.Popen[bytes] | None = None


def slotread(*args: str) -> list[str]:
    return [sys.executable, "-m", "slotread.cli", *args]


def fields(request: dict[str, object]) -> list[str]:
    return [arg for key, value in request.items() for arg in ("--request-field", f"{key}={json.dumps(value)}")]


def plan(out: Path, models: list[str], datasets: list[str], settings: list[str], device: str) -> list[Job]:
    jobs = []
    for key in datasets if "baseline" in models else []:
        data = DATASETS[key]
        where = ["--dataset", data.dataset, "--split", data.split] + (
            ["--limit", str(data.limit)] if data.limit else []
        )
        run = out / "baseline" / key
        jobs.append(
            Job(f"baseline/{key}/tfidf", slotread("eval", "--baseline", "tfidf", *where, "--out", str(run / "tfidf")))
        )
        if data.kind == "choice":
            vote = slotread("eval", "--baseline", "knn", "--examples", "24", *where, "--out", str(run / "knn24"))
            jobs.append(Job(f"baseline/{key}/knn24", vote))
    for short in [key for key in models if key in MODELS]:
        model = MODELS[short]
        on = ["--model", model, "--device", device]
        jobs.append(Job(f"{short}/fetch", slotread("models", "fetch", model)))
        fitted = set()
        for key in datasets:
            data = DATASETS[key]
            where = ["--dataset", data.dataset, "--split", data.split]
            where += ["--limit", str(data.limit)] if data.limit else []
            for setting in settings:
                if not applies(setting, data.kind):
                    continue
                request, permutations, shuffled = SETTINGS[setting]
                command = ["eval", *on, *where, *fields(request), "--out", str(out / short / key / setting)]
                command += ["--shuffle-options", "1"] if shuffled else []
                needs = [f"{short}/fetch"]
                if permutations is not None:
                    calibration = out / short / f"calibration-p{permutations}"
                    fit = f"{short}/fit/{data.dataset}/p{permutations}"
                    if fit not in fitted:
                        fitted.add(fit)
                        fit_fields = fields({"x_permutations": permutations}) if permutations > 1 else []
                        fit_command = slotread(
                            "calibrate", *on, "--dataset", data.dataset, "--split", data.fit_split,
                            "--limit", str(data.fit_limit), "--exclude", data.dataset,
                            "--exclude-split", data.exclude_split, "--drop-overlap", *fit_fields,
                            "--out", str(calibration / f"{data.dataset}.json"),
                        )  # fmt: skip
                        jobs.append(Job(fit, fit_command, [f"{short}/fetch"]))
                    command += ["--calibration", str(calibration)]
                    needs.append(fit)
                jobs.append(Job(f"{short}/{key}/{setting}", slotread(*command), needs))
    return jobs


def done(job: Job) -> bool:
    """Finished earlier: an eval run with metrics, or a written calibration artifact."""
    target = Path(job.command[job.command.index("--out") + 1]) if "--out" in job.command else None
    if target is None:
        return False
    return target.is_file() if target.suffix == ".json" else (target / "metrics.json").is_file()


def execute(jobs: list[Job], out: Path, parallel: int) -> int:
    out.mkdir(parents=True, exist_ok=True)
    finished = {job.name for job in jobs if done(job)}
    pending = [job for job in jobs if job.name not in finished]
    running: list[Job] = []
    failed: list[str] = []
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    start = time.monotonic()
    with (out / "commands.txt").open("a", encoding="utf-8") as commands:
        while pending or running:
            for job in running[:]:
                code = job.process.poll() if job.process else 0
                if code is None:
                    continue
                running.remove(job)
                (finished.add if code == 0 else failed.append)(job.name)
                print(f"[{time.monotonic() - start:6.0f}s] {'done' if code == 0 else f'FAILED ({code})'} {job.name}")
            blocked = [job for job in pending if any(need in failed for need in job.needs)]
            for job in blocked:
                pending.remove(job)
                failed.append(job.name)
                print(f"skipped {job.name}: a job it needs failed")
            for job in [job for job in pending if all(need in finished for need in job.needs)]:
                if len(running) >= parallel:
                    break
                pending.remove(job)
                line = " ".join(["slotread", *job.command[3:]])
                commands.write(line + "\n")
                commands.flush()
                print(f"[{time.monotonic() - start:6.0f}s] start {job.name}: {line}", flush=True)
                log = (logs / (job.name.replace("/", "_") + ".log")).open("wb")
                job.process = subprocess.Popen(job.command, stdout=log, stderr=subprocess.STDOUT)
                running.append(job)
            time.sleep(0.5)
    print(f"{len(finished)} done, {len(failed)} failed: {', '.join(failed) or '-'}")
    return 1 if failed else 0


#: (setting, its shuffled twin): the option-order flip rate is the share of items whose answer differs
FLIP_PAIRS = (("plain", "plain-shuffled"), ("perm4", "perm4-shuffled"))


def tables(out: Path) -> str:
    """RESULTS.md's tables from the finished runs under ``out``: one per dataset, then the flip rates."""
    from slotread.eval.report import compare, format_table, read_metrics

    sections = []
    for key, data in DATASETS.items():
        runs = []
        for system in ["baseline", *MODELS]:
            for setting in ["tfidf", "knn24", *SETTINGS]:
                folder = out / system / key / setting
                if (folder / "metrics.json").is_file():
                    runs.append(read_metrics(folder) | {"system": f"{system} {setting}"})
        if runs:
            sections.append(f"### {data.dataset} {data.split}\n\n{format_table(runs)}")
    flips = [
        "| model | dataset | setting | items | flip rate | accuracy | accuracy shuffled |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for system in MODELS:
        for key in DATASETS:
            for setting, twin in FLIP_PAIRS:
                a, b = out / system / key / setting, out / system / key / twin
                if (a / "metrics.json").is_file() and (b / "metrics.json").is_file():
                    c = compare(a, b)
                    cells = [system, key, setting, c.items, f"{c.flip_rate:.3f}", f"{c.accuracy_a:.3f}"]
                    flips.append("| " + " | ".join(map(str, [*cells, f"{c.accuracy_b:.3f}"])) + " |")
    sections.append("### Option-order flip rate\n\n" + "\n".join(flips))
    return "\n\n".join(sections)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder of all runs")
    parser.add_argument("--device", default="cuda", help="torch device of the models (default cuda)")
    parser.add_argument("--jobs", type=int, default=8, help="commands run at once (default 8)")
    parser.add_argument(
        "--only", nargs="*", default=[], help="model keys (or baseline), dataset keys or setting names to run"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument("--table", action="store_true", help="print the Markdown tables of the finished runs")
    args = parser.parse_args()
    if args.table:
        print(tables(args.out))
        return 0
    only = set(args.only)
    systems = {*MODELS, "baseline"}
    models = [key for key in systems if not only & systems or key in only]
    datasets = [key for key in DATASETS if not only & DATASETS.keys() or key in only]
    settings = [key for key in SETTINGS if not only & SETTINGS.keys() or key in only]
    jobs = plan(args.out, models, datasets, settings, args.device)
    if args.dry_run:
        for job in jobs:
            print(job.name, " ".join(job.command[3:]))
        return 0
    return execute(jobs, args.out, args.jobs)


if __name__ == "__main__":
    sys.exit(main())
