"""``bench/failover.py`` as README runs it, shortened: a soak with a replica killed and restarted, through
real processes. Its tables must come out whole, and what its clients got must be what the fault tests
demand (200, or a 503/529 with retry-after)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slotread.models.load import LoadedModel

BENCH = Path(__file__).parents[2] / "bench" / "failover.py"


@pytest.mark.slow
def test_the_soak_prints_its_timeline_and_each_kill(smollm2: LoadedModel, cache_dir: Path) -> None:
    """``--soak 600 --kill-every 60`` cut to 24 s with a kill every 10 s (the model is cached by the fixture)."""
    command = [sys.executable, str(BENCH), "--clients", "4", "--soak", "24", "--kill-every", "10"]
    command += ["--down-for", "3", "--window", "12"]
    env = {**os.environ, "SLOTREAD_CACHE": str(cache_dir)}
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    answered, sent = map(int, re.search(r"^\| (\d+) of (\d+) \|", out, re.MULTILINE).groups())  # type: ignore[union-attr]
    assert 0 < answered <= sent
    statuses = re.findall(r"\b(\d{3}): \d+", out)
    assert statuses and set(statuses) <= {"200", "503", "529"}, out
    assert "retried statuses without retry-after: 0" in out
    assert re.search(r"^\| 0-12 \| [\d.]+ \|", out, re.MULTILINE), out  # the timeline's first window
    phases = re.findall(r"^\| kill (\d) at \d+ s \| (before|during|after) \|", out, re.MULTILINE)
    assert phases == [(victim, name) for victim in "01" for name in ("before", "during", "after")], out
