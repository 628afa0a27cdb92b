"""Triton kernels for the memory-bound steps of the GPU forward where torch's kernels fell short.

Profiles on an H200 (bench/RESULTS.md, bench/kernels.py) found:

* two gathers running at 5-10x their memory time as ``torch.compile`` kernels: the expert combine
  (each token's weighted sum of its top-k expert rows) and the attention merge (two parts' outputs
  weighted by their log-sum-exps, one part a strided view). Here each is one pass, a program per
  output row (block), reading each input once: 3.4x (merge) and 6.8x (combine) at 4,096 tokens;
* torch's grouped GEMM reading the expert weights at 2.1-2.9 TB/s when each expert has a few rows (a
  single canvas: 64 tokens x 8 copies over 128 experts). ``grouped`` streams each expert's weights
  once per block of 16 rows: 1.1-1.4x faster up to ~16 rows per expert, slower beyond.

Each kernel computes a row from that row's inputs only, in a fixed order: results do not depend on
the batch around a row, and there are no atomics. The batch-invariant forward (``invariant.py``)
adds three made for that alone, with tiles fixed whatever the shape: ``linear`` (the projections),
``tiled_grouped`` (the experts, each expert's rows in parallel tiles) and ``attend`` (attention with
its log-sum-exp, keys in fixed blocks from the first; ``attend_parts``, the same kernel over rows that
each read their own prompt's KV where it lies). On an H200 the deterministic engine reads a batch of
64 canvases at 0.69x and 32 decisions at 0.66x the batched engine's rate (bench/RESULTS.md).

Triton is optional: without it (CPU-only installs) ``AVAILABLE`` is False and the callers run the
same maths in torch. With ``TRITON_INTERPRET=1`` the kernels run on CPU tensors, which is how the
CPU tests check them against that maths.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

AVAILABLE = triton is not None

if triton is not None:

    @triton.jit
    def _combine_kernel(out, rows, weights, inverse, width, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = columns < width
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            row = tl.load(inverse + token * TOP_K + j).to(tl.int64)
            weight = tl.load(weights + token * TOP_K + j).to(tl.float32)
            total += tl.load(rows + row * width + columns, mask=inside, other=0.0).to(tl.float32) * weight
        tl.store(out + token * width + columns, total.to(out.dtype.element_ty), mask=inside)

    @triton.jit
    def _merge_kernel(
        out,
        first,
        first_lse,
        second,
        second_lse,
        heads,
        queries,
        dim,
        f0,
        f1,
        f2,
        fl0,
        fl1,
        fl2,
        s0,
        s1,
        s2,
        sl0,
        sl1,
        sl2,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # over (B, kvh, Q)
        q = row % queries
        h = (row // queries) % heads
        b = row // (queries * heads)
        a_lse = tl.load(first_lse + b * fl0 + h * fl1 + q * fl2)
        b_lse = tl.load(second_lse + b * sl0 + h * sl1 + q * sl2)
        peak = tl.maximum(a_lse, b_lse)
        a_weight = tl.exp(a_lse - peak)
        b_weight = tl.exp(b_lse - peak)
        total = a_weight + b_weight
        columns = tl.arange(0, BLOCK)
        inside = columns < dim
        a = tl.load(first + b * f0 + h * f1 + q * f2 + columns, mask=inside, other=0.0).to(tl.float32)
        c = tl.load(second + b * s0 + h * s1 + q * s2 + columns, mask=inside, other=0.0).to(tl.float32)
        merged = a * (a_weight / total) + c * (b_weight / total)
        tl.store(out + row * dim + columns, merged.to(out.dtype.element_ty), mask=inside)

    @triton.jit
    def _block_product(
        out,
        rows,
        matrix,
        m,
        end,
        columns,
        n_out,
        n_in,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """out[m, columns] = rows[m] @ matrix[columns].T for the rows ``m`` below ``end``: float32 sums over
        the inputs in BLOCK_K steps from the first, the same for every row wherever it sits."""
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, n_in, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                rows + m[:, None].to(tl.int64) * n_in + k[None, :],
                mask=(m[:, None] < end) & (k[None, :] < n_in),
                other=0.0,
            )
            w = tl.load(
                matrix + columns[None, :].to(tl.int64) * n_in + k[:, None],
                mask=(columns[None, :] < n_out) & (k[:, None] < n_in),
                other=0.0,
            )
            total = tl.dot(x, w, total)
        tl.store(
            out + m[:, None].to(tl.int64) * n_out + columns[None, :],
            total.to(out.dtype.element_ty),
            mask=(m[:, None] < end) & (columns[None, :] < n_out),
        )

    @triton.jit
    def _grouped_kernel(
        out,
        rows,
        weight,
        offsets,
        n_out,
        n_in,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        expert = tl.program_id(0)
        start = tl.load(offsets + expert - 1, mask=expert > 0, other=0)
        end = tl.load(offsets + expert)
        columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        matrix = weight + expert.to(tl.int64) * n_out * n_in
        for first in range(start, end, BLOCK_M):
            m = first + tl.arange(0, BLOCK_M)
            _block_product(out, rows, matrix, m, end, columns, n_out, n_in, BLOCK_M, BLOCK_N, BLOCK_K)

    @triton.jit
    def _tiled_grouped_kernel(
        out,
        rows,
        weight,
        offsets,
        tile_experts,
        tile_starts,
        experts,
        n_out,
        n_in,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        tile = tl.program_id(0)
        expert = tl.load(tile_experts + tile)
        if expert < experts:
            end = tl.load(offsets + expert)
            m = tl.load(tile_starts + tile) + tl.arange(0, BLOCK_M)
            columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            matrix = weight + expert.to(tl.int64) * n_out * n_in
            _block_product(out, rows, matrix, m, end, columns, n_out, n_in, BLOCK_M, BLOCK_N, BLOCK_K)

    @triton.jit
    def _linear_kernel(
        out,
        rows,
        weight,
        m_rows,
        n_out,
        n_in,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        _block_product(out, rows, weight, m, m_rows, columns, n_out, n_in, BLOCK_M, BLOCK_N, BLOCK_K)

    @triton.jit
    def _attention_kernel(
        out,
        lse,
        query,
        keys,
        values,
        bias,
        parts,
        queries,
        length,
        heads,
        dim,
        q0,
        q1,
        q2,
        k0,
        k1,
        k2,
        v0,
        v1,
        v2,
        b0,
        b1,
        b2,
        HAS_BIAS: tl.constexpr,
        PAGED: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        row = tl.program_id(1).to(tl.int64)  # over (B, kvh)
        b = row // heads
        h = row % heads
        if PAGED:  # row b's keys and values where ``attend_parts``' table says
            entry = parts + b * 7
            k_at, k1, k2 = tl.load(entry), tl.load(entry + 1), tl.load(entry + 2)
            v_at, v1, v2 = tl.load(entry + 3), tl.load(entry + 4), tl.load(entry + 5)
            length = tl.load(entry + 6)
        else:
            k_at, v_at = b * k0, b * v0
        q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        d = tl.arange(0, BLOCK_D)
        inside = q < queries
        x = tl.load(
            query + b * q0 + h * q1 + q[:, None] * q2 + d[None, :],
            mask=inside[:, None] & (d[None, :] < dim),
            other=0.0,
        )
        peak = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_Q], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
        for s0 in range(0, length, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            seen = s < length
            kv_mask = seen[:, None] & (d[None, :] < dim)
            k = tl.load(keys + k_at + h * k1 + s[:, None] * k2 + d[None, :], mask=kv_mask, other=0.0)
            scores = tl.dot(x, tl.trans(k))
            if HAS_BIAS:
                scores += tl.load(
                    bias + b * b0 + q[:, None] * b1 + s[None, :] * b2,
                    mask=inside[:, None] & seen[None, :],
                    other=0.0,
                ).to(tl.float32)
            # keys past the end score as masked ones do (``attention.MASKED``): a padded batch and a
            # read alone then add the same zeros
            scores = tl.where(seen[None, :], scores, -1e30)
            top = tl.maximum(peak, tl.max(scores, 1))
            weights = tl.exp(scores - top[:, None])
            rescale = tl.exp(peak - top)
            total = total * rescale + tl.sum(weights, 1)
            v = tl.load(values + v_at + h * v1 + s[:, None] * v2 + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v)
            peak = top
        place = (b * heads + h) * queries + q
        tl.store(
            out + place[:, None] * dim + d[None, :],
            (acc / total[:, None]).to(out.dtype.element_ty),
            mask=inside[:, None] & (d[None, :] < dim),
        )
        tl.store(lse + place, peak + tl.log(total), mask=inside)


#: Hidden columns per combine program: 256 divides the 26B-A4B's 2,816 (11 programs per token).
_COMBINE_BLOCK = 256


def combine(rows: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    """(T, h) in ``rows``' dtype: token t's sum over j < top_k of ``rows[inverse[t * top_k + j]]`` times
    ``weights[t * top_k + j]``, accumulated in float32 in order j = 0, 1, ...; ``rows`` (S, h)."""
    assert triton is not None
    rows, weights, inverse = rows.contiguous(), weights.contiguous(), inverse.contiguous()
    tokens, width = inverse.numel() // top_k, rows.shape[-1]
    out = rows.new_empty((tokens, width))
    if tokens:
        grid = (tokens, triton.cdiv(width, _COMBINE_BLOCK))
        _combine_kernel[grid](out, rows, weights, inverse, width, TOP_K=top_k, BLOCK=_COMBINE_BLOCK, num_warps=2)
    return out


def merge_two(
    first: torch.Tensor, first_lse: torch.Tensor, second: torch.Tensor, second_lse: torch.Tensor
) -> torch.Tensor:
    """``fused.merge_two`` as one pass over strided inputs: outputs (B, kvh, Q, d) with unit stride in
    ``d`` and LSEs (B, kvh, Q); returns a contiguous (B, kvh, Q, d) in ``first``'s dtype."""
    assert triton is not None
    first, second = (t if t.stride(-1) == 1 else t.contiguous() for t in (first, second))
    batch, heads, queries, dim = first.shape
    out = first.new_empty(first.shape)
    if out.numel():
        strides = (*first.stride()[:3], *first_lse.stride(), *second.stride()[:3], *second_lse.stride())
        grid, block = (batch * heads * queries,), triton.next_power_of_2(dim)
        _merge_kernel[grid](
            out, first, first_lse, second, second_lse, heads, queries, dim, *strides, BLOCK=block, num_warps=2
        )
    return out


