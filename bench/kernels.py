"""The Triton kernels of ``slotread/engines/diffusion_gemma/kernels.py`` against the torch ops they replace, on one GPU.

    PYTHONPATH=. python bench/kernels.py [--configs]

Shapes of the 26B-A4B forward (hidden 2,816, 128 experts top-8 of 704, 8 kv heads of 256) at the
token counts of bench/gpu_reads.py's scenarios: 64 (a single 64-token canvas), 192 (a decision's
joint forward, padded), 4,096 and 8,192 (64 and 128 canvases). Prints, per kernel and size, the
median time of each path, its achieved memory bandwidth (bytes it must move / time) and the largest
difference between the two. ``--configs`` also times the grouped GEMM's candidate tile shapes.

Then attention as ``engines/diffusion_gemma/attention.py`` calls it (the memory-efficient kernel, with the engine's
additive bias) against cuDNN's fused attention with the same bias and, where no bias is needed,
the flash kernel: the parts of (a)-(d) that dominate their attention time.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from slotread.engines.diffusion_gemma import fused, kernels

HIDDEN, EXPERTS, TOP_K, MOE = 2816, 128, 8, 704
KV_HEADS, HEAD_DIM, GROUPS = 8, 256, 2


def timed(fn: Callable[..., object], *args: object, iterations: int = 30) -> float:
    """Median seconds of ``fn(*args)`` by CUDA events."""
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def routed(tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random top-k routing: the expert-order ``inverse`` of each copy, the per-expert ``offsets``
    and the copies' token index in expert order, as ``layer._experts`` builds them."""
    index = torch.rand(tokens, EXPERTS, generator=generator).topk(TOP_K, dim=-1).indices.cuda()
    flat = index.reshape(-1)
    order = torch.argsort(flat)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    offsets = torch.cumsum(torch.bincount(flat, minlength=EXPERTS), 0, dtype=torch.int32)
    return inverse, offsets, order // TOP_K


def row(name: str, size: int, moved: float, old: float, new: float, delta: float) -> None:
    print(
        f"{name} | {size} | {old * 1e6:.0f} | {moved / old / 1e9:.0f} | {new * 1e6:.0f} | {moved / new / 1e9:.0f}"
        f" | {old / new:.1f}x | {delta:.2g}",
        flush=True,
    )


