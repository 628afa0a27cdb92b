"""The engine's fast paths: each one switched by one option, and each with a slower road to the same maths.

All are on by default; each takes effect only where it can run (``FastPaths.effective``), and the
engine logs the ones in effect at start-up. Off, a read takes the reference road, which the tests
and ``bench/`` compare each fast path with:

* ``cuda_graphs``: small decoder steps and joint forwards replay captured CUDA graphs (``graphs.py``)
  instead of launching ~1,500 kernels from Python (a GPU, bfloat16);
* ``layer_graphs``: a forward that no whole graph covers replays captured CUDA graphs of its layers'
  work between attention calls, keyed by token count (``layer_graphs.py``) instead of launching it
  from Python (a GPU, bfloat16);
* ``joint_encode``: a prompt's new last segment is encoded in the same forward as its canvases
  (``forward.encode_decode``) instead of in a forward of its own (needs the encoder's layers tied to
  the decoder's, as the library ties them; never in the deterministic mode);
* ``cudnn_attention``: cuDNN's fused attention where attention takes a bias, instead of the
  memory-efficient kernel (a GPU, bfloat16 or half, head size up to 256);
* ``flash_attention``: flash attention for the masks given by position (the encoder's causal and
  sliding windows, the joint canvases' runs) instead of the same masks as biases (a GPU);
* ``triton_kernels``: the Triton attention merge, expert combine and few-row grouped GEMM
  (``kernels.py``) instead of torch's ops (a GPU with Triton);
* ``compiled``: ``torch.compile`` of the norms and residual chains (``fused.py``) instead of eager ops
  (a GPU).

The forward reads the options from a context variable the engine sets around each read (``taking``),
as it reads the batch-invariant switch (``invariant.py``): two engines over one model keep their own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from slotread.engines.diffusion_gemma import kernels

if (
    TYPE_CHECKING
):  # fused.py imports this module: it must not load the model's code (bench/kernels.py imports fused alone)
    from transformers import DiffusionGemmaForBlockDiffusion

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FastPaths:
    """Which fast paths a DiffusionGemma engine may take (the module docstring says what each does)."""

    cuda_graphs: bool = True
    layer_graphs: bool = True
    joint_encode: bool = True
    cudnn_attention: bool = True
    flash_attention: bool = True
    triton_kernels: bool = True
    compiled: bool = True

    def effective(self, model: DiffusionGemmaForBlockDiffusion, deterministic: bool, invariant: bool) -> FastPaths:
        """Those of these options that run for ``model`` on its device: a deterministic read encodes its
        prompt apart from its canvases, and a batch-invariant one takes its own attention kernels."""
        gpu = model.device.type == "cuda"
        return FastPaths(
            # float32 grouped GEMMs copy their offsets to the host, which a graph cannot capture
            cuda_graphs=self.cuda_graphs and gpu and model.dtype == torch.bfloat16,
            layer_graphs=self.layer_graphs and gpu and model.dtype == torch.bfloat16,
            joint_encode=self.joint_encode and not deterministic and _tied_or_told(model),
            cudnn_attention=self.cudnn_attention and gpu and not invariant,
            flash_attention=self.flash_attention and gpu and not invariant,
            triton_kernels=self.triton_kernels and gpu and kernels.AVAILABLE,
            compiled=self.compiled and gpu,
        )

    def on(self) -> list[str]:
        """The names of the fast paths switched on."""
        return [field.name for field in fields(self) if getattr(self, field.name)]

    @classmethod
    def without(cls, slow: Iterable[str]) -> FastPaths:
        """Every fast path but those named (``--slow-path``); ValueError names an unknown one."""
        unknown = sorted(set(slow) - set(NAMES))
        if unknown:
            raise ValueError(f"no fast path is called {', '.join(unknown)}; the fast paths: {', '.join(NAMES)}")
        return cls(**dict.fromkeys(slow, False))


#: the fast paths' names, as settings and ``--slow-path`` take them
NAMES: tuple[str, ...] = tuple(field.name for field in fields(FastPaths))


#: every fast path allowed: what a forward run outside an engine's read (a test, a benchmark) may take
ALL = FastPaths()
_TAKEN: ContextVar[FastPaths] = ContextVar("fast_paths", default=ALL)


@contextmanager
def taking(paths: FastPaths) -> Iterator[None]:
    """Run the forwards inside with ``paths`` (outside any engine's read, every fast path is allowed)."""
    token = _TAKEN.set(paths)
    try:
        yield
    finally:
        _TAKEN.reset(token)


def taken() -> FastPaths:
    """The fast paths the forward running now may take."""
    return _TAKEN.get()


def tied(model: DiffusionGemmaForBlockDiffusion) -> bool:
    """Whether the encoder's layers, embedding and rotary tables are the decoder's (tied parameters,
    equal buffers), so a joint forward may run new prompt tokens through the decoder's modules, and
    the encoder's forwards may replay graph pieces captured over the decoder's."""
    encoder, decoder = model.model.encoder.language_model, model.model.decoder
    pairs = [(getattr(encoder, name), getattr(decoder, name)) for name in ("layers", "embed_tokens", "rotary_emb")]
    return all(
        all(a is b for a, b in zip(mine.parameters(), theirs.parameters(), strict=True))
        and all(torch.equal(a, b) for a, b in zip(mine.buffers(), theirs.buffers(), strict=True))
        for mine, theirs in pairs
    )


def _tied_or_told(model: DiffusionGemmaForBlockDiffusion) -> bool:
    """``tied``, with a warning where it is not (joint encoding was asked for)."""
    if tied(model):
        return True
    logger.warning("the encoder's layers are not tied to the decoder's: no joint encoding")
    return False