#: Up to this many rows per expert on average, ``grouped`` beats torch's grouped GEMM (bench/kernels.py)
GROUPED_MAX_ROWS = 16

#: (BLOCK_N, BLOCK_K, num_stages, num_warps) of the grouped GEMM by its input width: the best tile
#: shapes bench/kernels.py --configs found at 64 tokens (rows come in blocks of 16, ``tl.dot``'s least)
WIDE_CONFIG = (32, 256, 4, 4)  # the gate/up projection, 2,816 wide
NARROW_CONFIG = (64, 128, 4, 4)  # the down projection, 704 wide


def grouped(
    rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, config: tuple[int, int, int, int] | None = None
) -> torch.Tensor:
    """``rows`` (S, in) @ ``weight[e]``.T for each expert e's run of rows (``offsets`` (E,): the
    cumulative row counts), ``weight`` (E, out, in): the grouped GEMM of a few rows per expert, where
    it is a pass over the weights (a program per expert and block of output columns). ``config``:
    the tile shape (default by the input width)."""
    assert triton is not None
    experts, n_out, n_in = weight.shape
    out = rows.new_empty((rows.shape[0], n_out))
    block_n, block_k, stages, warps = config or (WIDE_CONFIG if n_in >= 2048 else NARROW_CONFIG)
    grid = (experts, triton.cdiv(n_out, block_n))
    tiles = {"BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_stages": stages, "num_warps": warps}
    _grouped_kernel[grid](out, rows.contiguous(), weight.contiguous(), offsets, n_out, n_in, **tiles)
    return out


