"""One DiffusionGemma layer over a flat token matrix: norms, projections, the dense MLP, the router and
the experts in the library's order, with the attention left to the caller.

The weights are the library's modules'; on a GPU a layer's residual adds, norms and router input are
two compiled passes (``fused.py``) and the experts two grouped GEMMs (Triton's for a few rows per
expert, ``kernels.py``); in a batch-invariant forward every GEMM takes the fixed-tile kernels
(``invariant.py``). A layer's tokens may come from several *streams* (rows x length each): every
per-token module sees all of them at once, and only attention (``Attend``) looks at each stream apart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers.models.diffusion_gemma.modeling_diffusion_gemma import (
    DiffusionGemmaDecoderModel,
    DiffusionGemmaDecoderTextLayer,
    DiffusionGemmaEncoderTextLayer,
    DiffusionGemmaEncoderTextModel,
    DiffusionGemmaTextRouter,
)

from slotread.engines.diffusion_gemma import fused, invariant, kernels
from slotread.engines.diffusion_gemma.fast_paths import taken

Layer = DiffusionGemmaDecoderTextLayer | DiffusionGemmaEncoderTextLayer
#: Per stream, (queries (B, L, H, d), keys (B, L, kvh, d), values) -> the attention outputs
#: (B, L, H, d), one per stream
Attend = Callable[[int, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]], list[torch.Tensor]]


def rotary_tables(
    model: DiffusionGemmaDecoderModel | DiffusionGemmaEncoderTextModel,
    layer_types: Sequence[str],
    hidden: torch.Tensor,
    positions: torch.Tensor,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer kind, cos and sin (B * L, d) at ``positions`` (B, L)."""
    tables = {}
    for kind in set(layer_types):
        cos, sin = model.rotary_emb(hidden, positions, kind)
        tables[kind] = (cos.reshape(positions.numel(), -1), sin.reshape(positions.numel(), -1))
    return tables


def run_layers(
    model: DiffusionGemmaDecoderModel | DiffusionGemmaEncoderTextModel,
    layer_types: Sequence[str],
    hidden: torch.Tensor,
    streams: list[tuple[int, int]],
    rotary: dict[str, tuple[torch.Tensor, torch.Tensor]],
    attention: Attend,
    last_feed_forward: bool,
) -> torch.Tensor:
    """Every layer over ``hidden`` (T, hidden): the tokens of ``streams`` (rows, length) one after another."""
    for index, kind in enumerate(layer_types):
        layer = model.layers[index]
        assert isinstance(layer, DiffusionGemmaDecoderTextLayer | DiffusionGemmaEncoderTextLayer)
        cos, sin = rotary[kind]
        feed_forward = last_feed_forward or index < len(layer_types) - 1
        hidden = _layer(layer, index, hidden, streams, cos, sin, attention, feed_forward)
    return hidden


