"""The evaluation grid behind RESULTS.md: models x datasets x read settings, run in parallel.

    python bench/eval_grid.py --out runs --device cuda --jobs 8      # run what is missing (resumes)
    python bench/eval_grid.py --out runs --table                      # print RESULTS.md's tables

Every cell is one plain ``slotread eval``, ``slotread calibrate`` or ``slotread fit`` command, printed
as it starts (and kept in ``<out>/commands.txt``), so any row can be reproduced alone. Whatever is
fitted is fitted on data disjoint from the evaluated split (``--exclude``): BANKING77, CLINC150 and
SST-5 on their train splits, BoolQ on ``dev_rest``. ``--only`` picks models, datasets or settings by
name. Jobs start in priority order (``rank``), so the rows that matter most are written first when
the GPU time may run out.

Settings (issue 5, request fields): ``plain``; ``contextual``; ``temperature`` and ``binned``
(fitted by ``slotread calibrate`` under one permutation); ``temperature-bal`` (the same, fitted with
``--balance``: as many items of each class); ``perm4``, ``perm8``, ``perm16``, ``perm4-contextual``,
``perm8-contextual``, ``perm4-temperature`` (x_permutations; never for scores); a ``-shuffled`` twin
shows a choice's options in a seeded random order (the flip rate). Issue 6, eval flags that learn
from the train split (not BoolQ): ``ex8``/``ex24`` show 8/24 retrieved train examples, ``sl10``
reads 10 shortlisted options (choices only), ``ex8-sl10`` both; ``readout40``/``readout-all`` answer
with a readout fitted by ``slotread fit`` on 40 items per class / all of them (fused with the
24-neighbour vote), ``readout40-lex`` with one that also fuses the lexical classifier (``--lexical``:
TF-IDF + logistic regression on the train split). ``clinc-full`` (CLINC150 test, 1,000 of its 5,500
items out of scope) runs only the readouts and the baselines (``tfidf``, ``knn24``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

MODELS = {"q15": "qwen2.5-coder-1.5b-instruct", "q05": "qwen2.5-coder-0.5b-instruct"}


@dataclass(frozen=True)
class Setting:
    request: dict[str, object] = field(default_factory=dict)  # --request-field of the eval
    permutations: int | None = None  # the calibration artifact it reads is fitted under this many (None: none)
    shuffled: bool = False  # options shown in a seeded random order (the flip-rate twin of a setting)
    flags: tuple[str, ...] = ()  # further eval flags
    per_class: int | None = None  # answers with a readout fitted on this many items per class (0: all)
    balanced: bool = False  # its calibration artifact is fitted on as many items of each class (--balance)
    lexical: bool = False  # the readout also fuses the lexical classifier (slotread fit --lexical)

    @property
    def learns(self) -> bool:
        """Reads the train split at eval time (examples, shortlists) or was fitted on it (a readout)."""
        return bool(self.flags) or self.per_class is not None


PERM4: dict[str, object] = {"x_permutations": 4}
PERM8: dict[str, object] = {"x_permutations": 8}
PERM16: dict[str, object] = {"x_permutations": 16}
CONTEXTUAL: dict[str, object] = {"x_calibration": "contextual"}
TEMPERATURE: dict[str, object] = {"x_calibration": "temperature", "x_coverage": 0.9}
SETTINGS = {
    "plain": Setting(),
    "contextual": Setting(CONTEXTUAL),
    "temperature": Setting(TEMPERATURE, permutations=1),
    # BoolQ fits on dev_rest (64% yes) and is judged on the balanced dev_500: a fit on as many of each
    "temperature-bal": Setting(TEMPERATURE, permutations=1, balanced=True),
    "binned": Setting({"x_calibration": "binned"}, permutations=1),  # the p1 artifact holds the bins too
    "perm4": Setting(PERM4),
    "perm4-temperature": Setting(PERM4 | TEMPERATURE, permutations=4),
    "perm8": Setting(PERM8),
    "perm16": Setting(PERM16),
    "perm4-contextual": Setting(PERM4 | CONTEXTUAL),
    "perm8-contextual": Setting(PERM8 | CONTEXTUAL),
    "plain-shuffled": Setting(shuffled=True),
    "perm4-shuffled": Setting(PERM4, shuffled=True),
    "perm8-shuffled": Setting(PERM8, shuffled=True),
    "perm16-shuffled": Setting(PERM16, shuffled=True),
    "perm4-contextual-shuffled": Setting(PERM4 | CONTEXTUAL, shuffled=True),
    "perm8-contextual-shuffled": Setting(PERM8 | CONTEXTUAL, shuffled=True),
    "ex8": Setting(flags=("--examples", "8")),
    "ex24": Setting(flags=("--examples", "24")),
    "sl10": Setting(flags=("--shortlist", "10")),
    "ex8-sl10": Setting(flags=("--examples", "8", "--shortlist", "10")),
    "readout40": Setting(per_class=40),
    "readout-all": Setting(per_class=0),
    "readout40-lex": Setting(per_class=40, lexical=True),
}


@dataclass(frozen=True)
class Data:
    dataset: str
    split: str
    limit: int | None
    kind: str  # choice, score or noul
    fit_split: str
    fit_limit: int
    exclude_split: str
    settings: frozenset[str] | None = None  # the only settings run on it (None: all that apply)

    @property
    def train(self) -> bool:
        """Has a train split of the same classes to learn from (BoolQ fits on dev_rest)."""
        return self.fit_split == "train"


DATASETS = {
    "b77": Data("banking77", "test", None, "choice", "train", 1000, "test"),
    "clinc": Data("clinc150", "test_2per_label", None, "choice", "train", 1500, "test"),
    "sst5": Data("sst5", "test", 500, "score", "train", 1000, "test"),
    "boolq": Data("boolq", "dev_500", None, "noul", "dev_rest", 1000, "dev_500"),
    "b77-154": Data("banking77", "subset154", None, "choice", "train", 1000, "test"),
    # the out-of-scope recall target is judged on all 5,500 items: readouts against the baselines only
    "clinc-full": Data(
        "clinc150",
        "test",
        None,
        "choice",
        "train",
        1500,
        "test",
        settings=frozenset({"readout40", "readout-all", "readout40-lex"}),
    ),
}


def applies(name: str, data: Data) -> bool:
    """Scores are never permuted; only choices are shown in another order or shortlisted; examples,
    shortlists and readouts need a train split."""
    setting = SETTINGS[name]
    if data.settings is not None and name not in data.settings:
        return False
    if setting.learns and not data.train:
        return False
    if data.kind == "score" and "x_permutations" in setting.request:
        return False
    return data.kind == "choice" or not (setting.shuffled or "--shortlist" in setting.flags)


#: datasets in the order their cells start within a tier (the others follow in DATASETS' order)
FIRST = ("b77", "clinc-full", "clinc", "sst5")


def order(key: str) -> int:
    return FIRST.index(key) if key in FIRST else len(FIRST) + list(DATASETS).index(key)


def rank(model: str, key: str, name: str) -> tuple[int, ...]:
    """When a model's eval starts (lower first), so that the rows the GPU time must not miss come first:
    model by model (q15 first), its readouts, binned and BoolQ's balanced temperature (the ECE target
    it missed), examples and shortlists, permutations, the rest, then 16 permutations and 8 with
    contextual calibration (flip rates beyond the ones measured)."""
    setting = SETTINGS[name]
    if setting.per_class is not None and key in FIRST:
        tier = 1
    elif name == "binned" or (name == "temperature-bal" and key == "boolq"):
        tier = 2
    elif setting.flags:
        tier = 3
    elif name.startswith(("perm16", "perm8-contextual")):
        tier = 6
    elif name.startswith(("perm8", "perm4-contextual")) or (key == "b77" and name.startswith("perm4")):
        tier = 4
    else:
        tier = 5
    return list(MODELS).index(model), tier, order(key), 1


@dataclass
class Job:
    name: str
    command: list[str]
    needs: list[str] = field(default_factory=list)
    rank: tuple[int, ...] | None = None  # None: a prerequisite, ranked by the jobs that need it
    process: subprocess.Popen[bytes] | None = None


def slotread(*args: str) -> list[str]:
    return [sys.executable, "-m", "slotread.cli", *args]


def fields(request: dict[str, object]) -> list[str]:
    return [arg for key, value in request.items() for arg in ("--request-field", f"{key}={json.dumps(value)}")]


def prerequisite(out: Path, short: str, on: list[str], data: Data, setting: Setting) -> tuple[Job, list[str]] | None:
    """The fit a setting's eval reads (shared by the datasets fitted on the same data) and the eval
    flags that point to it; None when it reads none."""
    source = ["--dataset", data.dataset, "--split", data.fit_split]
    exclusion = ["--exclude", data.dataset, "--exclude-split", data.exclude_split, "--drop-overlap"]
    fetch = [f"{short}/fetch"]
    if setting.per_class is not None:
        variant = f"p{setting.per_class}" + ("-lex" if setting.lexical else "")
        folder = out / short / f"readout-{data.dataset}-{variant}"
        # --vote 24: the head is fused with the label vote of the knn24 baseline's 24 neighbours
        command = slotread(
            "fit", *on, *source, *exclusion, "--layout", "schema_first", "--per-class", str(setting.per_class),
            "--vote", "24", *(["--lexical"] if setting.lexical else []), "--batch-size", "64", "--out", str(folder),
        )  # fmt: skip
        name = f"{short}/fit/{data.dataset}/readout-{variant}"
        return Job(name, command, fetch), ["--readout", str(folder)]
    if setting.permutations is not None:
        fitted = f"p{setting.permutations}" + ("-bal" if setting.balanced else "")
        folder = out / short / f"calibration-{fitted}"
        permuted = fields({"x_permutations": setting.permutations}) if setting.permutations > 1 else []
        command = slotread(
            "calibrate", *on, *source, "--limit", str(data.fit_limit), *exclusion, *permuted,
            *(["--balance"] if setting.balanced else []), "--out", str(folder / f"{data.dataset}.json"),
        )  # fmt: skip
        return Job(f"{short}/fit/{data.dataset}/{fitted}", command, fetch), ["--calibration", str(folder)]
    return None


def plan(out: Path, models: list[str], datasets: list[str], settings: list[str], device: str) -> list[Job]:
    """Every job, in the order they should start."""
    jobs = []
    for key in datasets if "baseline" in models else []:
        data = DATASETS[key]
        where = ["--dataset", data.dataset, "--split", data.split] + (
            ["--limit", str(data.limit)] if data.limit else []
        )
        run, early = out / "baseline" / key, (-1, 0, order(key), 1)  # cheap and CPU-only: before every model
        tfidf = slotread("eval", "--baseline", "tfidf", *where, "--out", str(run / "tfidf"))
        jobs.append(Job(f"baseline/{key}/tfidf", tfidf, rank=early))
        if data.train:  # the vote every learning setting is measured against
            vote = slotread("eval", "--baseline", "knn", "--examples", "24", *where, "--out", str(run / "knn24"))
            jobs.append(Job(f"baseline/{key}/knn24", vote, rank=early))
    for short in [key for key in models if key in MODELS]:
        model = MODELS[short]
        on = ["--model", model, "--device", device]
        jobs.append(Job(f"{short}/fetch", slotread("models", "fetch", model)))
        fitted = set()
        for key in datasets:
            data = DATASETS[key]
            where = ["--dataset", data.dataset, "--split", data.split]
            where += ["--limit", str(data.limit)] if data.limit else []
            for name in [name for name in settings if applies(name, data)]:
                setting = SETTINGS[name]
                command = ["eval", *on, *where, *fields(setting.request), *setting.flags]
                command += ["--shuffle-options", "1"] if setting.shuffled else []
                needs = [f"{short}/fetch"]
                if fit := prerequisite(out, short, on, data, setting):
                    job, flags = fit
                    if job.name not in fitted:
                        fitted.add(job.name)
                        jobs.append(job)
                    command += flags
                    needs.append(job.name)
                command += ["--out", str(out / short / key / name)]
                jobs.append(Job(f"{short}/{key}/{name}", slotread(*command), needs, rank(short, key, name)))
    named = {job.name: job for job in jobs}
    for job in reversed(jobs):  # a job is planned after what it needs: a need starts just before its first user
        for need in job.needs:
            before = (*(job.rank or ())[:-1], 0)
            named[need].rank = min(named[need].rank or before, before)
    return sorted(jobs, key=lambda job: job.rank or ())


def shown(job: Job) -> str:
    """The job as a shell line to paste (JSON request fields keep their quotes)."""
    return shlex.join(["slotread", *job.command[3:]])


def done(job: Job) -> bool:
    """Finished earlier: an eval run with metrics, a fitted readout, or a calibration artifact that
    holds the top-label bins (one written before ``binned`` existed is fitted again)."""
    if "--out" not in job.command:
        return False
    target = Path(job.command[job.command.index("--out") + 1])
    if job.command[3] == "fit":
        return any(target.glob("*.readout.json"))
    if target.suffix == ".json":
        return target.is_file() and "binned" in json.loads(target.read_text(encoding="utf-8"))["methods"]
    return (target / "metrics.json").is_file()


def execute(jobs: list[Job], out: Path, parallel: int) -> int:
    # Each job gets its share of the CPU threads: torch's default (one per core in every process) left
    # the readout fits' L-BFGS spinning on an oversubscribed 16-core host (1,268 s against 11.5 s on 2 cores alone).
    # The cores are those this process may use, so grids pinned to disjoint cores (taskset) share the host.
    threads = str(max(1, len(os.sched_getaffinity(0)) // parallel))
    environment = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
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
                line = shown(job)
                commands.write(line + "\n")
                commands.flush()
                print(f"[{time.monotonic() - start:6.0f}s] start {job.name}: {line}", flush=True)
                log = (logs / (job.name.replace("/", "_") + ".log")).open("wb")
                job.process = subprocess.Popen(job.command, stdout=log, stderr=subprocess.STDOUT, env=environment)
                running.append(job)
            time.sleep(0.5)
    print(f"{len(finished)} done, {len(failed)} failed: {', '.join(failed) or '-'}")
    return 1 if failed else 0


#: (setting, its shuffled twin): the option-order flip rate is the share of items whose answer differs
FLIP_PAIRS = (
    ("plain", "plain-shuffled"),
    ("perm4", "perm4-shuffled"),
    ("perm8", "perm8-shuffled"),
    ("perm16", "perm16-shuffled"),
    ("perm4-contextual", "perm4-contextual-shuffled"),
    ("perm8-contextual", "perm8-contextual-shuffled"),
)


def row(*cells: object) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def tables(out: Path) -> str:
    """RESULTS.md's tables from the finished runs under ``out``: one per dataset (and one of the runs
    that learn from the train split against the 24-neighbour vote), then the flip rates."""
    from slotread.eval.report import compare, format_table, read_metrics

    def finished(run: Path) -> bool:
        return (run / "metrics.json").is_file()

    sections = []
    for key, data in DATASETS.items():
        runs = []
        for system in ["baseline", *MODELS]:
            for setting in ["tfidf", "knn24", *SETTINGS]:
                folder = out / system / key / setting
                if finished(folder):
                    runs.append(read_metrics(folder) | {"system": f"{system} {setting}"})
        if runs:
            sections.append(f"### {data.dataset} {data.split}\n\n{format_table(runs)}")
        vote = out / "baseline" / key / "knn24"
        paired = (
            [
                (system, name, compare(out / system / key / name, vote))
                for system in MODELS
                for name, setting in SETTINGS.items()
                if setting.learns and finished(out / system / key / name)
            ]
            if finished(vote)
            else []
        )
        if paired:
            lines = [
                row("system", "items", "accuracy", "vote accuracy", "only run right", "only vote right", "McNemar p"),
                "|---|---:|---:|---:|---:|---:|---:|",
            ]
            for system, name, c in paired:
                cells = [f"{c.accuracy_a:.3f}", f"{c.accuracy_b:.3f}", c.a_only, c.b_only, f"{c.p_value:.2g}"]
                lines.append(row(f"{system} {name}", c.items, *cells))
            sections.append(f"### {data.dataset} {data.split}: against the 24-neighbour vote\n\n" + "\n".join(lines))
    flips = [
        row("model", "dataset", "setting", "items", "flip rate", "accuracy", "accuracy shuffled"),
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for system in MODELS:
        for key in DATASETS:
            for setting, twin in FLIP_PAIRS:
                a, b = out / system / key / setting, out / system / key / twin
                if finished(a) and finished(b):
                    c = compare(a, b)
                    cells = [c.items, f"{c.flip_rate:.3f}", f"{c.accuracy_a:.3f}", f"{c.accuracy_b:.3f}"]
                    flips.append(row(system, key, setting, *cells))
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
    systems = ["baseline", *MODELS]
    if unknown := only - {*systems, *DATASETS, *SETTINGS}:  # a typo would otherwise run the whole grid
        parser.error(f"--only: unknown {', '.join(sorted(unknown))}")
    models = [key for key in systems if not only.intersection(systems) or key in only]
    datasets = [key for key in DATASETS if not only & DATASETS.keys() or key in only]
    settings = [key for key in SETTINGS if not only & SETTINGS.keys() or key in only]
    jobs = plan(args.out, models, datasets, settings, args.device)
    if args.dry_run:
        for job in jobs:
            print(job.name, shown(job))
        return 0
    return execute(jobs, args.out, args.jobs)


if __name__ == "__main__":
    sys.exit(main())
