"""Write CLINC150's in-scope part as labelled files with their question (the 150 intents, no "out of scope").

The issue measures no-label and few-label accuracy on CLINC150's in-scope queries: this writes
``test.jsonl`` (4,500 queries), ``train.jsonl`` (15,000) and ``question.json`` into a folder, for
``slotread eval --dataset DIR/test.jsonl --questions DIR/question.json [--train DIR/train.jsonl]``.

    python bench/clinc_in_scope.py runs/clinc-in-scope
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from slotread.eval.datasets import load_dataset

OUT_OF_SCOPE = "out of scope"


def main(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("test", "train"):
        data = load_dataset("clinc150", split)
        names = list(data.task.question["criteria"])
        if split == "test":
            criteria = {name: value for name, value in data.task.question["criteria"].items() if name != OUT_OF_SCOPE}
            question = {**data.task.question, "criteria": criteria}
            (folder / "question.json").write_text(json.dumps(question, ensure_ascii=False, indent=1) + "\n")
        with (folder / f"{split}.jsonl").open("w", encoding="utf-8") as out:
            for item in data.items:
                if names[item.gold] != OUT_OF_SCOPE:
                    out.write(json.dumps({"id": item.id, "text": item.state, "label": names[item.gold]}) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