def compared(
    name: str,
    tokens: int,
    moved: float,
    old: Callable[..., torch.Tensor],
    new: Callable[..., torch.Tensor],
    *args: object,
) -> None:
    """One row: ``old(*args)`` against ``new(*args)``, timed, and their largest difference."""
    delta = float((old(*args).float() - new(*args).float()).abs().max())
    row(name, tokens, moved, timed(old, *args), timed(new, *args), delta)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", action="store_true", help="also time the grouped GEMM's tile shapes")
    args = parser.parse_args()
    assert kernels.AVAILABLE, "needs Triton"
    generator = torch.Generator().manual_seed(0)
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("kernel | tokens | torch µs | torch GB/s | triton µs | triton GB/s | speed-up | max |Δ|")
    combine_torch = torch.compile(fused.combine_torch, dynamic=True)
    merge_torch = torch.compile(fused.merge_two_torch, dynamic=True)
    for tokens in (64, 192, 4096, 8192):
        inverse, _, _ = routed(tokens, generator)
        rows = torch.randn(tokens * TOP_K, HIDDEN, **bf16)
        weights = torch.rand(tokens * TOP_K, device="cuda")
        moved = rows.numel() * 2 + tokens * HIDDEN * 2 + weights.numel() * 12
        compared("combine", tokens, moved, combine_torch, kernels.combine, rows, weights, inverse, TOP_K)
    for tokens in (64, 192, 4096, 8192):
        canvases = max(1, tokens // 64)
        queries = GROUPS * (tokens // canvases)
        own = torch.randn(canvases, KV_HEADS, queries, HEAD_DIM, **bf16)
        own_lse = torch.randn(canvases, KV_HEADS, queries + 32, device="cuda")[..., :queries]
        # the shared part's output: one batch-1 attention over all rows' queries, viewed per row
        shared = torch.randn(KV_HEADS, canvases, queries, HEAD_DIM, **bf16).transpose(0, 1)
        shared_lse = torch.randn(KV_HEADS, canvases, queries, device="cuda").transpose(0, 1)
        moved = own.numel() * 6 + own_lse.numel() * 8
        compared("merge", tokens, moved, merge_torch, kernels.merge_two, own, own_lse, shared, shared_lse)
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    gate_up = torch.randn(EXPERTS, 2 * MOE, HIDDEN, **bf16) * 0.02
    down = torch.randn(EXPERTS, HIDDEN, MOE, **bf16) * 0.02
    configs: list[tuple[int, int, int, int] | None] = [None]  # None: the kernel's default for the shape
    if args.configs:
        configs += [(n, k, s, w) for n in (32, 64, 128) for k in (64, 128, 256) for s in (3, 4, 5) for w in (4,)]
    for tokens in (64, 192, 512, 1024, 2048, 4096):
        _, offsets, token_of = routed(tokens, generator)
        for name, weight in (("grouped gate_up", gate_up), ("grouped down", down)):
            rows = torch.randn(tokens, weight.shape[-1], **bf16)[token_of]
            old = grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)
            hit = int((torch.diff(offsets, prepend=offsets.new_zeros(1)) > 0).sum())
            moved = hit * weight[0].numel() * 2 + rows.numel() * 2 + old.numel() * 2
            old_time = timed(lambda *a: grouped_mm(*a[:2], offs=a[2]), rows, weight.transpose(-2, -1), offsets)
            best = None
            for config in configs:
                try:
                    new_time = timed(kernels.grouped, rows, weight, offsets, config)
                except Exception as error:  # a tile shape that does not fit this GPU's shared memory
                    print(f"  {config}: {type(error).__name__}")
                    continue
                if args.configs:
                    print(f"  {name} {tokens} {config}: {new_time * 1e6:.0f} µs", flush=True)
                if best is None or new_time < best[0]:
                    best = (new_time, config)
            delta = float((old.float() - kernels.grouped(rows, weight, offsets).float()).abs().max())
            assert best is not None
            label = name if best[1] is None else f"{name} best {best[1]}"
            row(label, tokens, moved, old_time, best[0], delta)
    attention_rows()
    flash_rows()


Bias = torch.Tensor | None


def efficient(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: Bias) -> tuple[torch.Tensor, ...]:
    """What ``attention.attend`` runs: output and LSE (B, kvh, Q)."""
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, keys, values, bias, True, 0.0, False, scale=1.0
    )
    return out, lse[..., : query.shape[2]]


def cudnn(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: Bias) -> tuple[torch.Tensor, ...]:
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        query, keys, values, bias, True, 0.0, False, False, scale=1.0
    )
    return out, lse.reshape(query.shape[:3])


