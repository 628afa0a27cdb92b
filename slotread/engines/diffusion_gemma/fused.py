"""Elementwise chains and gathers of the DiffusionGemma forward, each one kernel on a GPU.

In eager mode each of these is several passes over the activations in float32 (an RMSNorm is six);
at 64 canvases they were a third of a decoder step on an H200. ``torch.compile`` fuses the norms
into one kernel each; the attention merge and the expert combine, which it compiled into kernels
5-10x slower than their memory time, are hand-written Triton kernels (``kernels.py``). The
functions are plain torch, so on a CPU (and wherever compilation fails, e.g. without Triton) they
run eagerly with the same maths; the float32 tests run them that way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import wraps
from typing import ParamSpec, TypeVar

import torch

from slotread.engines.diffusion_gemma import kernels
from slotread.engines.diffusion_gemma.fast_paths import taken

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

_compiler_failed = False


def _fused(fn: Callable[P, T]) -> Callable[P, T]:
    """``fn`` compiled (dynamic shapes) when its first argument is on a GPU (``FastPaths.compiled``),
    eager otherwise.

    Compiled on first use: importing the compiler costs seconds a CPU-only process never needs.
    """
    compiled: Callable[P, T] | None = None

    @wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        global _compiler_failed
        nonlocal compiled
        first = args[0]
        if not _compiler_failed and isinstance(first, torch.Tensor) and first.is_cuda and taken().compiled:
            try:
                compiled = compiled or torch.compile(fn, dynamic=True)
                return compiled(*args, **kwargs)
            except Exception:  # no working compiler here: eager from now on
                logger.warning("torch.compile failed; running eagerly", exc_info=True)
                _compiler_failed = True
        return fn(*args, **kwargs)

    return run


def _normed(hidden: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``DiffusionGemmaRMSNorm``: float32 statistics, scaled by the weight if any, in the input dtype."""
    normed = hidden.float()
    normed = normed * torch.pow(normed.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        normed = normed * weight.float()
    return normed.type_as(hidden)


@_fused
def rms_norm(hidden: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return _normed(hidden, weight, eps)


@_fused
def norm_rotary(
    heads: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """The per-head RMSNorm then the rotary embedding (the library's ``apply_rotary_pos_emb`` with
    ``unsqueeze_dim=2``) of heads (B, L, h, d) at cos/sin (B, L, d)."""
    normed = _normed(heads, weight, eps)
    half = normed.shape[-1] // 2
    rotated = torch.cat((-normed[..., half:], normed[..., :half]), dim=-1)
    return normed * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)


@_fused
def gated(gate: torch.Tensor, up: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The gated activation ``activation(gate) * up`` of the MLPs and the experts: one pass instead
    of an activation and a product (the experts' halves are strided views of one GEMM's output)."""
    return activation(gate) * up


@_fused
def attention_residual(
    residual: torch.Tensor,
    attended: torch.Tensor,
    post: torch.Tensor,
    pre_dense: torch.Tensor,
    pre_experts: torch.Tensor,
    router_scale: torch.Tensor,
    router_root: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's hidden state after attention, ``residual + norm(attended)``, and the three inputs
    read from it: normed for the dense MLP, for the experts, and for the router (its norm without a
    weight, times its scale and ``router_root``), compiled together instead of a pass per op."""
    hidden = residual + _normed(attended, post, eps)
    router = _normed(hidden, None, eps) * router_scale * router_root
    return hidden, _normed(hidden, pre_dense, eps), _normed(hidden, pre_experts, eps), router


@_fused
def feed_forward_residual(
    residual: torch.Tensor,
    dense: torch.Tensor,
    routed: torch.Tensor,
    post_dense: torch.Tensor,
    post_experts: torch.Tensor,
    post: torch.Tensor,
    scalar: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """A layer's output from its feed-forward halves: ``(residual + norm(norm(dense) +
    norm(routed))) * scalar``, the library's order, compiled together."""
    combined = _normed(dense, post_dense, eps) + _normed(routed, post_experts, eps)
    return (residual + _normed(combined, post, eps)) * scalar


def merge_two(
    first: torch.Tensor, first_lse: torch.Tensor, second: torch.Tensor, second_lse: torch.Tensor
) -> torch.Tensor:
    """Attention over the union of two key sets from each set's output (…, Q, d) and LSE (…, Q)."""
    if first.is_cuda and kernels.AVAILABLE and taken().triton_kernels:
        return kernels.merge_two(first, first_lse, second, second_lse)
    return merge_two_torch(first, first_lse, second, second_lse)


def merge_two_torch(
    first: torch.Tensor, first_lse: torch.Tensor, second: torch.Tensor, second_lse: torch.Tensor
) -> torch.Tensor:
    """``merge_two`` in torch ops."""
    total = torch.logaddexp(first_lse, second_lse)
    merged = (
        first.float() * torch.exp(first_lse - total)[..., None]
        + second.float() * torch.exp(second_lse - total)[..., None]
    )
    return merged.to(first.dtype)


def combine(rows: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token's sum over its top-k expert outputs, weighted, in ``rows``' dtype: ``rows`` (S, h) in
    expert order, ``weights`` (S,) in token order (token t's k-th at ``t * top_k + k``), ``inverse``
    (S,) the expert-order row of each (token, k) copy."""
    if rows.is_cuda and kernels.AVAILABLE and taken().triton_kernels:
        return kernels.combine(rows, weights, inverse, top_k)
    return combine_torch(rows, weights, inverse, top_k)


def combine_torch(rows: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    """``combine`` in torch ops."""
    weighted = rows[inverse].float() * weights[:, None].float()
    return weighted.view(-1, top_k, rows.shape[-1]).sum(dim=1).to(rows.dtype)
