"""DiffusionGemma's encoder and decoder forwards over batches, with cached prompt KV read in place.

The library's attention concatenates each row's cached KV with the new KV in every layer, so a prompt
shared by a batch is copied once per row and layer (20% of a decoder step on an H200 at 64
canvases). Here each layer attends in parts whose results merge exactly (``engines/attention.py``):

* a *shared* part: a cached prompt KV that a run of consecutive rows reads (one batch-1 attention for
  all of their queries, no copy); in the encoder a sliding layer hides, per query, the keys that
  fell out of its window;
* an *own* part, batched over rows: in the decoder each row's own prompt tokens after its shared
  part (if any) and its canvas, bidirectionally; in the encoder the new tokens, causally.

Norms, projections, the dense MLP, the router and the experts use the library's modules' weights in
the library's order (on a GPU the RMSNorm is one compiled kernel and the experts two grouped GEMMs);
the float32 tests compare with the library's own forward. The encoder skips the last layer's
feed-forward and the final norm: a prompt's KV never reads them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers.models.diffusion_gemma.modeling_diffusion_gemma import (
    DiffusionGemmaDecoderModel,
    DiffusionGemmaDecoderTextLayer,
    DiffusionGemmaEncoderTextLayer,
    DiffusionGemmaEncoderTextModel,
)

from slotread.engines import fused
from slotread.engines.attention import MASKED, attend, merge

logger = logging.getLogger(__name__)

Layer = DiffusionGemmaDecoderTextLayer | DiffusionGemmaEncoderTextLayer
#: (grouped queries (B, kvh, g * L, d), keys (B, kvh, L, d), values) -> merged output (B, kvh, g * L, d)
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SharedPart:
    """A prompt KV read by ``rows`` consecutive rows: per layer (1, kvh, S_l, d)."""

    rows: int
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class OwnPrompt:
    """Per row, prompt KV after its shared part: per layer (B, kvh, O_l, d), left-padded, and a
    (B, O_l) additive bias hiding the padding."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    bias: tuple[torch.Tensor, ...]


