"""Who a layer's queries attend to, as parts merged by their log-sum-exps (``attention.merge``).

* canvases (``decoder_attention``): their own prompt tokens after the shared part and their canvas,
  bidirectionally, and the shared part, read in place by every row of its run;
* canvases of a joint forward grouped by state (``joint_canvas_attention``): their state's visible
  new tokens and their own columns read in place by flash attention, and the shared part;
* new prompt tokens (``encoder_attention``): causally among themselves (within the window on a
  sliding layer, both ways within an image), and their parents' KV (``parent_attention``).

On a GPU the causal and window masks are given to flash attention by position; elsewhere, and in a
batch-invariant forward, they are biases (``encoder_mask``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slotread.engines.diffusion_gemma import invariant, kernels
from slotread.engines.diffusion_gemma.attention import (
    MASKED,
    attend,
    attend_heads,
    attend_runs,
    grouped,
    heads_ok,
    merge,
    ungrouped,
)
from slotread.engines.diffusion_gemma.inputs import Canvases, SharedPart


def decoder_attention(
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
    merged = merge([own_part, shared_attention(index, by_kv_head, canvases.shared, row_bias=shared_bias)])
    return ungrouped(merged, query.shape[1])


def joint_canvas_attention(
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
    """``decoder_attention`` for canvases grouped by state (``JointMasks.states``), in three parts
    merged: each state's canvases against its visible new tokens (``runs``: where they start in the
    flat new tokens and how many), each canvas against its own columns (``own_runs``, from
    ``canvas_runs``), both read in place by flash attention (no per-canvas copy of its state's
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
    out, lse = shared_attention(index, grouped(query, keys[1].shape[2]), canvases.shared, row_bias=shared_bias)
    parts = [
        (part.view(rows, columns, heads, dim), part_lse.view(rows, columns, heads))
        for part, part_lse in (new_part, canvas_part)
    ]
    return merge([*parts, (ungrouped(out, columns), ungrouped(lse, columns))])


def visible_runs(own: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


def canvas_runs(canvases: Canvases) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each canvas starts in the flat (B_c * C) canvas tokens, (B_c + 1,) int32, and how many
    of its columns are its own, before its padding, (B_c,)."""
    rows, columns = canvases.tokens.shape
    starts = torch.arange(0, (rows + 1) * columns, columns, dtype=torch.int32, device=canvases.tokens.device)
    return starts, (canvases.bias == 0).sum(-1, dtype=torch.int32)


def encoder_mask(new: int, window: int | None, device: torch.device) -> torch.Tensor:
    """The (N, N) causal bias among new tokens (query t, key j), within the ``window`` if one is given."""
    steps = torch.arange(new, device=device)
    seen = steps[None, :] <= steps[:, None]
    if window is not None:
        seen &= steps[None, :] > steps[:, None] - window
    return torch.where(seen, 0.0, MASKED)


def encoder_attention(
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
    (``encoder_mask``)."""
    sliding = layer_types[index] == "sliding_attention"
    new, kv_heads = query.shape[1], keys.shape[2]
    left = window - 1 if sliding else None  # query t sees the new tokens t - left .. t
    if blocks is None and heads_ok(query, keys, True, left):
        own_part = attend_heads(query, keys, values, True, left)
    else:
        mask = encoder_mask(new, window if sliding else None, query.device)
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
    return merge([own_part, parent_attention(index, query, kv_heads, parents, window if sliding else None)])


def parent_attention(
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
    out, lse = shared_attention(index, grouped(query, kv_heads), parents, window, new)
    return ungrouped(out, new), ungrouped(lse, new)


def shared_attention(
    index: int,
    by_kv_head: torch.Tensor,
    parts: list[SharedPart],
    window: int | None = None,
    new: int = 0,
    row_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each part's rows' queries (B, kvh, g * L, d) against the part's KV, as one batch-1 attention
    per part (in a batch-invariant forward without ``window`` or ``row_bias``, every part in one
    launch: ``kernels.attend_parts``); returns the output and the LSE for all rows.

    With ``window`` (an encoder's sliding layer, rows of ``new`` tokens) query t hides the held keys
    more than ``window - 1`` positions before it: held key j sits ``held - j`` positions before new
    token 0, so it is hidden once ``t + held - j >= window``. ``row_bias`` (B, >= S) is each row's
    additive bias over its part's keys.
    """
    kv_heads, queries, dim = by_kv_head.shape[1], by_kv_head.shape[2], by_kv_head.shape[3]
    if len(parts) > 1 and window is None and row_bias is None and invariant.active(by_kv_head):
        # each row reads its own part where it lies (the deterministic mode's reads each attend to
        # their whole prompt: a part per prompt, 32 a layer for 32 decisions)
        part_keys, part_values = [part.keys[index] for part in parts], [part.values[index] for part in parts]
        return kernels.attend_parts(by_kv_head, part_keys, part_values, [part.rows for part in parts])
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