def flash(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._scaled_dot_product_flash_attention(query, keys, values, scale=1.0)[0]


def attention_rows() -> None:
    """Attention parts of the scenarios: the engine's kernel against cuDNN's and flash."""
    from slotread.engines.diffusion_gemma.attention import MASKED, _aligned

    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    columns = "efficient µs | cuDNN µs | flash µs | max |Δ out| cuDNN | max |Δ lse| cuDNN"
    print(f"\nattention part | shape q / k | bias | {columns}")
    window = 1024
    held = window - 1

    def window_bias(rows: int, new: int) -> torch.Tensor:  # query t hides held keys j <= t - 1
        token = torch.arange(GROUPS * new, device="cuda") % new
        hidden = torch.arange(held, device="cuda")[None, :] <= token[:, None] + held - window
        return torch.where(hidden, MASKED, 0.0).repeat(rows, 1)[None, None]

    def causal_bias(new: int) -> torch.Tensor:
        steps = torch.arange(new, device="cuda")
        causal = (steps[None, :] <= steps[:, None]) & (steps[None, :] > steps[:, None] - window)
        return torch.where(causal, 0.0, MASKED).repeat(GROUPS, 1)[None, None]

    cases = [
        ("(b)/(d) new tokens x parent, sliding", (1, KV_HEADS, 32 * GROUPS * 128, 256), held, window_bias(32, 128)),
        ("(c) canvases x prompt, sliding", (1, KV_HEADS, 64 * GROUPS * 64, 256), held, None),
        ("(c) canvases x prompt, full", (1, 2, 64 * 8 * 64, 512), 1600, None),
        ("(a) prompt tokens causal, sliding", (8, KV_HEADS, GROUPS * 1600, 256), 1600, causal_bias(1600)),
        (
            "(b) canvases x own tokens + canvas",
            (64, KV_HEADS, GROUPS * 64, 256),
            164,
            torch.zeros(64, 1, 1, 164, device="cuda"),
        ),
    ]
    for name, shape, keys_len, bias in cases:
        query = torch.randn(*shape, **bf16)
        keys = torch.randn(shape[0], shape[1], keys_len, shape[3], **bf16)
        values = torch.randn_like(keys)
        fused_bias = None if bias is None else _aligned(bias, torch.bfloat16).expand(*query.shape[:3], -1)

        args = (query, keys, values, fused_bias)
        want, want_lse = efficient(*args)
        cells = [f"{timed(efficient, *args) * 1e6:.0f}"]
        try:
            got, got_lse = cudnn(*args)
            deltas = [
                f"{float((got.float() - want.float()).abs().max()):.3g}",
                f"{float((got_lse - want_lse).abs().max()):.3g}",
            ]
            cells.append(f"{timed(cudnn, *args) * 1e6:.0f}")
        except Exception as error:  # a shape or bias this cuDNN does not take
            deltas = ["", ""]
            cells.append(type(error).__name__ + ": " + str(error).split("\n")[0][:80])
        cells.append(f"{timed(flash, *args[:3]) * 1e6:.0f}" if bias is None and shape[3] <= 256 else "")
        print(
            " | ".join([name, f"{tuple(shape)} / {keys_len}", "yes" if bias is not None else "no", *cells, *deltas]),
            flush=True,
        )


def flash_rows() -> None:
    """The encoder's parts through ``attention.attend_heads`` (flash; the memory-efficient kernel's own
    causal mask at head size 512) against ``attention.attend`` with the masks as biases."""
    from slotread.engines.diffusion_gemma.attention import MASKED, attend_heads

    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    window = 1024
    print("\nencoder part | rows x new, keys | biased µs | attend_heads µs | max |Δ out| | max |Δ lse|")

    def masked(new: int, keys: int, causal: bool, left: int | None) -> torch.Tensor:  # (N, S) bias
        query = torch.arange(new, device="cuda")[:, None] + keys - new
        key = torch.arange(keys, device="cuda")[None, :]
        hidden = (key > query) if causal else torch.zeros_like(key > query)
        if left is not None:
            hidden |= key < query - left
        return torch.where(hidden, MASKED, 0.0)

    cases = [  # name, rows, new, heads, kv heads, head size, keys (None: the new tokens'), causal, left
        ("(a) prompt causal, sliding", 8, 1600, 16, 8, 256, None, True, window - 1),
        ("(a) prompt causal, full", 8, 1600, 16, 2, 512, None, True, None),
        ("(b)/(d) new tokens causal, sliding", 32, 104, 16, 8, 256, None, True, window - 1),
        ("(b)/(d) new tokens x parent, sliding", 32, 104, 16, 8, 256, window - 1, False, window - 1 - 104),
    ]
    for name, rows, new, heads, kv_heads, dim, parent, causal, left in cases:
        query = torch.randn(rows, new, heads, dim, **bf16)
        keys = torch.randn(1 if parent else rows, parent or new, kv_heads, dim, **bf16).expand(rows, -1, -1, -1)
        values = torch.randn_like(keys[:1]).expand(rows, -1, -1, -1)
        if not parent:
            values = torch.randn_like(keys)
        bias = masked(new, keys.shape[1], causal, left).repeat(heads // kv_heads, 1).to(torch.bfloat16)

        (want, want_lse), (got, got_lse) = (
            biased(query, keys, values, bias),
            attend_heads(query, keys, values, causal, left),
        )
        cells = [
            f"{timed(biased, query, keys, values, bias) * 1e6:.0f}",
            f"{timed(attend_heads, query, keys, values, causal, left) * 1e6:.0f}",
            f"{float((got.float() - want.float()).abs().max()):.3g}",
            f"{float((got_lse - want_lse).abs().max()):.3g}",
        ]
        print(" | ".join([name, f"{rows} x {new}, {keys.shape[1]}", *cells]), flush=True)


def biased(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention.attend`` over (B, L, H, d) queries and (B, S, kvh, d) keys with a (g * L, S) bias."""
    from slotread.engines.diffusion_gemma.attention import attend, grouped, ungrouped

    out, lse = attend(grouped(query, keys.shape[2]), keys.transpose(1, 2), values.transpose(1, 2), bias[None, None])
    return ungrouped(out, query.shape[1]), ungrouped(lse, query.shape[1])


if __name__ == "__main__":
    main()
