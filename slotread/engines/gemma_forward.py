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
the library's order (on a GPU a layer's residual adds, norms and router input are two compiled
passes, and the experts two grouped GEMMs); the float32 tests compare with the library's own
forward. On a GPU the encoder's causal and sliding masks, and the joint canvases' reads of their
state's new tokens, are given to flash attention by position (``attention.attend_heads`` and
``attend_runs``) instead of as biases. The encoder skips the last layer's
feed-forward and the final norm: a prompt's KV never reads them.

A layer runs over a flat token matrix holding one or more *streams* (rows x length each): every
per-token module sees all of them at once, and only attention looks at each stream apart. That is
how ``encode_decode`` puts new prompt tokens and the canvases that read them through one forward.
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
    DiffusionGemmaTextRouter,
)

from slotread.engines import fused, invariant, kernels
from slotread.engines.attention import (
    MASKED,
    attend,
    attend_heads,
    attend_runs,
    grouped,
    heads_ok,
    merge,
    ungrouped,
)

logger = logging.getLogger(__name__)

Layer = DiffusionGemmaDecoderTextLayer | DiffusionGemmaEncoderTextLayer
#: Per stream, (queries (B, L, H, d), keys (B, L, kvh, d), values) -> the attention outputs
#: (B, L, H, d), one per stream
Attend = Callable[[int, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]], list[torch.Tensor]]


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


@dataclass(frozen=True)
class Canvases:
    """Decoder rows: canvases (B, C) at ``positions`` (B, C); ``bias`` (B, C) hides right-padded
    columns as keys; ``shared`` covers the rows in order."""

    tokens: torch.Tensor
    positions: torch.Tensor
    bias: torch.Tensor
    shared: list[SharedPart]


@dataclass(frozen=True)
class ImageTokens:
    """Soft tokens of images among encoder rows: ``where`` (K,) their places in the flat (B * N) new
    tokens, ``features`` (K, hidden) their embeddings from the vision tower, and ``blocks`` (B, N) each
    new token's image in its row (-1: text). The tokens of one image attend to each other in both
    directions, as the library's ``use_bidirectional_attention="vision"`` masks do; ``blocks`` None:
    a model without it reads them causally, as text."""

    where: torch.Tensor
    features: torch.Tensor
    blocks: torch.Tensor | None


@dataclass(frozen=True)
class NewTokens:
    """Encoder rows: tokens (B, N) at ``positions`` (B, N), each row continuing its parent's KV
    (``parents`` covers the rows in order; empty: no parents), with the soft tokens of any images."""

    tokens: torch.Tensor
    positions: torch.Tensor
    parents: list[SharedPart]
    images: ImageTokens | None = None


