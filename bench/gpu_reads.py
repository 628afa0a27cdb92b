"""DiffusionGemma reads on one GPU: the library's naive read against slotread's engine, side by side.

    PYTHONPATH=. python bench/gpu_reads.py [--layers 30] [--quick]

Builds the real 26B-A4B shape (30 layers, 128 experts top-8, bfloat16, ~50 GB) with random weights on
the GPU (no download) and times, on the same inputs:

* naive: what a transformers user writes: the prompt's encoder cache expanded to the batch, the
  encoder over each read's own tokens, the decoder, then ``lm_head`` and the softcap over every
  canvas position in float32 (the library's own forward for (a));
* slotread: ``DiffusionGemmaEngine.read`` with its prefix cache;
* two forwards ((b) and (d)): the same engine without ``FastPaths.joint_encode``, which encodes each new
  state in a forward of its own before the forward of its canvases;
* deterministic ((c) at batch 1 and 64, (d)): the engine's ``deterministic`` mode, batch-invariant
  kernels (``engines/diffusion_gemma/invariant.py``).

Scenarios: (a) no prefix reuse, 1600-token prompts, 64-token canvases; (b) a shared 1500-token schema
prefix (cached) + 100 own tokens per read; (c) prompt cached, canvas only (K noise draws of one
prompt); (d) 3-question decisions: a 100-token state after a shared, cached 1500-token schema, read
by 3 isolated 16-token canvases (one per question, own seeds), at concurrency 1 and 32 (the server's
batcher hands concurrent decisions' reads to one ``read``).

Reads/s = batch / median batch time; p50/p99 are per batch (every read in a batch waits for it).
The ceiling is the FLOPs a read needs at 40% of the bf16 peak measured here. ``--only d`` times one
scenario alone; in a full run (d) comes last, after the others have filled the prefix cache. The
engine's correctness on the GPU (against the naive path, its fast paths against the reference roads,
the deterministic mode bit for bit) is tested by tests/gpu, not here. ``--profile`` prints instead
where the engine's batches spend GPU and host time (``--deterministic``: the deterministic engine's).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from helpers import SHAPE, VOCAB, Naive, build, ids, percentile, time_batches

from slotread.engines.base import ReadRequest, Slot
from slotread.engines.diffusion_gemma import assemble, read_plan
from slotread.engines.diffusion_gemma.engine import DiffusionGemmaEngine
from slotread.engines.diffusion_gemma.fast_paths import FastPaths
from slotread.engines.prefix_cache import PrefixCache


def flops_per_read(prompt_new: int, context: int, canvas: int) -> float:
    """Forward FLOPs of one read: ``prompt_new`` encoder tokens (after ``context - prompt_new``
    cached ones) and ``canvas`` decoder tokens attending to the ``context``-token prompt."""
    s = SHAPE
    h, layers = s["hidden_size"], s["num_hidden_layers"]
    sliding, full = layers * 5 // 6, layers // 6
    attn_proj = sliding * h * 256 * (16 + 8 + 8 + 16) + full * h * 512 * (16 + 2 + 16)
    dense = layers * 3 * h * s["intermediate_size"]
    experts = layers * s["top_k_experts"] * 3 * h * s["moe_intermediate_size"]
    router = layers * h * s["num_experts"]
    per_token = 2 * (attn_proj + dense + experts + router)

    def attention(queries: int, keys: float) -> float:  # QK^T and PV, all layers
        window = min(keys, s["sliding_window"])
        return 4 * queries * (sliding * 16 * 256 * window + full * 16 * 512 * keys)

    encoder = prompt_new * per_token + attention(prompt_new, context - prompt_new / 2)
    decoder = canvas * per_token + attention(canvas, context + canvas) + 2 * h * VOCAB * 1  # head on the slot
    return encoder + decoder


def peak_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 20 * 2 * 8192**3 / (time.perf_counter() - start) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="fewer batch sizes")
    parser.add_argument("--only", default="abcd", help="the scenarios to time, e.g. 'bd' (default: all)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile (c), (b), (a) and (d) batches: top kernels, GPU idle time by phase; stop",
    )
    parser.add_argument(
        "--deterministic", action="store_true", help="with --profile: profile the deterministic engine's batches"
    )
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    generator = torch.Generator().manual_seed(0)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    tflops = peak_tflops()
    ceiling = 0.4 * tflops * 1e12
    print(f"bf16 matmul 8192^3: {tflops:.0f} TFLOP/s; ceiling = 40% of it", flush=True)

    start = time.perf_counter()
    model = build(args.layers, torch.bfloat16)
    print(
        f"built {args.layers} layers in {time.perf_counter() - start:.0f} s, "
        f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB",
        flush=True,
    )

    # every engine with the rows per forward `slotread serve` gives it on a GPU (settings.GPU_BATCH),
    # so the modes differ by their mode alone
    rows = {"max_canvases": 128, "max_encode_tokens": 128 * 128}
    engine = DiffusionGemmaEngine(model, prefix_cache=PrefixCache(40 * 2**30), **rows)
    naive = Naive(model)
    strict = DiffusionGemmaEngine(model, prefix_cache=engine.prefix_cache, deterministic=True, **rows)
    # new states encoded in a forward of their own, then their canvases: the engine before joint encoding
    apart = DiffusionGemmaEngine(model, prefix_cache=engine.prefix_cache, fast=FastPaths(joint_encode=False), **rows)
    schema = [ids(generator, 1500) for _ in range(3)]
    cached_prompt = (schema[0], ids(generator, 100))

    def canvas_read(prompt: tuple[tuple[int, ...], ...], canvas: int, seed: int) -> ReadRequest:
        label_ids = ids(generator, 8)
        return ReadRequest(
            prompt=prompt, canvas=ids(generator, canvas), slots=(Slot(canvas // 2, label_ids),), seed=seed
        )

    if args.profile:
        if args.deterministic:
            engine = strict
        traced(engine)
        engine.read([canvas_read(cached_prompt, 64, 0)])
        for batch in (1, 64):
            profile(
                lambda b=batch: engine.read([canvas_read(cached_prompt, 64, k) for k in range(b)]), f"(c) B={batch}"
            )
        profile(
            lambda: engine.read([canvas_read((schema[0], ids(generator, 100)), 64, k) for k in range(32)]), "(b) B=32"
        )
        profile(lambda: engine.read([canvas_read((ids(generator, 1600),), 64, k) for k in range(8)]), "(a) B=8")
        for concurrency in (1, 32):
            profile(
                lambda c=concurrency: engine.read(
                    [
                        canvas_read((schema[0], state), 16, q)
                        for state in [ids(generator, 100) for _ in range(c)]
                        for q in range(3)
                    ]
                ),
                f"(d) c={concurrency}",
            )
        return

    rows: list[tuple[str, ...]] = []

    def measure(
        name: str,
        batch: int,
        flops: float,
        make: Callable[[int], list[ReadRequest]],
        cached: int | None,
        per: str = "reads",
        unit: int = 1,
    ) -> None:
        results = {}
        paths: list[tuple[str, Callable[[list[ReadRequest]], object]]] = [
            ("naive", lambda requests: naive.read(requests, cached)),
            ("two forwards", apart.read),
            ("slotread", engine.read),
            ("deterministic", strict.read),
        ]
        for label, read in paths:
            if label == "deterministic" and not (name.startswith("(d)") or batch in (1, 64)):
                continue
            if label == "two forwards" and not name.startswith(("(b)", "(d)")):
                continue
            if label == "naive" and cached is None:
                continue
            # fresh requests per path: a path must not find the states another path cached
            made = {i: make(i) for i in range(-2, args.iterations)}
            torch.cuda.reset_peak_memory_stats()
            times = time_batches(lambda i, made=made, read=read: read(made[i]), args.iterations)
            rate = batch / unit / statistics.median(times)
            results[label] = rate
            fraction = rate * unit * flops / ceiling
            ratio = f"{rate / results['naive']:.1f}x" if "naive" in results and label != "naive" else ""
            rows.append(
                (
                    name,
                    label,
                    str(batch // unit),
                    f"{rate:.1f} {per}/s",
                    f"{percentile(times, 0.5) * 1e3:.1f}",
                    f"{percentile(times, 0.99) * 1e3:.1f}",
                    f"{torch.cuda.max_memory_allocated() / 2**30:.1f}",
                    ratio,
                    f"{fraction:.0%}",
                )
            )
            print(" | ".join(rows[-1]), flush=True)

    # (c) prompt cached, canvas only: K noise draws of one prompt
    engine.read([canvas_read(cached_prompt, 64, 0)])
    for batch in () if "c" not in args.only else (1, 64, 128) if args.quick else (1, 16, 64, 128):
        measure(
            "(c) cached",
            batch,
            flops_per_read(0, 1600, 64),
            lambda i, b=batch: [canvas_read(cached_prompt, 64, 1000 * i + k) for k in range(b)],
            cached=2,
        )
    # (b) shared 1500-token prefix + 100 own tokens
    for batch in () if "b" not in args.only else (8, 32) if args.quick else (8, 32, 64):
        measure(
            "(b) shared prefix",
            batch,
            flops_per_read(100, 1600, 64),
            lambda i, b=batch: [canvas_read((schema[0], ids(generator, 100)), 64, k) for k in range(b)],
            cached=1,
        )
    # (a) no prefix reuse
    for batch in () if "a" not in args.only else (1, 8) if args.quick else (1, 4, 8):
        measure(
            "(a) no reuse",
            batch,
            flops_per_read(1600, 1600, 64),
            lambda i, b=batch: [canvas_read((ids(generator, 1600),), 64, k) for k in range(b)],
            cached=0,
        )
    # (d) 3-question decisions, isolated reads on 16-token canvases
    for concurrency in (1, 32) if "d" in args.only else ():

        def decisions(i: int, c: int = concurrency) -> list[ReadRequest]:
            states = [ids(generator, 100) for _ in range(c)]
            return [canvas_read((schema[0], state), 16, 3 * k + q) for k, state in enumerate(states) for q in range(3)]

        measure(
            f"(d) decisions c={concurrency}",
            3 * concurrency,
            (flops_per_read(100, 1600, 16) + 2 * flops_per_read(0, 1600, 16)) / 3,
            decisions,
            cached=1,
            per="decisions",
            unit=3,
        )

    print("\nscenario | path | batch | rate | p50 ms | p99 ms | peak GiB | vs naive | of 40% ceiling")
    for row in rows:
        print(" | ".join(row))


def profile(run: Callable[[], object], name: str) -> None:
    """The top kernels of ``run()`` by CUDA time, then where the GPU sat idle: the wall time outside
    every kernel, split by the engine phase (``traced``) and the CUDA runtime calls it fell in."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(2):  # a bucket's graph is captured on its second use
        run()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    print(f"\n{name}: {wall * 1e3:.1f} ms wall")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=24, max_name_column_width=60))
    print(idle_report(prof.events()))


