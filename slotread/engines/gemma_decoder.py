"""One DiffusionGemma decoder step over a batch of canvases, with the prompt KV read in place.

The library's decoder concatenates each row's prompt KV with the canvas KV in every layer, so a
prompt shared by a batch of canvases is copied once per row and layer (20% of the step on an H200
at 64 canvases). Here each layer attends in two parts whose results merge exactly
(``engines/attention.py``):

* the *shared* part: a cached prompt KV that a run of consecutive rows reads (one batch-1 attention
  for all of their queries, no copy);
* the *own* part: each row's own prompt tokens after the shared part, if any, then its canvas
  (a batched attention, padded and masked per row).

Everything else (norms, projections, the dense MLP, the router and the experts) is the library's
own modules, called in the library's order, so the weights and their maths stay the library's;
the fp32 tests compare with the library's forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.models.diffusion_gemma.modeling_diffusion_gemma import (
    DiffusionGemmaDecoderModel,
    DiffusionGemmaDecoderTextLayer,
    apply_rotary_pos_emb,
)

from slotread.engines.attention import attend, merge


@dataclass(frozen=True)
class SharedPart:
    """A prompt KV read by ``rows`` consecutive rows: per layer (1, kvh, S_l, d), all visible."""

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
    embeds = decoder.embed_tokens(canvas)
    hidden = decoder.self_conditioning(embeds, torch.zeros_like(embeds))
    rotary = {kind: decoder.rotary_emb(hidden, positions, kind) for kind in set(layer_types)}
    for index, kind in enumerate(layer_types):
        layer = decoder.layers[index]
        assert isinstance(layer, DiffusionGemmaDecoderTextLayer)
        cos, sin = rotary[kind]
        hidden = _layer(layer, index, hidden, cos, sin, canvas_bias, shared, own)
    return decoder.norm(hidden)


def _layer(
    layer: DiffusionGemmaDecoderTextLayer,
    index: int,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    canvas_bias: torch.Tensor,
    shared: list[SharedPart],
    own: OwnPrompt | None,
) -> torch.Tensor:
    """``DiffusionGemmaDecoderTextLayer.forward`` with the attention in two parts."""
    residual = hidden
    attended = _attention(layer, index, layer.input_layernorm(hidden), cos, sin, canvas_bias, shared, own)
    hidden = residual + layer.post_attention_layernorm(attended)

    residual = hidden
    dense = layer.post_feedforward_layernorm_1(layer.mlp(layer.pre_feedforward_layernorm(hidden)))
    flat = residual.reshape(-1, residual.shape[-1])
    _, weights, experts = layer.router(flat)
    routed = layer.experts(layer.pre_feedforward_layernorm_2(flat), experts, weights).reshape(residual.shape)
    hidden = residual + layer.post_feedforward_layernorm(dense + layer.post_feedforward_layernorm_2(routed))
    return hidden * layer.layer_scalar


def _attention(
    layer: DiffusionGemmaDecoderTextLayer,
    index: int,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    canvas_bias: torch.Tensor,
    shared: list[SharedPart],
    own: OwnPrompt | None,
) -> torch.Tensor:
    """The attention block of one layer: projections, both parts, merge, output projection."""
    attn = layer.self_attn
    batch, columns, _ = hidden.shape  # B, C
    query = attn.q_norm(attn.q_proj(hidden).view(batch, columns, -1, attn.head_dim))  # (B, C, H, d)
    query = apply_rotary_pos_emb(query, cos, sin, unsqueeze_dim=2)
    keys = attn.k_proj(hidden).view(batch, columns, -1, attn.head_dim)  # (B, C, kvh, d)
    values = attn.v_proj(hidden).view(keys.shape) if attn.v_proj is not None else keys
    keys = apply_rotary_pos_emb(attn.k_norm(keys), cos, sin, unsqueeze_dim=2).transpose(1, 2)  # (B, kvh, C, d)
    values = attn.v_norm(values).transpose(1, 2)
    kv_heads = keys.shape[1]
    # (B, kvh, g * C, d): a kv head's g query heads as one longer query sequence
    grouped = query.transpose(1, 2).reshape(batch, kv_heads, -1, attn.head_dim)

    own_keys, own_values, own_bias = keys, values, canvas_bias
    if own is not None:
        own_keys = torch.cat([own.keys[index], keys], dim=2)
        own_values = torch.cat([own.values[index], values], dim=2)
        own_bias = torch.cat([own.bias[index], canvas_bias], dim=1)
    parts = [attend(grouped, own_keys, own_values, own_bias[:, None, None, :].to(grouped.dtype))]

    outs, lses, row = [], [], 0
    for part in shared:
        # the part's rows' queries as one batch-1 sequence: (1, kvh, rows * g * C, d)
        queries = grouped[row : row + part.rows].transpose(0, 1).reshape(1, kv_heads, -1, attn.head_dim)
        out, lse = attend(queries, part.keys[index], part.values[index], None)
        outs.append(out.reshape(kv_heads, part.rows, -1, attn.head_dim).transpose(0, 1))
        lses.append(lse.reshape(kv_heads, part.rows, -1).transpose(0, 1))
        row += part.rows
    parts.append((torch.cat(outs), torch.cat(lses)))

    merged = merge(parts)  # (B, kvh, g * C, d)
    merged = merged.reshape(batch, -1, columns, attn.head_dim).transpose(1, 2).reshape(batch, columns, -1)
    return attn.o_proj(merged)