#: The fixed tiles of ``linear``: every row's outputs sum its inputs in 64-wide steps in one order,
#: whatever the number of rows (no split of the reduction, no tile choice by shape)
LINEAR_CONFIG = (64, 128, 64, 3, 4)  # BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps


def linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``rows`` (M, in) @ ``weight`` (out, in).T in ``rows``' dtype, accumulated in float32, each row's
    result independent of the others and of M (cuBLAS picks its kernel, and with it the reduction
    order, by shape: a row read alone and in a batch of 64 differ)."""
    assert triton is not None
    rows, weight = rows.contiguous(), weight.contiguous()
    (m_rows, n_in), n_out = rows.shape, weight.shape[0]
    out = rows.new_empty((m_rows, n_out))
    block_m, block_n, block_k, stages, warps = LINEAR_CONFIG
    if m_rows:
        grid = (triton.cdiv(m_rows, block_m), triton.cdiv(n_out, block_n))
        tiles = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_stages": stages, "num_warps": warps}
        _linear_kernel[grid](out, rows, weight, m_rows, n_out, n_in, **tiles)
    return out


def attend(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention.attend`` (scale 1; query (B, kvh, Q, d), keys/values (B, kvh, S, d), any batch
    and position strides; bias broadcastable to (B, 1, Q, S)) with a fixed order: a program per
    query block and head runs over the keys in fixed blocks from the first, so a query's output and
    LSE depend only on its own keys and bias, whatever the batch, the other queries or padding keys
    after its own (flash attention splits the keys by the batch's size; the fused kernels pick their
    tiles by shape). Returns the output (B, kvh, Q, d) in the query's dtype and the LSE (B, kvh, Q)."""
    assert triton is not None
    keys, values = _unit_stride(keys), _unit_stride(values)
    strides = (keys.shape[2], *keys.stride()[:3], *values.stride()[:3])
    return _attend(query, keys, values, bias, strides, None)


