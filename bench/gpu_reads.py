"""DiffusionGemma reads on one GPU: the library's naive read against slotread's engine, side by side.

    PYTHONPATH=. python bench/gpu_reads.py [--layers 30] [--quick]

Builds the real 26B-A4B shape (30 layers, 128 experts top-8, bfloat16, ~50 GB) with random weights on
the GPU (no download) and times, on the same inputs:

* naive: what a transformers user writes: the prompt's encoder cache expanded to the batch, the
  encoder over each read's own tokens, the decoder, then ``lm_head`` and the softcap over every
  canvas position in float32 (the library's own forward for (a));
* slotread: ``DiffusionGemmaEngine.read`` with its prefix cache;
* two forwards ((b) and (d)): the same engine with ``joint_encode=False``, which encodes each new
  state in a forward of its own before the forward of its canvases;
* deterministic ((c) at batch 1 and 64, (d)): the engine's ``deterministic`` mode, batch-invariant
  kernels (``engines/invariant.py``); before timing, its reads are compared bit for bit alone, in a
  mixed batch of 64, cold and warm.

Scenarios: (a) no prefix reuse, 1600-token prompts, 64-token canvases; (b) a shared 1500-token schema
prefix (cached) + 100 own tokens per read; (c) prompt cached, canvas only (K noise draws of one
prompt); (d) 3-question decisions: a 100-token state after a shared, cached 1500-token schema, read
by 3 isolated 16-token canvases (one per question, own seeds), at concurrency 1 and 32 (the server's
batcher hands concurrent decisions' reads to one ``read``).

Reads/s = batch / median batch time; p50/p99 are per batch (every read in a batch waits for it).
The ceiling is the FLOPs a read needs at 40% of the bf16 peak measured here. Before timing, the
engine's slot logits are checked against the naive path: float32 on a 2-layer slice of the same shape
(tolerance 1e-3) and bfloat16 on the full model (stated as the max |Δ|), a read alone against the
same read inside a mixed batch, CUDA graph replay against eager, and, in bfloat16 on a 2-layer
slice, the engine with cuDNN's attention (then also flash attention) against the engine with the
memory-efficient kernel and the masks as biases everywhere. ``--only d`` times one scenario alone;
in a full run (d) comes last, after the others have filled the prefix cache.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DiffusionGemmaForBlockDiffusion, DiffusionGemmaTextConfig, DynamicCache

from slotread.engines.base import ReadRequest, Slot, SlotScores
from slotread.engines.diffusion_gemma import attention
from slotread.engines.diffusion_gemma.engine import DiffusionGemmaEngine
from slotread.engines.diffusion_gemma.noise import noise_canvas
from slotread.engines.prefix_cache import PrefixCache
from slotread.models.shapes import DIFFUSION_GEMMA_26B_A4B, diffusion_gemma_config, random_weights

SHAPE = DIFFUSION_GEMMA_26B_A4B
VOCAB = SHAPE["vocab_size"]


def build(layers: int, dtype: torch.dtype) -> DiffusionGemmaForBlockDiffusion:
    """The shape with random weights, built directly on the GPU."""
    return random_weights(DiffusionGemmaForBlockDiffusion, diffusion_gemma_config(SHAPE, layers), "cuda", dtype)


def ids(generator: torch.Generator, n: int) -> tuple[int, ...]:
    return tuple(torch.randint(300, VOCAB, (n,), generator=generator).tolist())


@dataclass
class Scenario:
    name: str
    batch: int
    make: Callable[[int], list[ReadRequest]]  # iteration -> the batch's requests
    flops: float  # per read


class Naive:
    """The library's modules as a transformers user calls them."""

    def __init__(self, model: DiffusionGemmaForBlockDiffusion) -> None:
        self.model = model
        self.config = model.config.get_text_config()
        self.prefixes: dict[tuple[int, ...], DynamicCache] = {}

    def prefix(self, prompt: tuple[int, ...]) -> DynamicCache:
        if prompt not in self.prefixes:
            cache = DynamicCache(config=self.config)
            self.model.model.encoder(input_ids=torch.tensor([prompt], device="cuda"), past_key_values=cache)
            self.prefixes[prompt] = cache
        return self.prefixes[prompt]

    def read(self, requests: list[ReadRequest], cached: int) -> list[torch.Tensor]:
        """Label logits per request; ``cached`` leading segments come from the naive prefix store.

        Rows must share those segments and have equal lengths (the scenarios make them so).
        """
        with torch.inference_mode():
            return self._read(requests, cached)

    def _read(self, requests: list[ReadRequest], cached: int) -> list[torch.Tensor]:
        device = "cuda"
        batch = len(requests)
        noised = [noise_canvas(r.canvas, [s.position for s in r.slots], r.seed or 0, VOCAB) for r in requests]
        if cached == 0:
            prompt = torch.tensor([r.prompt_ids for r in requests], device=device)
            out = self.model(input_ids=prompt, decoder_input_ids=torch.tensor(noised, device=device))
            logits = out.logits
        else:
            head = sum(len(s) for s in requests[0].prompt[:cached])
            base = self.prefix(requests[0].prompt_ids[:head])
            cache = _expanded(base, batch, self.config)
            own = [r.prompt_ids[head:] for r in requests]
            length = len(requests[0].prompt_ids)
            if own[0]:
                self.model.model.encoder(
                    input_ids=torch.tensor(own, device=device),
                    position_ids=torch.arange(head, length, device=device)[None].expand(batch, -1),
                    past_key_values=cache,
                )
            hidden = self.model.model.decoder(
                decoder_input_ids=torch.tensor(noised, device=device),
                past_key_values=cache,
                decoder_position_ids=torch.arange(length, length + len(noised[0]), device=device)[None].expand(
                    batch, -1
                ),
            ).last_hidden_state
            cap = self.config.final_logit_softcapping
            logits = cap * torch.tanh(self.model.lm_head(hidden).float() / cap)
        return [logits[i, [s.position for s in r.slots]][:, list(r.slots[0].label_ids)] for i, r in enumerate(requests)]


