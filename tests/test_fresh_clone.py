"""README from a fresh clone: tests/fresh_clone.sh clones this repository, installs the clone and runs
README's evaluation example and ``slotread decide`` with an empty HOME and a new model cache."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_readme_runs_from_a_fresh_clone(cache_dir: Path) -> None:
    # the tests' Python (its venv holds the dependencies); the model's GGUF comes from the tests' cache
    env = {**os.environ, "PYTHON": sys.executable, "SOURCE_CACHE": str(cache_dir), "OMP_NUM_THREADS": "2"}
    result = subprocess.run(
        ["bash", str(ROOT / "tests" / "fresh_clone.sh")], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "README's evaluation example and slotread decide ran" in result.stdout
