"""Attention in parts: each part returns its log-sum-exp, so parts over disjoint keys merge exactly.

A canvas attends to its prompt's KV and to itself. When many canvases continue one cached prompt,
attending to that prompt once for all of their queries (one batch-1 call) and to each canvas's own
keys separately, then merging, gives the same result as attending to ``prompt + canvas`` per row,
without copying the prompt's KV into every row (what ``torch.cat`` in the library's decoder does).

Grouped-query attention: ``H`` query heads share ``kvh`` key/value heads in contiguous groups of
``g = H // kvh`` (head ``h`` reads kv head ``h // g``), so a (B, H, L, d) query viewed as
(B, kvh, g * L, d) attends to (B, kvh, S, d) keys as plain multi-head attention, without repeating
the keys (``attend``, with masks as additive biases: cuDNN's or the memory-efficient kernel on a
GPU, matmuls on a CPU).

Where a mask is a position rule, flash attention takes the projections' own layout, grouped heads
native, and skips the blocks the mask hides instead of reading a bias: a causal or sliding window
(``attend_heads``), and runs of queries reading runs of keys in place (``attend_runs``). Both run
in bfloat16 or half on a GPU only (``heads_ok``); the callers fall back to ``attend`` elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch

from slotread.engines.diffusion_gemma import fused, invariant, kernels
from slotread.engines.diffusion_gemma.fast_paths import taken

#: Large negative bias for masked keys: finite, so a row whose keys are all masked in one part gives
#: an LSE near -1e30 and weight 0 in the merge instead of NaN.
MASKED = -1e30


def attend(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with scale 1 (Gemma-4 normalises q and k instead).

    query (B, kvh, Q, d), keys/values (B, kvh, S, d), bias (B, 1, 1, S) or (B, 1, Q, S) float with
    0 for visible keys and ``MASKED`` for hidden ones, or None. Returns the output (B, kvh, Q, d) in
    the query's dtype and the log-sum-exp (B, kvh, Q) in float32. On a GPU a fused kernel computes
    it (cuDNN's where ``FastPaths.cudnn_attention`` and the head size allow, else the memory-efficient one; in a
    batch-invariant forward ``kernels.attend``); on a CPU, these matmuls in float32.
    """
    if keys.shape[-2] == 0:  # nothing to attend to: weight 0 in the merge
        return query.new_zeros((*query.shape[:-1], values.shape[-1])), query.new_full(
            query.shape[:-1], MASKED, dtype=torch.float32
        )
    if invariant.active(query):
        return kernels.attend(query, keys, values, bias)
    if query.is_cuda and _fused_ok(query.shape[-1]):
        fused_bias = None if bias is None else _aligned(bias, query.dtype).expand(*query.shape[:3], -1)
        if taken().cudnn_attention and query.dtype in (torch.bfloat16, torch.float16) and _cudnn_ok(query.shape[-1]):
            out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
                query, keys, values, fused_bias, True, 0.0, False, False, scale=1.0
            )
            return out, lse.reshape(query.shape[:3])
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, keys, values, fused_bias, True, 0.0, False, scale=1.0
        )
        return out, lse[..., : query.shape[2]]
    scores = torch.matmul(query.float(), keys.float().transpose(-1, -2))  # (B, kvh, Q, S)
    if bias is not None:
        scores = scores + bias.float()
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), values.float())
    return out.to(query.dtype), lse