def _expanded(base: DynamicCache, batch: int, config: DiffusionGemmaTextConfig) -> DynamicCache:
    """A cache whose layers view ``base``'s expanded to ``batch`` rows (the library copies on append)."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache()
    for (keys, values, _), kind, source in zip(base, config.layer_types, base.layers, strict=True):
        sliding = kind == "sliding_attention"
        layer = DynamicSlidingWindowLayer(config.sliding_window) if sliding else DynamicLayer()
        expanded_keys, expanded_values = keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1)
        layer.lazy_initialization(expanded_keys, expanded_values)
        layer.keys, layer.values = expanded_keys, expanded_values
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length = source.cumulative_length
        cache.layers.append(layer)
    return cache


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


def time_batches(run: Callable[[int], object], iterations: int) -> list[float]:
    for warm in range(2):
        run(-1 - warm)
    torch.cuda.synchronize()
    times = []
    for i in range(iterations):
        start = time.perf_counter()
        run(i)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


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
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    generator = torch.Generator().manual_seed(0)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    tflops = peak_tflops()
    ceiling = 0.4 * tflops * 1e12
    print(f"bf16 matmul 8192^3: {tflops:.0f} TFLOP/s; ceiling = 40% of it", flush=True)

    check_fp32_slice(generator)
    check_attention(generator)

    start = time.perf_counter()
    model = build(args.layers, torch.bfloat16)
    print(
        f"built {args.layers} layers in {time.perf_counter() - start:.0f} s, "
        f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB",
        flush=True,
    )

    engine = DiffusionGemmaEngine(
        model, prefix_cache=PrefixCache(40 * 2**30), max_canvases=128, max_encode_tokens=16384
    )
    naive = Naive(model)
    strict = DiffusionGemmaEngine(model, prefix_cache=engine.prefix_cache, deterministic=True)
    # new states encoded in a forward of their own, then their canvases: the engine before joint encoding
    apart = DiffusionGemmaEngine(
        model, prefix_cache=engine.prefix_cache, max_canvases=128, max_encode_tokens=16384, joint_encode=False
    )
    schema = [ids(generator, 1500) for _ in range(3)]
    cached_prompt = (schema[0], ids(generator, 100))

    def canvas_read(prompt: tuple[tuple[int, ...], ...], canvas: int, seed: int) -> ReadRequest:
        label_ids = ids(generator, 8)
        return ReadRequest(
            prompt=prompt, canvas=ids(generator, canvas), slots=(Slot(canvas // 2, label_ids),), seed=seed
        )

    check_bf16(engine, naive, [canvas_read(cached_prompt, 64, seed) for seed in range(8)], cached=2)
    check_bf16(engine, naive, [canvas_read((schema[1], ids(generator, 100)), 64, seed) for seed in range(8)], cached=1)
    check_mixed(engine, cached_prompt, canvas_read, generator)
    check_invariant(strict, schema[0], canvas_read, generator)
    check_graphs(engine, cached_prompt, canvas_read, generator)

    if args.profile:
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
    for begin, end in sorted(
        (e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA
    ):
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


#: Engine and graph methods that ``traced`` labels in a profile
PHASES = {
    "engine": (
        "_encode_all",
        "_joint_chunks",
        "_joint_slot_logits",
        "_new_tokens",
        "_joint_masks",
        "_entries",
        "_plan",
        "_slot_logits",
        "_canvases",
        "_shared_parts",
        "_own_prompts",
        "_head_at_slots",
        "_scored",
    ),
    "graphs": ("decode", "encode_decode", "_replay"),
    "cache": ("get", "put"),
}


def traced(engine: DiffusionGemmaEngine) -> None:
    """Label ``engine``'s phases in profiles (``record_function`` around each method of ``PHASES``)."""
    from torch.profiler import record_function

    owners = {"engine": engine, "graphs": engine._graphs, "cache": engine.prefix_cache}
    for kind, names in PHASES.items():
        owner = owners[kind]
        for method_name in names if owner is not None else ():
            method = getattr(owner, method_name)

            def labelled(*args: object, _method=method, _label=f"{kind}.{method_name}", **kwargs: object) -> object:
                with record_function(_label):
                    return _method(*args, **kwargs)

            setattr(owner, method_name, labelled)