def attend_parts(
    query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], rows: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attend`` for rows that read different keys and values, in one launch: query (B, kvh, Q, d);
    part p's keys and values (1, kvh, S_p, d), each of its own length and strides, are read where
    they lie by the next ``rows[p]`` rows (a table of offsets, strides and lengths). The same kernel
    as ``attend``, so a query's output is bit-identical whichever of the two ran it: a decoder step
    whose reads each attend to their own prompt (the deterministic mode) takes one launch a layer
    instead of one per prompt. Never inside a CUDA graph capture: the table is copied from the host."""
    assert triton is not None and not (query.is_cuda and torch.cuda.is_current_stream_capturing())
    keys, values = [_unit_stride(t) for t in keys], [_unit_stride(t) for t in values]
    size = keys[0].element_size()
    entries = [
        (
            (k.data_ptr() - keys[0].data_ptr()) // size,
            k.stride(1),
            k.stride(2),
            (v.data_ptr() - values[0].data_ptr()) // size,
            v.stride(1),
            v.stride(2),
            k.shape[2],
        )
        for k, v, count in zip(keys, values, rows, strict=True)
        for _ in range(count)
    ]
    table = torch.tensor(entries, dtype=torch.int64)
    table = (table.pin_memory() if query.is_cuda else table).to(query.device, non_blocking=True)
    return _attend(query, keys[0], values[0], None, (0,) * 7, table)


def _unit_stride(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor | None,
    strides: tuple[int, ...],
    table: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch ``_attention_kernel``: row b's keys and values at b times the batch strides of ``strides``
    (length, then the keys' and the values' batch, head and position strides), or where row b of
    ``table`` says (``attend_parts``)."""
    query = _unit_stride(query)
    batch, heads, queries, dim = query.shape
    out = query.new_empty((batch, heads, queries, dim))
    lse = torch.empty((batch, heads, queries), device=query.device, dtype=torch.float32)
    if not out.numel():
        return out, lse
    if bias is None:
        bias_strides, has_bias, bias = (0, 0, 0), False, query
    else:
        bias = bias.expand(batch, 1, queries, keys.shape[2])
        bias_strides, has_bias = (bias.stride(0), bias.stride(2), bias.stride(3)), True
    wide = dim > 256  # the full layers' 512: smaller tiles keep the float32 accumulator in registers
    block_q, block_s = (16, 32) if wide else (32, 64)
    grid = (triton.cdiv(queries, block_q), batch * heads)
    blocks = {"BLOCK_Q": block_q, "BLOCK_S": block_s, "BLOCK_D": max(16, triton.next_power_of_2(dim))}
    length, *kv_strides = strides
    tensors = (out, lse, query, keys, values, bias, query if table is None else table)
    _attention_kernel[grid](
        *tensors,
        queries,
        length,
        heads,
        dim,
        *query.stride()[:3],
        *kv_strides,
        *bias_strides,
        HAS_BIAS=has_bias,
        PAGED=table is not None,
        **blocks,
        num_warps=4,
    )
    return out, lse