def _norm(module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A ``DiffusionGemmaRMSNorm`` module applied through the fused kernel (2D: one compiled shape family)."""
    eps = float(getattr(module, "eps"))  # noqa: B009 (mypy types module attributes as Tensor | Module)
    flat = hidden.reshape(-1, hidden.shape[-1])
    return fused.rms_norm(flat, getattr(module, "weight", None), eps).view(hidden.shape)


def _experts(layer: Layer, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The routed experts as two grouped GEMMs over the token copies sorted by expert.

    The library's grouped path also masks sentinel rows that plain top-k routing never produces
    (two full passes over the copies); the combine is the same deterministic gather and sum.
    """
    experts = layer.experts
    if not hidden.is_cuda:
        return experts(hidden, index, weights)
    k = index.shape[1]
    flat = index.reshape(-1)
    order = torch.argsort(flat)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    # counts by index_add, not bincount: bincount sizes its output on the host (a sync; no CUDA graph)
    counts = torch.zeros(experts.gate_up_proj.shape[0], dtype=torch.int32, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    # the batch-invariant GEMMs' tile map, built once for both
    tiles = kernels.expert_tiles(offsets, flat.shape[0]) if invariant.active(hidden) else None
    gate, up = _grouped(hidden[order // k], experts.gate_up_proj, offsets, tiles).chunk(2, dim=-1)
    out = _grouped(fused.gated(gate, up, experts.act_fn), experts.down_proj, offsets, tiles)
    return fused.combine(out, weights.reshape(-1), inverse, k).to(hidden.dtype)


def _grouped(
    rows: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """rows (S, in) @ weight[e].T for each expert's run of rows; weight (E, out, in). A few rows per
    expert (bfloat16 or half) go through the Triton kernel made for them, more through torch's; in a
    batch-invariant forward all through ``kernels.tiled_grouped`` (fixed tiles, rows in parallel;
    ``tiles``: its tile map, shared by a layer's two GEMMs)."""
    if invariant.active(rows):
        return kernels.tiled_grouped(rows, weight, offsets, tiles)
    few = rows.shape[0] <= kernels.GROUPED_MAX_ROWS * weight.shape[0]
    fast = few and rows.is_cuda and kernels.AVAILABLE and taken().triton_kernels
    if fast and rows.dtype in (torch.bfloat16, torch.float16):
        return kernels.grouped(rows, weight, offsets)
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)


def _layer(
    layer: Layer,
    index: int,
    hidden: torch.Tensor,
    streams: list[tuple[int, int]],
    cos: torch.Tensor,
    sin: torch.Tensor,
    attention: Attend,
    feed_forward: bool,
) -> torch.Tensor:
    """The library's decoder/encoder layer (they are the same but for attention) over ``hidden``
    (T, hidden), the tokens of ``streams`` (rows, length) one after another: every projection, the
    MLP and the experts over all tokens at once, the attention per stream. ``cos``/``sin`` (T, d)."""
    query, keys, values = before_attention(layer, hidden, cos, sin)
    outputs = attention(index, *by_stream(streams, query, keys, values))
    return after_attention(layer, hidden, merged(outputs, streams), feed_forward)


def before_attention(
    layer: Layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's work before attention, per token: the queries (T, H, d), keys and values (T, kvh, d),
    normed, the queries and keys rotated."""
    attn = layer.self_attn
    normed = _norm(layer.input_layernorm, hidden)
    tokens = hidden.shape[0]  # T
    eps = float(getattr(attn.q_norm, "eps"))  # noqa: B009 (mypy types module attributes as Tensor | Module)
    query = invariant.project(attn.q_proj, normed).view(1, tokens, -1, attn.head_dim)  # (1, T, H, d)
    query = fused.norm_rotary(query, attn.q_norm.weight, eps, cos[None], sin[None])[0]
    keys = invariant.project(attn.k_proj, normed).view(1, tokens, -1, attn.head_dim)  # (1, T, kvh, d)
    values = invariant.project(attn.v_proj, normed).view(keys.shape) if attn.v_proj is not None else keys
    keys = fused.norm_rotary(keys, attn.k_norm.weight, eps, cos[None], sin[None])[0]  # (T, kvh, d)
    return query, keys, _norm(attn.v_norm, values)[0]


def by_stream(
    streams: list[tuple[int, int]], query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """``before_attention``'s tensors cut per stream (rows, length): queries (B, L, H, d), keys and
    values (B, L, kvh, d), as ``Attend`` takes them."""
    queries, stream_keys, stream_values, start = [], [], [], 0
    for rows, length in streams:
        span = slice(start, start + rows * length)
        queries.append(query[span].view(rows, length, *query.shape[1:]))
        stream_keys.append(keys[span].view(rows, length, *keys.shape[1:]))
        stream_values.append(values[span].view(rows, length, *values.shape[1:]))
        start += rows * length
    return queries, stream_keys, stream_values


def merged(outputs: list[torch.Tensor], streams: list[tuple[int, int]]) -> torch.Tensor:
    """The streams' attention outputs as one (T, H * d) matrix, in token order."""
    flat = [out.reshape(rows * length, -1) for out, (rows, length) in zip(outputs, streams, strict=True)]
    return flat[0] if len(flat) == 1 else torch.cat(flat)


def after_attention(layer: Layer, hidden: torch.Tensor, attended: torch.Tensor, feed_forward: bool) -> torch.Tensor:
    """A layer's work after attention, per token: the output projection of ``attended`` (T, H * d) and
    the residual, then (if ``feed_forward``) the dense MLP, the router, the experts and their residual."""
    attn, router = layer.self_attn, layer.router
    hidden, dense_in, experts_in, router_in = fused.attention_residual(
        hidden,
        invariant.project(attn.o_proj, attended),
        _weight(layer.post_attention_layernorm),
        _weight(layer.pre_feedforward_layernorm),
        _weight(layer.pre_feedforward_layernorm_2),
        router.scale,
        float(router.scalar_root_size),
        float(router.eps),  # every norm of a layer has the config's rms_norm_eps
    )
    if not feed_forward:
        return hidden
    mlp = layer.mlp
    gate, up = invariant.project(mlp.gate_proj, dense_in), invariant.project(mlp.up_proj, dense_in)
    dense = invariant.project(mlp.down_proj, fused.gated(gate, up, mlp.act_fn))
    weights, experts = _route(router, router_in)
    return fused.feed_forward_residual(
        hidden,
        dense,
        _experts(layer, experts_in, experts, weights),
        _weight(layer.post_feedforward_layernorm_1),
        _weight(layer.post_feedforward_layernorm_2),
        _weight(layer.post_feedforward_layernorm),
        layer.layer_scalar,
        float(router.eps),
    )


def _route(router: DiffusionGemmaTextRouter, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The library router's top-k weights and experts (T, k) from its normed, scaled input
    (``fused.attention_residual``)."""
    top_k = router.config.top_k_experts
    assert top_k is not None
    probabilities = torch.softmax(invariant.project(router.proj, normed), dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probabilities, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * router.per_expert_scale[experts], experts


def _weight(norm: torch.nn.Module) -> torch.Tensor:
    """An RMSNorm's weight (mypy types module attributes as Tensor | Module)."""
    weight = norm.weight
    assert isinstance(weight, torch.Tensor)
    return weight