def check_fp32_slice(generator: torch.Generator) -> None:
    """Engine vs naive in float32 on a 2-layer slice (one sliding, one full layer) of the shape."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build(2, torch.float32)
    engine = DiffusionGemmaEngine(model, shared_min=256)
    naive = Naive(model)
    head = ids(generator, 1500)
    requests = [
        ReadRequest((head, ids(generator, 100)), ids(generator, 64), (Slot(5, ids(generator, 8)),), seed=s)
        for s in range(4)
    ]
    engine.read(requests[:1])  # cache the head
    # own state tokens after the cached head, then draws of one cached prompt
    draws = [ReadRequest(requests[0].prompt, ids(generator, 64), requests[0].slots, seed=s) for s in range(5)]
    for name, batch, cached in (("shared head + own state", requests, 1), ("cached prompt", draws, 2)):
        got = engine.read(batch)
        want = naive.read(batch, cached=cached)
        worst = max(float((torch.tensor(g.logits[0]) - w[0].cpu()).abs().max()) for g, w in zip(got, want, strict=True))
        print(f"fp32 2-layer slice, {name}: max |engine - naive| label logit {worst:.2e} (tolerance 1e-3)", flush=True)
        assert worst <= 1e-3, worst
    del model, engine, naive
    torch.cuda.empty_cache()


def check_attention(generator: torch.Generator) -> None:
    """The engine with cuDNN's attention, then also flash attention, against the memory-efficient
    kernel with the masks as biases everywhere, in bfloat16 on a 2-layer slice (two layers amplify
    rounding little): new states with one canvas and with three of two widths after a cached head,
    draws of a cached prompt, and prompts encoded from scratch. Each engine first reads batches of the
    same shapes, so the measured ones replay CUDA graphs where the engine takes them."""
    model = build(2, torch.bfloat16)
    head = ids(generator, 1500)

    def reads() -> list[list[ReadRequest]]:
        states = [
            ReadRequest((head, ids(generator, 100)), ids(generator, 64), (Slot(5, ids(generator, 8)),), seed=s)
            for s in range(4)
        ]
        decisions = [
            ReadRequest((head, state), ids(generator, width), (Slot(3, ids(generator, 8)),), seed=q)
            for state in [ids(generator, 90) for _ in range(4)]
            for q, width in enumerate((16, 12, 16))
        ]
        draws = [ReadRequest(states[0].prompt, ids(generator, 64), states[0].slots, seed=s) for s in range(4)]
        fresh = [
            ReadRequest((ids(generator, 1600),), ids(generator, 64), (Slot(7, ids(generator, 8)),), seed=s)
            for s in range(2)
        ]
        return [[states[0]], states, decisions, draws, fresh]

    warm, batches = reads(), reads()
    results = {}
    for kernels in ("efficient", "cudnn", "cudnn+flash"):
        attention.USE_CUDNN, attention.USE_FLASH = kernels != "efficient", kernels == "cudnn+flash"
        engine = DiffusionGemmaEngine(model, shared_min=256)
        for batch in warm:
            engine.read(batch)
        results[kernels] = [result for batch in batches for result in engine.read(batch)]
    attention.USE_CUDNN = attention.USE_FLASH = True
    want = results["efficient"]
    scale = max(float(abs(b.logits[0]).max()) for b in want)
    for kernels in ("cudnn", "cudnn+flash"):
        deltas = [float(abs(a.logits[0] - b.logits[0]).max()) for a, b in zip(results[kernels], want, strict=True)]
        print(
            f"bf16 2-layer slice, {kernels} attention vs the memory-efficient kernel: max |Δ logit| per read"
            f" {statistics.median(deltas):.3g} median, {max(deltas):.3g} max, on logits up to {scale:.1f}",
            flush=True,
        )
    del model
    torch.cuda.empty_cache()


def check_bf16(engine: DiffusionGemmaEngine, naive: Naive, requests: list[ReadRequest], cached: int) -> None:
    got = engine.read(requests)
    want = naive.read(requests, cached=cached)
    worst = max(
        float((torch.tensor(g.logits[0]) - w[0].float().cpu()).abs().max()) for g, w in zip(got, want, strict=True)
    )
    scale = max(float(w[0].abs().max()) for w in want)
    # the naive path's own batch noise: the first read alone against itself inside the batch
    noise = float((naive.read(requests[:1], cached=cached)[0] - want[0]).abs().max())
    print(
        f"bf16 full model, {cached} cached segment(s): max |engine - naive| {worst:.3f} on logits up to {scale:.1f};"
        f" naive alone vs naive in the batch: {noise:.3f}",
        flush=True,
    )


def check_graphs(
    engine: DiffusionGemmaEngine,
    prompt: tuple[tuple[int, ...], ...],
    canvas_read: Callable[..., ReadRequest],
    generator: torch.Generator,
) -> None:
    """CUDA graph replay against eager: reads of one cached prompt (same row count, same kernels),
    and a new state encoded with its 3 canvases (the graph pads it to its bucket)."""
    draws = [canvas_read(prompt, 64, seed) for seed in range(8)]
    engine.read(draws)  # a bucket's graph is captured on its second use
    graphed = replayed(engine, draws)
    eager = DiffusionGemmaEngine(engine._model, prefix_cache=engine.prefix_cache, cuda_graphs=False).read(draws)
    delta = max(float(abs(a.logits[0] - b.logits[0]).max()) for a, b in zip(eager, graphed, strict=True))
    print(f"bf16: 8 reads of a cached prompt, CUDA graph replay vs eager: max |Δ logit| {delta:.3g}", flush=True)
    # 99 new tokens: padded to 100 in the graph; the bucket's first use runs eagerly
    engine.read([canvas_read((prompt[0], ids(generator, 99)), 16, q) for q in range(3)])
    decision = [canvas_read((prompt[0], ids(generator, 99)), 16, q) for q in range(3)]
    graphed = replayed(engine, decision)
    # its own cache: it encodes the state too
    eager = DiffusionGemmaEngine(engine._model, cuda_graphs=False).read(decision)
    delta = max(float(abs(a.logits[0] - b.logits[0]).max()) for a, b in zip(eager, graphed, strict=True))
    scale = max(float(abs(b.logits[0]).max()) for b in eager)
    print(
        f"bf16: a new state with 3 canvases, joint CUDA graph (new tokens padded 99 -> 100) vs eager:"
        f" max |Δ logit| {delta:.3g} on logits up to {scale:.1f}",
        flush=True,
    )


def replayed(engine: DiffusionGemmaEngine, requests: list[ReadRequest]) -> list[SlotScores]:
    """``engine.read(requests)``, failing unless it replayed a CUDA graph (a graph path that fell back
    to eager would compare eager with eager)."""
    graphs = engine._graphs
    before = -1 if graphs is None else graphs.replays
    scores = engine.read(requests)
    if graphs is None or graphs.replays == before:
        raise SystemExit("CUDA graphs: the graphed read ran eagerly (see the warning above)")
    return scores


def check_invariant(strict: DiffusionGemmaEngine, schema: tuple[int, ...], canvas_read, generator) -> None:
    """The deterministic engine's reads compared bit for bit (every label logit): a read whose state is new
    (cold: encoded in this call), the same read again (warm), and inside a batch of 64 with new and cached
    states of other lengths and other canvases; and a read first made cold inside such a batch, then
    alone."""

    def batch_around(read: ReadRequest, cold: bool) -> list[ReadRequest]:
        others = [canvas_read((schema, ids(generator, 60 + 7 * k)), 16 + 16 * (k % 4), 100 + k) for k in range(63)]
        if not cold:
            strict.read(others[::2])  # half of them cached
        return [*others[:30], read, *others[30:]]

    def logits(scores: list[SlotScores]) -> list[np.ndarray]:
        return [slot_logits for result in scores for slot_logits in result.logits]

    one = canvas_read((schema, ids(generator, 100)), 16, 7)
    cold = strict.read([one])
    warm = strict.read([one])
    mixed = strict.read(batch_around(one, cold=False))[30:31]
    other = canvas_read((schema, ids(generator, 100)), 16, 8)
    cold_mixed = strict.read(batch_around(other, cold=True))[30:31]
    warm_alone = strict.read([other])
    pairs = {
        "cold alone vs warm alone": (cold, warm),
        "alone vs in a mixed batch of 64": (warm, mixed),
        "cold in a batch of 64 vs warm alone": (cold_mixed, warm_alone),
    }
    for name, (a, b) in pairs.items():
        same = all(np.array_equal(x, y) for x, y in zip(logits(a), logits(b), strict=True))
        delta = max(float(np.abs(x - y).max()) for x, y in zip(logits(a), logits(b), strict=True))
        print(f"bf16, {strict.mode}: {name}: bit-identical {same} (max |Δ logit| {delta:.3g})", flush=True)


def check_mixed(engine: DiffusionGemmaEngine, prompt: tuple[tuple[int, ...], ...], canvas_read, generator) -> None:
    one = canvas_read(prompt, 64, 7)
    alone = engine.read([one])[0]
    others = [canvas_read((prompt[0], ids(generator, 100)), 64, s) for s in range(15)]
    # their prompts cached first: all 16 canvases then share one decoder forward (new states would
    # each be encoded in a joint forward of their own, apart from this read)
    engine.read(others)
    mixed = engine.read([*others[:7], one, *others[7:]])[7]
    delta = float(abs(alone.logits[0] - mixed.logits[0]).max())
    mode = "deterministic" if engine.deterministic else "batched"
    print(f"bf16, {mode}: a read alone vs in a mixed batch of 16: max |Δ logit| {delta:.3g}", flush=True)


if __name__ == "__main__":
    main()