def decode(
    decoder: DiffusionGemmaDecoderModel,
    layer_types: Sequence[str],
    canvases: Canvases,
    own: OwnPrompt | None,
    conditioning: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decoder's final hidden states (B, C, hidden) for ``canvases``, each row also attending to
    its ``own`` prompt tokens after its shared part. One step; ``conditioning`` (B, C, hidden) is the
    self-conditioning signal (the soft embeddings of the previous step's logits), None a zero one, as
    the library's first step."""

    def attention(
        index: int, queries: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        own_kv = None if own is None else (own.keys[index], own.values[index], own.bias[index])
        return [_decoder_attention(index, queries[0], keys[0], values[0], canvases, own_kv)]

    batch, columns = canvases.tokens.shape
    hidden, rotary = _decoder_input(decoder, layer_types, canvases, conditioning)
    hidden = _layers(decoder, layer_types, hidden, [(batch, columns)], rotary, attention, last_feed_forward=True)
    return decoder.norm(hidden).view(batch, columns, -1)


def encode(
    encoder: DiffusionGemmaEncoderTextModel, layer_types: Sequence[str], window: int, new: NewTokens
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the keys and values (B, kvh, N, d) of the ``new`` tokens.

    A sliding layer's parent KV holds the parent's last ``min(P, window - 1)`` tokens; query ``t``
    sees keys within ``window`` positions of itself, in the parent and among the new tokens alike.
    """
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attention(
        index: int, queries: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        kv.append((keys[0].transpose(1, 2), values[0].transpose(1, 2)))
        blocks = None if new.images is None else new.images.blocks
        return [_encoder_attention(index, queries[0], keys[0], values[0], layer_types, window, new.parents, blocks)]

    batch, length = new.tokens.shape
    hidden = encoder.embed_tokens(new.tokens)
    if new.images is not None:  # the features replace the embeddings, as the library's masked_scatter does
        flat = hidden.view(batch * length, -1).index_copy(0, new.images.where, new.images.features.to(hidden.dtype))
        hidden = flat.view(batch, length, -1)
    rotary = _rotary(encoder, layer_types, hidden, new.positions)
    # a prompt's KV never reads the last layer's feed-forward
    _layers(encoder, layer_types, hidden.view(batch * length, -1), [(batch, length)], rotary, attention, False)
    return kv


@dataclass(frozen=True)
class JointMasks:
    """What the canvases of ``encode_decode`` see, per layer kind, as additive biases: ``own``
    (B_c, N) over their row's new tokens (one visible run per row: the window's, before padding),
    ``shared`` (B_c, S) over the first S keys of their shared part (a kind without an entry sees the
    whole part). ``states`` (B + 1,) int32, where each new-token row's canvases are consecutive and
    in row order: row r's canvases are ``states[r]`` to ``states[r + 1]`` (on a GPU they then read
    their row's new tokens in place, ``attention.attend_runs``); None where they are not."""

    own: dict[str, torch.Tensor]
    shared: dict[str, torch.Tensor]
    states: torch.Tensor | None = None


def encode_decode(
    decoder: DiffusionGemmaDecoderModel,
    layer_types: Sequence[str],
    window: int,
    new: NewTokens,
    canvases: Canvases,
    own_rows: torch.Tensor,
    masks: JointMasks,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """``encode`` and ``decode`` in one pass over the layers, for canvases whose own prompt tokens are
    the ``new`` tokens being encoded: canvas row r reads new-token row ``own_rows[r]`` (B_c,), as
    ``masks`` lets it (the engine hides a sliding layer's tokens out of the window, and padding).

    The encoder's layers are the decoder's (tied weights, checked by the engine), so the new tokens
    and the canvases go through every projection, the dense MLP and the experts together: the
    weights are read once, and the launches are those of one forward. Returns ``encode``'s KV and
    ``decode``'s hidden states. New tokens right-padded after a row's own are harmless to it (causal).
    """
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    length = new.tokens.shape[1]  # N
    runs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # per kind: the visible new tokens' runs
    own_runs = _canvas_runs(canvases)  # once, not in each layer

    def attention(
        index: int, queries: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        kv.append((keys[0].transpose(1, 2), values[0].transpose(1, 2)))
        encoded = _encoder_attention(index, queries[0], keys[0], values[0], layer_types, window, new.parents)
        kind = layer_types[index]
        if masks.states is not None and heads_ok(queries[1], keys[1], False, None):
            if kind not in runs:
                runs[kind] = _visible_runs(masks.own[kind], masks.states)
            decoded = _joint_canvas_attention(
                index, queries[1], keys, values, canvases, masks.states, runs[kind], own_runs, masks.shared.get(kind)
            )
        else:
            own = (keys[0][own_rows].transpose(1, 2), values[0][own_rows].transpose(1, 2), masks.own[kind])
            decoded = _decoder_attention(index, queries[1], keys[1], values[1], canvases, own, masks.shared.get(kind))
        return [encoded, decoded]

    rows, columns = canvases.tokens.shape
    new_hidden = decoder.embed_tokens(new.tokens)
    new_rotary = _rotary(decoder, layer_types, new_hidden, new.positions)
    canvas_hidden, canvas_rotary = _decoder_input(decoder, layer_types, canvases)
    hidden = torch.cat([new_hidden.view(new.tokens.numel(), -1), canvas_hidden])
    rotary = {
        kind: (torch.cat([table[0], canvas_rotary[kind][0]]), torch.cat([table[1], canvas_rotary[kind][1]]))
        for kind, table in new_rotary.items()
    }
    streams = [(new.tokens.shape[0], length), (rows, columns)]
    # the new tokens' last feed-forward is wasted work (1/L of theirs), cheaper than a split
    hidden = _layers(decoder, layer_types, hidden, streams, rotary, attention, last_feed_forward=True)
    return kv, decoder.norm(hidden[new.tokens.numel() :]).view(rows, columns, -1)


def _decoder_input(
    decoder: DiffusionGemmaDecoderModel,
    layer_types: Sequence[str],
    canvases: Canvases,
    conditioning: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The canvases' first hidden states (B * C, hidden) and rotary tables; ``conditioning`` as in ``decode``."""
    embeds = decoder.embed_tokens(canvases.tokens)
    hidden = decoder.self_conditioning(embeds, torch.zeros_like(embeds) if conditioning is None else conditioning)
    return hidden.view(canvases.tokens.numel(), -1), _rotary(decoder, layer_types, hidden, canvases.positions)


def _rotary(
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


def _layers(
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


def _decoder_attention(
    index: int,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    canvases: Canvases,
    own: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    shared_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Canvas queries (B, C, H, d) against their own prompt tokens (if any: keys and values
    (B, kvh, O, d), bias (B, O)) and canvas (keys (B, C, kvh, d)), bidirectionally, merged with their
    shared part (``shared_bias`` (B, S) over its first keys); (B, C, H, d)."""
    by_kv_head = grouped(query, keys.shape[2])
    own_keys, own_values, own_bias = keys.transpose(1, 2), values.transpose(1, 2), canvases.bias
    if own is not None:
        own_keys = torch.cat([own[0], own_keys], dim=2)
        own_values = torch.cat([own[1], own_values], dim=2)
        own_bias = torch.cat([own[2], canvases.bias], dim=1)
    own_part = attend(by_kv_head, own_keys, own_values, own_bias[:, None, None, :].to(query.dtype))
    merged = merge([own_part, _shared_attention(index, by_kv_head, canvases.shared, row_bias=shared_bias)])
    return ungrouped(merged, query.shape[1])


def _joint_canvas_attention(
    index: int,
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    canvases: Canvases,
    states: torch.Tensor,
    runs: tuple[torch.Tensor, torch.Tensor],
    own_runs: tuple[torch.Tensor, torch.Tensor],
    shared_bias: torch.Tensor | None,
) -> torch.Tensor:
    """``_decoder_attention`` for canvases grouped by state (``JointMasks.states``), in three parts
    merged: each state's canvases against its visible new tokens (``runs``: where they start in the
    flat new tokens and how many), each canvas against its own columns (``own_runs``, from
    ``_canvas_runs``), both read in place by flash attention (no per-canvas copy of its state's
    keys, no bias), and the shared part. ``keys``/``values``: the new tokens' (B, N, kvh, d) and the
    canvases' (B_c, C, kvh, d); returns (B_c, C, H, d)."""
    rows, columns, heads, dim = query.shape
    flat = query.reshape(rows * columns, heads, dim)
    starts, counts = runs
    new_part = attend_runs(
        flat,
        keys[0].flatten(0, 1),
        values[0].flatten(0, 1),
        states * columns,
        starts,
        counts,
        flat.shape[0],
        keys[0].shape[1],
    )
    canvas_starts, lengths = own_runs
    canvas_part = attend_runs(
        flat, keys[1].flatten(0, 1), values[1].flatten(0, 1), canvas_starts, canvas_starts, lengths, columns, columns
    )
    out, lse = _shared_attention(index, grouped(query, keys[1].shape[2]), canvases.shared, row_bias=shared_bias)
    parts = [
        (part.view(rows, columns, heads, dim), part_lse.view(rows, columns, heads))
        for part, part_lse in (new_part, canvas_part)
    ]
    return merge([*parts, (ungrouped(out, columns), ungrouped(lse, columns))])


def _visible_runs(own: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each state's visible new tokens start in the flat (B * N) new tokens, (B + 1,) int32
    (the last entry unread), and how many there are, (B,): the run of zeros in the ``own`` bias
    (B_c, N) row of its first canvas (a state without canvases, padding, reads none of them)."""
    visible = own == 0
    first = visible.int().argmax(dim=-1).int()  # (B_c,)
    count = visible.sum(dim=-1, dtype=torch.int32)
    rows, length = states.shape[0] - 1, own.shape[1]
    canvas = states[:-1].clamp(max=own.shape[0] - 1).long()
    has = states[1:] > states[:-1]
    starts = torch.arange(0, (rows + 1) * length, length, dtype=torch.int32, device=own.device)
    starts[:-1] += torch.where(has, first[canvas], 0)
    return starts, torch.where(has, count[canvas], 0)


def _canvas_runs(canvases: Canvases) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each canvas starts in the flat (B_c * C) canvas tokens, (B_c + 1,) int32, and how many
    of its columns are its own, before its padding, (B_c,)."""
    rows, columns = canvases.tokens.shape
    starts = torch.arange(0, (rows + 1) * columns, columns, dtype=torch.int32, device=canvases.tokens.device)
    return starts, (canvases.bias == 0).sum(-1, dtype=torch.int32)


def _encoder_mask(new: int, window: int | None, device: torch.device) -> torch.Tensor:
    """The (N, N) causal bias among new tokens (query t, key j), within the ``window`` if one is given."""
    steps = torch.arange(new, device=device)
    seen = steps[None, :] <= steps[:, None]
    if window is not None:
        seen &= steps[None, :] > steps[:, None] - window
    return torch.where(seen, 0.0, MASKED)


def _encoder_attention(
    index: int,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layer_types: Sequence[str],
    window: int,
    parents: list[SharedPart],
    blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    """New tokens' queries (B, N, H, d), causally among themselves (within the window on a sliding
    layer) and, where ``blocks`` (B, N) marks images, in both directions among one image's tokens
    (whatever the window), merged with their parents' KV; (B, N, H, d). On a GPU flash attention
    applies the masks of text rows by position (``attend_heads``); elsewhere they are biases
    (``_encoder_mask``)."""
    sliding = layer_types[index] == "sliding_attention"
    new, kv_heads = query.shape[1], keys.shape[2]
    left = window - 1 if sliding else None  # query t sees the new tokens t - left .. t
    if blocks is None and heads_ok(query, keys, True, left):
        own_part = attend_heads(query, keys, values, True, left)
    else:
        mask = _encoder_mask(new, window if sliding else None, query.device)
        if blocks is None:
            bias = mask.repeat(query.shape[2] // kv_heads, 1)[None, None]  # (1, 1, g * N, N)
        else:
            one_image = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)  # (B, N, N)
            bias = torch.where(one_image, 0.0, mask).repeat(1, query.shape[2] // kv_heads, 1)[:, None]
        bias = bias.to(query.dtype)
        out, lse = attend(grouped(query, kv_heads), keys.transpose(1, 2), values.transpose(1, 2), bias)
        own_part = ungrouped(out, new), ungrouped(lse, new)
    if not parents:
        return own_part[0]
    return merge([own_part, _parent_attention(index, query, kv_heads, parents, window if sliding else None)])


def _parent_attention(
    index: int, query: torch.Tensor, kv_heads: int, parents: list[SharedPart], window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """New tokens' queries (B, N, H, d) against their parents' KV, which a ``window`` (a sliding
    layer's) limits: query t sees the held keys up to ``window - 1`` positions before it. Returns the
    output (B, N, H, d) and the LSE (B, N, H)."""
    new = query.shape[1]
    # held key j sits held - j positions before new token 0, so t sees j >= t + held - (window - 1)
    left = None if window is None else window - 1 - new
    first = parents[0].keys[index].transpose(1, 2)  # (1, S, kvh, d)
    if heads_ok(query, first, False, left):
        outs, lses, row = [], [], 0
        for part in parents:  # each row reads its parent's KV in place (a stride-0 batch)
            keys = part.keys[index].transpose(1, 2).expand(part.rows, -1, -1, -1)
            values = part.values[index].transpose(1, 2).expand(part.rows, -1, -1, -1)
            out, lse = attend_heads(query[row : row + part.rows], keys, values, False, left)
            outs.append(out)
            lses.append(lse)
            row += part.rows
        return (outs[0], lses[0]) if len(parents) == 1 else (torch.cat(outs), torch.cat(lses))
    out, lse = _shared_attention(index, grouped(query, kv_heads), parents, window, new)
    return ungrouped(out, new), ungrouped(lse, new)


def _shared_attention(
    index: int,
    by_kv_head: torch.Tensor,
    parts: list[SharedPart],
    window: int | None = None,
    new: int = 0,
    row_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each part's rows' queries (B, kvh, g * L, d) against the part's KV, as one batch-1 attention
    per part; returns the output and the LSE for all rows.

    With ``window`` (an encoder's sliding layer, rows of ``new`` tokens) query t hides the held keys
    more than ``window - 1`` positions before it: held key j sits ``held - j`` positions before new
    token 0, so it is hidden once ``t + held - j >= window``. ``row_bias`` (B, >= S) is each row's
    additive bias over its part's keys.
    """
    kv_heads, queries, dim = by_kv_head.shape[1], by_kv_head.shape[2], by_kv_head.shape[3]
    outs, lses, row = [], [], 0
    for part in parts:
        keys, values = part.keys[index], part.values[index]
        bias = None
        if row_bias is not None:
            held = keys.shape[-2]
            bias = row_bias[row : row + part.rows, :held].repeat_interleave(queries, dim=0)[None, None]
            bias = bias.to(by_kv_head.dtype)
        elif window is not None:
            held = keys.shape[-2]
            token = torch.arange(queries, device=by_kv_head.device) % new  # t of each grouped query
            outside = torch.arange(held, device=by_kv_head.device)[None, :] <= token[:, None] + held - window
            bias = torch.where(outside, MASKED, 0.0).to(by_kv_head.dtype).repeat(part.rows, 1)[None, None]
        # the part's rows' queries as one batch-1 sequence: (1, kvh, rows * g * L, d)
        batched = by_kv_head[row : row + part.rows].transpose(0, 1).reshape(1, kv_heads, -1, dim)
        out, lse = attend(batched, keys, values, bias)
        outs.append(out.reshape(kv_heads, part.rows, -1, dim).transpose(0, 1))
        lses.append(lse.reshape(kv_heads, part.rows, -1).transpose(0, 1))
        row += part.rows
    return (outs[0], lses[0]) if len(parts) == 1 else (torch.cat(outs), torch.cat(lses))


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
    if few and rows.is_cuda and kernels.AVAILABLE and rows.dtype in (torch.bfloat16, torch.float16):
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
    attn = layer.self_attn
    normed = _norm(layer.input_layernorm, hidden)
    tokens = hidden.shape[0]  # T
    eps = float(getattr(attn.q_norm, "eps"))  # noqa: B009 (mypy types module attributes as Tensor | Module)
    query = invariant.project(attn.q_proj, normed).view(1, tokens, -1, attn.head_dim)  # (1, T, H, d)
    query = fused.norm_rotary(query, attn.q_norm.weight, eps, cos[None], sin[None])[0]
    keys = invariant.project(attn.k_proj, normed).view(1, tokens, -1, attn.head_dim)  # (1, T, kvh, d)
    values = invariant.project(attn.v_proj, normed).view(keys.shape) if attn.v_proj is not None else keys
    keys = fused.norm_rotary(keys, attn.k_norm.weight, eps, cos[None], sin[None])[0]  # (T, kvh, d)
    values = _norm(attn.v_norm, values)[0]
    queries, stream_keys, stream_values, start = [], [], [], 0
    for rows, length in streams:
        span = slice(start, start + rows * length)
        queries.append(query[span].view(rows, length, -1, attn.head_dim))  # (B, L, H, d)
        stream_keys.append(keys[span].view(rows, length, -1, attn.head_dim))  # (B, L, kvh, d)
        stream_values.append(values[span].view(rows, length, -1, attn.head_dim))
        start += rows * length
    outputs = attention(index, queries, stream_keys, stream_values)
    flat = [out.reshape(rows * length, -1) for out, (rows, length) in zip(outputs, streams, strict=True)]
    merged = flat[0] if len(flat) == 1 else torch.cat(flat)
    router = layer.router
    hidden, dense_in, experts_in, router_in = fused.attention_residual(
        hidden,
        invariant.project(attn.o_proj, merged),
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
