"""The neighbour vote with BM25, dense and hybrid retrieval (``slotread eval --baseline knn --retrieval R``).

Each run is what ``slotread eval --baseline knn --examples K [--per-class 10] --retrieval R --encoder
all-minilm-l6-v2`` runs (``eval.evaluate``), in one process so the encoder embeds each text once; the
bank is the train split (K = 10 per class: the seeded draw ``--per-class 10`` makes, nothing else seen),
the evaluated items the whole test split. Dense and hybrid are paired against BM25 with the exact
McNemar test (``slotread eval compare``). CLINC150 is its in-scope part (``bench/clinc_in_scope.py``).

    SLOTREAD_DATA=/work/shared/data python bench/retrieval_vote.py OUT_DIR [DATASET...]

prints a Markdown table and writes the run folders and ``OUT_DIR/table.md``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from slotread.eval.evaluate import evaluate
from slotread.eval.report import compare
from slotread.quality.examples.retrieval import RETRIEVALS
from slotread.settings import EvalSettings

ENCODER = "all-minilm-l6-v2"
#: (labels seen per class, voting neighbours): K per class votes with its K nearest, all labels with 24
SETTINGS: tuple[tuple[int | None, int], ...] = ((10, 10), (None, 24))


def datasets(out: Path) -> dict[str, dict[str, Any]]:
    """The evaluated data as EvalSettings fields, by name."""
    clinc = out / "clinc-in"
    if not (clinc / "question.json").is_file():
        subprocess.run([sys.executable, str(Path(__file__).parent / "clinc_in_scope.py"), str(clinc)], check=True)
    return {
        "banking77": {"dataset": "banking77"},
        "clinc150-in-scope": {
            "dataset": str(clinc / "test.jsonl"),
            "question": clinc / "question.json",
            "train": str(clinc / "train.jsonl"),
        },
        "sst5": {"dataset": "sst5"},
    }


def main(out: Path, names: list[str]) -> None:
    rows = [
        "| data (test items) | labels per class | neighbours | retrieval | accuracy ± 95% | ECE | NLL "
        "| vs BM25: only this right / only BM25 right | McNemar p |",
        "|---|---|---:|---|---:|---:|---:|---|---:|",
    ]
    found = datasets(out)
    for name in names or list(found):
        for per_class, k in SETTINGS:
            runs: dict[str, Path] = {}
            for retrieval in RETRIEVALS:
                folder = out / f"{name}-{per_class or 'all'}-{retrieval}-vote{k}"
                settings = EvalSettings(
                    **found[name],
                    out=folder,
                    baseline="knn",
                    examples=k,
                    per_class=per_class,
                    retrieval=retrieval,
                    encoder=ENCODER if retrieval != "bm25" else None,
                    progress=False,
                )
                metrics = evaluate(settings)
                runs[retrieval] = folder
                accuracy, items = metrics["accuracy"], metrics["items"]
                half = 1.96 * (accuracy * (1 - accuracy) / items) ** 0.5
                paired = ["", ""]
                if retrieval != "bm25":
                    c = compare(folder, runs["bm25"])
                    paired = [f"{c.a_only} / {c.b_only}", f"{c.p_value:.2g}"]
                row = [
                    f"{name} ({items})",
                    str(per_class or "all"),
                    str(k),
                    retrieval,
                    f"{accuracy:.1%} ± {half:.1%}",
                    f"{metrics['ece']:.3f}",
                    f"{metrics['nll']:.3f}",
                    *paired,
                ]
                rows.append("| " + " | ".join(row) + " |")
                print(rows[-1], flush=True)
    (out / "table.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