def attend_heads(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal: bool, left: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention in the projections' own layout, with grouped-query heads native and the mask given
    by positions instead of a bias: query (B, L, H, d), keys/values (B, S, kvh, d), any batch strides
    (an ``expand``-ed prompt KV shared by every row is read in place). Query i sits at S - L + i among
    the keys: it sees key j when ``j >= S - L + i - left`` (``left`` None: no bound) and, if
    ``causal``, ``j <= S - L + i``. Returns the output (B, L, H, d) and the LSE (B, L, H) in float32.

    Runs where ``heads_ok`` says so: flash attention, or at head sizes over 256 (causal, no window,
    L == S) the memory-efficient kernel's own causal mask over keys repeated per head. Neither reads a
    bias or computes the blocks that the mask hides (bench/kernels.py: the encoder's causal sliding
    window at 8 x 1,600 tokens 1.7 -> 0.5 ms per layer).
    """
    if query.shape[-1] <= FLASH_MAX_HEAD_DIM:
        out, lse = _flash(
            query, keys, values, (None, None, query.shape[1], keys.shape[1]), causal, window_size_left=left
        )
        return out, lse.transpose(1, 2)
    groups = query.shape[2] // keys.shape[2]
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        query.transpose(1, 2),
        keys.repeat_interleave(groups, dim=2).transpose(1, 2),
        values.repeat_interleave(groups, dim=2).transpose(1, 2),
        None,
        True,
        0.0,
        True,
        scale=1.0,
    )
    return out.transpose(1, 2), lse[..., : query.shape[1]].transpose(1, 2)


def attend_runs(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_starts: torch.Tensor,
    key_starts: torch.Tensor,
    key_counts: torch.Tensor,
    max_queries: int,
    max_keys: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention over runs: queries (Tq, H, d) ``query_starts[r]`` to ``query_starts[r + 1]``
    see keys (Tk, kvh, d) ``key_starts[r]`` to ``key_starts[r] + key_counts[r]`` (int32 (R + 1,),
    (R + 1,), (R,); ``max_*`` bound a run's length), without a mask. Where ``heads_ok`` allows.
    Returns the output (Tq, H, d) and the LSE (Tq, H) in float32.

    Many canvases reading the new tokens of their own state read them in place this way, with no
    gather of each canvas's keys and no bias for the padding or the window."""
    runs = (query_starts, key_starts, max_queries, max_keys)
    out, lse = _flash(query, keys, values, runs, False, seqused_k=key_counts)
    return out, lse.transpose(0, 1)


def _flash(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    runs: tuple[torch.Tensor | None, torch.Tensor | None, int, int],
    causal: bool,
    **options: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention's forward at scale 1, without dropout: the output and the LSE. ``runs``: where the
    query and key runs start (None: one run per batch row) and their longest lengths; ``options``: the
    window or the keys each run uses."""
    query_starts, key_starts, max_queries, max_keys = runs
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        query, keys, values, query_starts, key_starts, max_queries, max_keys, 0.0, causal, False, scale=1.0, **options
    )
    return out, lse


def heads_ok(query: torch.Tensor, keys: torch.Tensor, causal: bool, left: int | None) -> bool:
    """Whether ``attend_heads`` runs these inputs here (and ``attend_runs``, asked with ``causal``
    False and ``left`` None): bfloat16 or half on a GPU with ``FastPaths.flash_attention``;
    flash up to head size 256 where ``window_fits``; above that, causal without a window over as
    many keys as queries. Never in a batch-invariant forward (flash splits the keys by batch size)."""
    if invariant.active(query):
        return False
    if not (taken().flash_attention and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)):
        return False
    if query.shape[-1] <= FLASH_MAX_HEAD_DIM:
        return window_fits(query.shape[1], keys.shape[1], causal, left) and _flash_ok(query.shape[-1])
    return causal and left is None and query.shape[1] == keys.shape[1] and _fused_ok(query.shape[-1])


def window_fits(queries: int, keys: int, causal: bool, left: int | None) -> bool:
    """Whether flash attention's window means ``attend_heads``'s rule for ``queries`` against ``keys``: a
    ``left`` of 0 or more, and, without ``causal``, no more queries than keys or a window that reaches
    every key (flash then drops it, as the rule would see every key anyway). Flash bounds a windowed
    query on the right too, at ``keys`` past its diagonal (a right bound of -1 becomes the key count),
    so with more queries than keys the first queries see no key at all and flash returns an infinite
    LSE, which the merge turns into NaN: seen on an H200 for a 937-token segment after a 163-token
    parent (a 77-option question after short instructions)."""
    return left is None or left >= keys or (left >= 0 and (causal or queries <= keys))


def grouped(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, L, H, d) queries as ``attend``'s (B, kvh, g * L, d) (a copy)."""
    return query.transpose(1, 2).reshape(query.shape[0], kv_heads, -1, query.shape[-1])


def ungrouped(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """``attend``'s output (B, kvh, g * L, d) or LSE (B, kvh, g * L) as (B, L, H, d) or (B, L, H): a
    view of a contiguous input (head h is kv head h // g's query group h % g)."""
    rows, kv_heads, queries, *rest = tensor.shape
    split = tensor.reshape(rows, kv_heads, queries // length, length, *rest)
    return split.movedim(3, 1).reshape(rows, length, -1, *rest)


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The attention over the union of the parts' keys, from each part's (output, lse)."""
    if len(parts) == 1:
        return parts[0][0]
    (first, first_lse), *rest = parts
    for second, second_lse in rest:
        merged = fused.merge_two(first, first_lse, second, second_lse)
        first, first_lse = merged, torch.logaddexp(first_lse, second_lse)
    return first


#: cuDNN's fused attention (``FastPaths.cudnn_attention``) for bfloat16 and half up to this head size,
#: where it beats the memory-efficient kernel on an H200 (bench/kernels.py: 3.5x without a bias, 1.5x
#: with one; slower at the full layers' 512). Results agree within bfloat16 rounding.
CUDNN_MAX_HEAD_DIM = 256

#: Flash attention (``attend_heads``, ``FastPaths.flash_attention``) for the encoder's causal and
#: windowed parts, bfloat16 or half, up to this head size. Off: the encoder's attention goes through
#: ``attend`` with its masks as biases (the reference that tests/gpu compares flash with).
FLASH_MAX_HEAD_DIM = 256


@cache
def _fused_ok(head_dim: int) -> bool:
    """Whether the fused memory-efficient kernel runs this head size here (probed once per size)."""
    probe = torch.randn(1, 1, 8, head_dim, device="cuda", dtype=torch.bfloat16)
    return _runs(
        lambda: torch.ops.aten._scaled_dot_product_efficient_attention(probe, probe, probe, None, True, 0.0, False)
    )


@cache
def _flash_ok(head_dim: int) -> bool:
    """Whether flash attention runs this head size here, with grouped heads and a window (probed once
    per size)."""
    query = torch.randn(1, 8, 2, head_dim, device="cuda", dtype=torch.bfloat16)
    return _runs(lambda: attend_heads(query, query[:, :, :1], query[:, :, :1], True, 4))


@cache
def _cudnn_ok(head_dim: int) -> bool:
    """Whether cuDNN's fused attention runs this head size here (probed once per size, with a bias)."""
    if head_dim > CUDNN_MAX_HEAD_DIM:
        return False
    probe = torch.randn(1, 1, 8, head_dim, device="cuda", dtype=torch.bfloat16)
    bias = _aligned(torch.zeros(1, 1, 1, 8, device="cuda"), torch.bfloat16).expand(1, 1, 8, -1)
    return _runs(
        lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(probe, probe, probe, bias, True, 0.0, False, False)
    )


def _runs(kernel: Callable[[], object]) -> bool:
    """Whether ``kernel`` runs here: a fused kernel refuses inputs it does not support by raising."""
    try:
        kernel()
    except RuntimeError:
        return False
    return True


def _aligned(bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``bias`` in ``dtype`` with its last dimension's storage padded to a multiple of 16 elements,
    as the fused kernel requires (the view keeps the original length)."""
    length = bias.shape[-1]
    padded = bias.new_zeros((*bias.shape[:-1], -(-length // 16) * 16), dtype=dtype)
    padded[..., :length] = bias
    return padded[..., :length]