def decode(
    decoder: DiffusionGemmaDecoderModel,
    layer_types: Sequence[str],
    canvas: torch.Tensor,
    positions: torch.Tensor,
    canvas_bias: torch.Tensor,
    shared: list[SharedPart],
    own: OwnPrompt | None,
) -> torch.Tensor:
    """The decoder's final hidden states (B, C, hidden) for canvases (B, C) at ``positions`` (B, C).

    ``canvas_bias`` (B, C) hides right-padded canvas columns as keys; ``shared`` covers the rows in
    order. One step, no self-conditioning (a zero signal, as the library's first step).
    """

    def attention(index: int, grouped: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        own_keys, own_values, own_bias = keys, values, canvas_bias
        if own is not None:
            own_keys = torch.cat([own.keys[index], keys], dim=2)
            own_values = torch.cat([own.values[index], values], dim=2)
            own_bias = torch.cat([own.bias[index], canvas_bias], dim=1)
        own_part = attend(grouped, own_keys, own_values, own_bias[:, None, None, :].to(grouped.dtype))
        return merge([own_part, _shared_attention(index, grouped, shared, None)])

    embeds = decoder.embed_tokens(canvas)
    hidden = decoder.self_conditioning(embeds, torch.zeros_like(embeds))
    rotary = {kind: decoder.rotary_emb(hidden, positions, kind) for kind in set(layer_types)}
    for index, kind in enumerate(layer_types):
        layer = decoder.layers[index]
        assert isinstance(layer, DiffusionGemmaDecoderTextLayer)
        cos, sin = rotary[kind]
        hidden = _layer(layer, index, hidden, cos, sin, attention, feed_forward=True)
    return decoder.norm(hidden)


def encode(
    encoder: DiffusionGemmaEncoderTextModel,
    layer_types: Sequence[str],
    window: int,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    parents: list[SharedPart],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the keys and values (B, kvh, N, d) of new tokens (B, N) at ``positions`` (B, N),
    each row continuing its parent's KV (``parents`` covers the rows in order; empty: no parents).

    A sliding layer's parent KV holds the parent's last ``min(P, window - 1)`` tokens; query ``t``
    sees keys within ``window`` positions of itself, in the parent and among the new tokens alike.
    """
    new = tokens.shape[1]  # N
    steps = torch.arange(new, device=tokens.device)
    causal = torch.where(steps[None, :] <= steps[:, None], 0.0, MASKED)  # (N, N): query t, key j
    in_window = torch.where(steps[None, :] > steps[:, None] - window, causal, MASKED)
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attention(index: int, grouped: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        sliding = layer_types[index] == "sliding_attention"
        kv.append((keys, values))
        groups = grouped.shape[2] // new  # g: the query heads per kv head
        bias = (in_window if sliding else causal).repeat(groups, 1).to(grouped.dtype)  # (g * N, N)
        own_part = attend(grouped, keys, values, bias[None, None])
        if not parents:
            return own_part[0]
        return merge([own_part, _shared_attention(index, grouped, parents, window if sliding else None, new)])

    hidden = encoder.embed_tokens(tokens)
    rotary = {kind: encoder.rotary_emb(hidden, positions, kind) for kind in set(layer_types)}
    for index, kind in enumerate(layer_types):
        layer = encoder.layers[index]
        assert isinstance(layer, DiffusionGemmaEncoderTextLayer)
        cos, sin = rotary[kind]
        hidden = _layer(layer, index, hidden, cos, sin, attention, feed_forward=index < len(layer_types) - 1)
    return kv


def _shared_attention(
    index: int, grouped: torch.Tensor, parts: list[SharedPart], window: int | None = None, new: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each part's rows' queries (B, kvh, g * L, d) against the part's KV, as one batch-1 attention
    per part; returns the output and the LSE for all rows.

    With ``window`` (an encoder's sliding layer, rows of ``new`` tokens) query t hides the held keys
    more than ``window - 1`` positions before it: held key j sits ``held - j`` positions before new
    token 0, so it is hidden once ``t + held - j >= window``.
    """
    kv_heads, queries, dim = grouped.shape[1], grouped.shape[2], grouped.shape[3]
    outs, lses, row = [], [], 0
    for part in parts:
        keys, values = part.keys[index], part.values[index]
        bias = None
        if window is not None:
            held = keys.shape[-2]
            token = torch.arange(queries, device=grouped.device) % new  # t of each grouped query
            outside = torch.arange(held, device=grouped.device)[None, :] <= token[:, None] + held - window
            bias = torch.where(outside, MASKED, 0.0).to(grouped.dtype).repeat(part.rows, 1)[None, None]
        # the part's rows' queries as one batch-1 sequence: (1, kvh, rows * g * L, d)
        batched = grouped[row : row + part.rows].transpose(0, 1).reshape(1, kv_heads, -1, dim)
        out, lse = attend(batched, keys, values, bias)
        outs.append(out.reshape(kv_heads, part.rows, -1, dim).transpose(0, 1))
        lses.append(lse.reshape(kv_heads, part.rows, -1).transpose(0, 1))
        row += part.rows
    return torch.cat(outs), torch.cat(lses)


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
    gate, up = _grouped(hidden[order // k], experts.gate_up_proj, offsets).chunk(2, dim=-1)
    out = _grouped(experts.act_fn(gate) * up, experts.down_proj, offsets)
    return fused.combine(out, weights.reshape(-1)[order], inverse, k).to(hidden.dtype)


def _grouped(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """rows (S, in) @ weight[e].T for each expert's run of rows; weight (E, out, in)."""
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)


def _layer(
    layer: Layer,
    index: int,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attention: Attend,
    feed_forward: bool,
) -> torch.Tensor:
    """The library's decoder/encoder layer (they are the same but for attention) with ``attention``."""
    attn = layer.self_attn
    residual = hidden
    normed = _norm(layer.input_layernorm, hidden)
    batch, length, _ = normed.shape  # B, L
    eps = float(getattr(attn.q_norm, "eps"))  # noqa: B009 (mypy types module attributes as Tensor | Module)
    query = attn.q_proj(normed).view(batch, length, -1, attn.head_dim)  # (B, L, H, d)
    query = fused.norm_rotary(query, attn.q_norm.weight, eps, cos, sin)
    keys = attn.k_proj(normed).view(batch, length, -1, attn.head_dim)  # (B, L, kvh, d)
    values = attn.v_proj(normed).view(keys.shape) if attn.v_proj is not None else keys
    keys = fused.norm_rotary(keys, attn.k_norm.weight, eps, cos, sin).transpose(1, 2)  # (B, kvh, L, d)
    values = _norm(attn.v_norm, values).transpose(1, 2)
    # (B, kvh, g * L, d): a kv head's g query heads as one longer query sequence
    grouped = query.transpose(1, 2).reshape(batch, keys.shape[1], -1, attn.head_dim)
    merged = attention(index, grouped, keys, values)
    merged = merged.reshape(batch, -1, length, attn.head_dim).transpose(1, 2).reshape(batch, length, -1)
    hidden = residual + _norm(layer.post_attention_layernorm, attn.o_proj(merged))
    if not feed_forward:
        return hidden

    residual = hidden
    dense = _norm(layer.post_feedforward_layernorm_1, layer.mlp(_norm(layer.pre_feedforward_layernorm, hidden)))
    flat = residual.reshape(-1, residual.shape[-1])
    _, weights, experts = layer.router(flat)
    routed = _experts(layer, _norm(layer.pre_feedforward_layernorm_2, flat), experts, weights).reshape(residual.shape)
    combined = dense + _norm(layer.post_feedforward_layernorm_2, routed)
    hidden = residual + _norm(layer.post_feedforward_layernorm, combined)
    return hidden * layer.layer_scalar