#: (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps) of ``tiled_grouped``: fixed, whatever the rows
TILED_CONFIG = (64, 128, 64, 3, 4)


def expert_tiles(offsets: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tiled_grouped``'s tile map for ``rows`` rows over the experts' cumulative counts ``offsets``: per
    tile slot its expert (the expert count: unused) and its first row, laid out on the device (no sync: a
    CUDA graph can hold it) in a grid sized for the worst case, ``rows / BLOCK_M + experts``. The two
    grouped GEMMs of a layer share one map."""
    assert triton is not None
    block_m, experts = TILED_CONFIG[0], offsets.shape[0]
    offsets = offsets.to(torch.int32)
    starts = torch.cat([offsets.new_zeros(1), offsets[:-1]])
    tiles = (offsets - starts + block_m - 1) // block_m  # per expert
    tile_ends = torch.cumsum(tiles, 0, dtype=torch.int32)
    tile = torch.arange(triton.cdiv(rows, block_m) + experts, device=offsets.device, dtype=torch.int32)
    tile_experts = torch.searchsorted(tile_ends, tile, right=True).to(torch.int32)
    owner = tile_experts.clamp(max=experts - 1).long()
    tile_starts = (starts[owner] + (tile - (tile_ends[owner] - tiles[owner])) * block_m).to(torch.int32)
    return tile_experts, tile_starts


def tiled_grouped(
    rows: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``grouped`` with every expert's rows cut into tiles of a fixed size, a program per tile and block
    of output columns: the rows of an expert run in parallel (``grouped`` walks them in one program,
    which many rows per expert make slow), and each row's sums still run in one order whatever the
    batch (the batch-invariant forward's experts). ``tiles``: ``expert_tiles(offsets, len(rows))``,
    built here when not given."""
    assert triton is not None
    experts, n_out, n_in = weight.shape
    block_m, block_n, block_k, stages, warps = TILED_CONFIG
    out = rows.new_empty((rows.shape[0], n_out))
    if not rows.shape[0]:
        return out
    tile_experts, tile_starts = tiles if tiles is not None else expert_tiles(offsets, rows.shape[0])
    grid = (tile_experts.shape[0], triton.cdiv(n_out, block_n))
    _tiled_grouped_kernel[grid](
        out,
        rows.contiguous(),
        weight.contiguous(),
        offsets.to(torch.int32),
        tile_experts,
        tile_starts,
        experts,
        n_out,
        n_in,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_stages=stages,
        num_warps=warps,
    )
    return out