def idle_report(events: list) -> str:
    """GPU busy and idle time over the profiled span; the idle time overlapping each engine phase
    and each kind of CUDA runtime call (overlaps of nested phases are each counted)."""
    from torch.autograd import DeviceType

    busy: list[list[float]] = []
    # kernels and copies only: a ``record_function`` range also has a GPU-side span (a user annotation)
    # covering everything it enqueued and the gaps between (a (d) batch's 206 ms of kernels read as
    # 741 ms busy with them counted)
    kernels = (e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation)
    for begin, end in sorted((e.time_range.start, e.time_range.end) for e in kernels):
        if busy and begin <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], end)
        else:
            busy.append([begin, end])
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    span = (min(e.time_range.start for e in cpu), max(e.time_range.end for e in events))
    edges = [span[0], *(t for interval in busy for t in interval), span[1]]
    idle = [(edges[i], edges[i + 1]) for i in range(0, len(edges) - 1, 2) if edges[i + 1] > edges[i]]

    def idle_within(begin: float, end: float) -> float:
        return sum(max(0.0, min(end, b) - max(begin, a)) for a, b in idle)

    by_name: dict[str, list[float]] = {}
    for e in cpu:
        if e.name.startswith(("engine.", "graphs.", "cache.", "cuda")):
            entry = by_name.setdefault(e.name, [0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += e.time_range.end - e.time_range.start
            entry[2] += idle_within(e.time_range.start, e.time_range.end)
    total_idle = sum(b - a for a, b in idle)
    lines = [
        f"GPU busy {sum(b - a for a, b in busy) / 1e3:.1f} ms, idle {total_idle / 1e3:.1f} ms of"
        f" {(span[1] - span[0]) / 1e3:.1f} ms; idle gaps over 0.5 ms: {sum(b - a > 500 for a, b in idle)}",
        "phase or runtime call | calls | CPU ms | GPU idle within, ms",
    ]
    for label, (calls, duration, idle_ms) in sorted(by_name.items(), key=lambda item: -item[1][2]):
        if idle_ms > 100 or label.startswith(("engine.", "graphs.")):
            lines.append(f"{label} | {calls} | {duration / 1e3:.1f} | {idle_ms / 1e3:.1f}")
    return "\n".join(lines)


#: The engine's phases that ``traced`` labels in a profile: methods of the engine, its graphs and its
#: prefix cache, and the functions of the modules the engine calls them through
PHASES = {
    "engine": (
        "_encode_all",
        "_joint_slot_logits",
        "_new_tokens",
        "_slot_logits",
        "_canvases",
        "_head_at_slots",
        "_scored",
    ),
    "read_plan": ("joint_chunks", "split"),
    "assemble": ("joint_masks", "kv_entries", "shared_parts", "own_prompts"),
    "graphs": ("decode", "encode_decode", "_replay"),
    "cache": ("get", "put"),
}


def traced(engine: DiffusionGemmaEngine) -> None:
    """Label ``engine``'s phases in profiles (``record_function`` around each of ``PHASES``), all but the
    graphs' and the cache's as ``engine.NAME``."""
    from torch.profiler import record_function

    owners = {
        "engine": engine,
        "read_plan": read_plan,
        "assemble": assemble,
        "graphs": engine._graphs,
        "cache": engine.prefix_cache,
    }
    for kind, names in PHASES.items():
        owner = owners[kind]
        label = kind if kind in ("graphs", "cache") else "engine"
        for name in names if owner is not None else ():
            method = getattr(owner, name)

            def labelled(*args: object, _method=method, _label=f"{label}.{name}", **kwargs: object) -> object:
                with record_function(_label):
                    return _method(*args, **kwargs)

            setattr(owner, name, labelled)


if __name__ == "__main__":
    main()
