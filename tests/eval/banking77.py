"""BANKING77 folders written for a test, laid out as PolyAI ships the set."""

from __future__ import annotations

import json
from pathlib import Path


def write_banking77(root: Path, categories: list[str], splits: dict[str, list[tuple[str, str]]]) -> Path:
    """``root/banking77`` with ``categories.json`` and one ``text,category`` CSV per split; returns
    ``root`` (what ``--data-dir`` takes). Texts hold no commas (the CSVs are written unquoted)."""
    folder = root / "banking77"
    folder.mkdir(parents=True)
    (folder / "categories.json").write_text(json.dumps(categories))
    for split, rows in splits.items():
        (folder / f"{split}.csv").write_text("text,category\n" + "".join(f"{text},{label}\n" for text, label in rows))
    return root
