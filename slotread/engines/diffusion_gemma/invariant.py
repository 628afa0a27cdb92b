"""Batch-invariant reads on a GPU: each row's result independent of the batch around it, bit for bit.

A bfloat16 read moves with what else is in its forward because the library kernels pick their
tiling, and with it the order of their float sums, by the shape of the whole batch: cuBLAS's GEMMs
(split reductions for few rows), flash attention (it splits the keys when the batch is small), the
fused attention kernels (tiles by size). Inside ``batch_invariant()`` the DiffusionGemma forward
sends the projections (``linear``), the experts and attention to Triton kernels with fixed tiles
(``kernels.py``), whose per-row sums run in one order whatever the batch, and the engine
lays out each read's attention parts the same way alone and in a batch (``DiffusionGemmaEngine``'s
``deterministic``). The norms, rotary and residual steps are per-row already.

The switch is a context variable, so two engines over one model (the bench's batched and
deterministic ones) and the threads of a server do not see each other's mode.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from slotread.engines.diffusion_gemma import kernels

_ACTIVE: ContextVar[bool] = ContextVar("batch_invariant", default=False)


@contextmanager
def batch_invariant(on: bool = True) -> Iterator[None]:
    """Run the forwards inside with the batch-invariant kernels (where ``available``) if ``on``."""
    token = _ACTIVE.set(on)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def available(device: torch.device) -> bool:
    """Whether the batch-invariant kernels run on ``device``: a GPU with Triton."""
    return device.type == "cuda" and kernels.AVAILABLE


def active(tensor: torch.Tensor) -> bool:
    """Whether a forward over ``tensor`` runs batch-invariant now."""
    return _ACTIVE.get() and tensor.is_cuda and kernels.AVAILABLE


def linear(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` over (..., in), with the fixed-tile kernel when ``active``."""
    if not active(hidden):
        return F.linear(hidden, weight, bias)
    out = kernels.linear(hidden.reshape(-1, hidden.shape[-1]), weight).view(*hidden.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def project(module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A ``torch.nn.Linear`` module applied to ``hidden`` through ``linear``."""
    assert isinstance(module, torch.nn.Linear)
    return linear(hidden, module.weight, module.bias)
