"""The DiffusionGemma engine on a GPU: against the library's own read, its fast paths against the
reference roads, and the deterministic mode bit for bit.

Slices of the real 26B-A4B shape with random weights, built on the GPU (no download): two layers (one
sliding, one full); ``SLOTREAD_GPU_LAYERS=30`` reads the graph and deterministic checks on the full model.
A bfloat16 road is judged by its error against float32 on the same weights, beside the library's own
bfloat16 error on the same reads: random weights put many of a router's top-8 on near ties, so a
change of rounding anywhere moves some reads by a large share of their logits, and only the float32
truth says whether a road rounds worse than the library does. CPU CI skips these; on the GPU machine:

    PYTHONPATH=. python3 -m pytest -m gpu --confcutdir=tests/gpu -s tests/gpu

(``--confcutdir`` keeps the suite's conftest, which needs the server's dependencies, out; ``-s`` shows
the measured differences, the lines bench/RESULTS.md cites.)
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Iterator
from dataclasses import fields

import numpy as np
import pytest
import torch
from transformers import DiffusionGemmaForBlockDiffusion

from bench.helpers import Naive, build, ids
from slotread.engines.base import ReadRequest, Slot, SlotScores
from slotread.engines.diffusion_gemma.engine import LAYER_GRAPH_TOKENS, DiffusionGemmaEngine
from slotread.engines.diffusion_gemma.fast_paths import FastPaths
from slotread.engines.diffusion_gemma.layer_graphs import token_buckets

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LAYERS = int(os.environ.get("SLOTREAD_GPU_LAYERS", "2"))
#: every fast path off: the reference road
REFERENCE = FastPaths(**{field.name: False for field in fields(FastPaths)})
#: no CUDA graph of any kind: the forwards launched from Python
EAGER = FastPaths(cuda_graphs=False, layer_graphs=False)

Prompt = tuple[tuple[int, ...], ...]


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@pytest.fixture
def float32_model() -> Iterator[DiffusionGemmaForBlockDiffusion]:
    """Two layers whatever ``SLOTREAD_GPU_LAYERS`` says: the full shape in float32 would not fit beside the
    bfloat16 one."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build(2, torch.float32)
    yield model
    del model
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def twins() -> Iterator[tuple[DiffusionGemmaForBlockDiffusion, DiffusionGemmaForBlockDiffusion]]:
    """A two-layer slice in float32 (the truth) and the same weights rounded to bfloat16."""
    torch.backends.cuda.matmul.allow_tf32 = False
    exact, rounded = build(2, torch.float32), build(2, torch.bfloat16)
    with torch.no_grad():  # the weights only: buffers (rotary tables) as a bfloat16 model builds them
        for mine, theirs in zip(rounded.parameters(), exact.parameters(), strict=True):
            mine.copy_(theirs)
    yield exact, rounded
    del exact, rounded
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def bfloat16_model() -> Iterator[DiffusionGemmaForBlockDiffusion]:
    model = build(LAYERS, torch.bfloat16)
    yield model
    del model
    torch.cuda.empty_cache()


def reader(generator: torch.Generator) -> Callable[[Prompt, int, int], ReadRequest]:
    """Reads of random canvases of a width with one slot in the middle and 8 random labels."""

    def canvas_read(prompt: Prompt, canvas: int, seed: int) -> ReadRequest:
        return ReadRequest(prompt, ids(generator, canvas), (Slot(canvas // 2, ids(generator, 8)),), seed=seed)

    return canvas_read


def logits_of(scores: list[SlotScores]) -> list[np.ndarray]:
    return [slot_logits for result in scores for slot_logits in result.logits]


def largest_difference(a: list[SlotScores], b: list[SlotScores]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(logits_of(a), logits_of(b), strict=True))


def errors(got: list[np.ndarray], truth: list[np.ndarray]) -> list[float]:
    """Per read, the max |Δ label logit| against the float32 truth."""
    return [float(np.abs(g - t).max()) for g, t in zip(got, truth, strict=True)]


def as_accurate(name: str, road: list[float], library: list[float]) -> bool:
    """Print a road's and the library's bfloat16 errors; True when the road's median error is at most
    twice the library's (plus 0.02: both near 0) and its worst at most twice the library's worst (a
    wrong KV or mask moves every read by about the logits' scale)."""
    print(
        f"bf16 2-layer slice, {name}: error against float32 per read {statistics.median(road):.3g} median,"
        f" {max(road):.3g} max; the library's {statistics.median(library):.3g} median, {max(library):.3g} max"
    )
    return statistics.median(road) <= 2 * statistics.median(library) + 0.02 and max(road) <= 2 * max(library) + 0.02


def naive_logits(model: DiffusionGemmaForBlockDiffusion, requests: list[ReadRequest], cached: int) -> list[np.ndarray]:
    """The library's label logits (``bench.helpers.Naive``) as float32 arrays."""
    return [logits[0].float().cpu().numpy() for logits in Naive(model).read(requests, cached=cached)]


def replayed(engine: DiffusionGemmaEngine, requests: list[ReadRequest]) -> list[SlotScores]:
    """``engine.read(requests)``, failing unless it replayed a CUDA graph (a graph path that fell back to
    eager would compare eager with eager)."""
    before = engine.counters()["graph_replays"]
    scores = engine.read(requests)
    assert engine.counters()["graph_replays"] > before, "the graphed read ran eagerly (see the warning logged)"
    return scores


def test_float32_reads_match_the_library(float32_model: DiffusionGemmaForBlockDiffusion, generator) -> None:
    """Engine vs the library's own read in float32 (the maths: Triton combine and merge, the fused norms
    run here too): a cached head + own state tokens (encoded with the canvases in one forward), and
    draws of one cached prompt."""
    engine = DiffusionGemmaEngine(float32_model, shared_min=256)
    naive = Naive(float32_model)
    head = ids(generator, 1500)
    requests = [
        ReadRequest((head, ids(generator, 100)), ids(generator, 64), (Slot(5, ids(generator, 8)),), seed=s)
        for s in range(4)
    ]
    engine.read(requests[:1])  # cache the head
    draws = [ReadRequest(requests[0].prompt, ids(generator, 64), requests[0].slots, seed=s) for s in range(5)]
    for name, batch, cached in (("shared head + own state", requests, 1), ("cached prompt", draws, 2)):
        got = engine.read(batch)
        want = naive.read(batch, cached=cached)
        worst = max(float((torch.tensor(g.logits[0]) - w[0].cpu()).abs().max()) for g, w in zip(got, want, strict=True))
        print(f"fp32 2-layer slice, {name}: max |engine - naive| label logit {worst:.2e} (tolerance 1e-3)")
        assert worst <= 1e-3


def test_bfloat16_reads_match_the_library(twins, generator) -> None:
    """Engine vs the library in bfloat16, each against float32 on the same weights: reads of a cached
    head and state, and of a cached head with new states; the engine's error stays within twice the
    library's (``as_accurate``)."""
    exact, rounded = twins
    engine = DiffusionGemmaEngine(rounded)
    canvas_read = reader(generator)
    head = ids(generator, 1500)
    engine.read([canvas_read((head, ids(generator, 100)), 64, 0)])
    for cached, prompt in ((2, (head, ids(generator, 100))), (1, (ids(generator, 1500), ids(generator, 100)))):
        requests = [canvas_read(prompt, 64, seed) for seed in range(8)]
        truth = naive_logits(exact, requests, cached)
        got = errors(logits_of(engine.read(requests)), truth)
        assert as_accurate(
            f"{cached} cached segment(s), engine", got, errors(naive_logits(rounded, requests, cached), truth)
        )


def test_cuda_graph_replay_reads_as_eager(bfloat16_model: DiffusionGemmaForBlockDiffusion, generator) -> None:
    """Graph replay against the eager forward: reads of one cached prompt (same rows, same kernels: bit
    for bit), and a new state encoded with its 3 canvases, 99 new tokens padded to the graph's 100
    (0 on the full model; padding that leaked into attention moved logits by 1.9-3.2)."""
    engine = DiffusionGemmaEngine(bfloat16_model)
    canvas_read = reader(generator)
    prompt = (ids(generator, 1500), ids(generator, 100))
    engine.read([canvas_read(prompt, 64, 100)])  # the prompt cached (its state encoded with this canvas)
    draws = [canvas_read(prompt, 64, seed) for seed in range(8)]
    engine.read(draws)  # a bucket's graph is captured on its second use
    graphed = replayed(engine, draws)
    eager_engine = DiffusionGemmaEngine(bfloat16_model, prefix_cache=engine.prefix_cache, fast=EAGER)
    delta = largest_difference(eager_engine.read(draws), graphed)
    print(f"bf16: 8 reads of a cached prompt, CUDA graph replay vs eager: max |Δ logit| {delta:.3g}")
    assert delta <= 1e-2  # 0 measured: the same kernels on the same shapes
    engine.read([canvas_read((prompt[0], ids(generator, 99)), 16, q) for q in range(3)])  # first use: eager
    decision = [canvas_read((prompt[0], ids(generator, 99)), 16, q) for q in range(3)]
    graphed = replayed(engine, decision)
    eager = DiffusionGemmaEngine(bfloat16_model, fast=EAGER).read(decision)  # encodes it too
    delta = largest_difference(eager, graphed)
    scale = max(float(np.abs(x).max()) for x in logits_of(eager))
    print(
        "bf16: a new state with 3 canvases, joint CUDA graph (new tokens padded 99 -> 100) vs eager:"
        f" max |Δ logit| {delta:.3g} on logits up to {scale:.1f}"
    )
    assert delta <= 0.1


def test_layer_graphs_read_as_eager(twins, generator) -> None:
    """Forwards no whole graph covers (``cuda_graphs`` off) through the layers' graph pieces, replayed
    from the third batch of each shape on: mixed decisions (three schemas of 300-1,500 tokens, states of
    20-400, 1-4 questions each). Batched, against float32 as accurate as the eager forward (``as_accurate``:
    padded token counts may change cuBLAS's tiles); deterministic, bit for bit the eager forward (its
    kernels' per-row sums do not depend on the token count)."""
    exact, rounded = twins
    canvas_read = reader(generator)
    schemas = [ids(generator, n) for n in (300, 900, 1500)]

    def decisions() -> list[ReadRequest]:  # the same token counts every time, fresh ids
        shapes = [(schemas[k % 3], 20 + (37 * k) % 380, 1 + k % 4) for k in range(12)]
        return [
            canvas_read((s, state), 16, q)
            for s, n, asked in shapes
            for state in [ids(generator, n)]
            for q in range(asked)
        ]

    truth_engine = DiffusionGemmaEngine(exact, fast=REFERENCE)
    for deterministic in (False, True):
        pieces = DiffusionGemmaEngine(rounded, deterministic=deterministic, fast=FastPaths(cuda_graphs=False))
        eager = DiffusionGemmaEngine(rounded, deterministic=deterministic, fast=EAGER)
        for engine in (pieces, eager, truth_engine):
            engine.read([canvas_read((schema,), 16, 0) for schema in schemas])  # the schemas cached
        pieces.read(decisions())  # each piece run eagerly, then captured on its second use
        pieces.read(decisions())
        reads = decisions()
        before = pieces.counters()["layer_graph_replays"]
        graphed = pieces.read(reads)
        replays = pieces.counters()["layer_graph_replays"] - before
        assert replays > 0, "the pieces ran eagerly (see the warning logged)"
        reference = eager.read(reads)
        if deterministic:
            delta = largest_difference(reference, graphed)
            print(f"bf16, {pieces.mode}: {replays} layer pieces replayed vs eager: max |Δ logit| {delta:.3g}")
            assert delta == 0
        else:
            truth = logits_of(truth_engine.read(reads))
            assert as_accurate(
                f"layer graphs ({replays} pieces replayed; yardstick: eager)",
                errors(logits_of(graphed), truth),
                errors(logits_of(reference), truth),
            )


def test_a_prepared_engine_captures_no_layer_piece_while_reading(twins, generator) -> None:
    """After ``prepare`` (a server's start-up), a schema's encoder forward and mixed decisions' joint
    forwards (``cuda_graphs`` off, so every forward runs through layer pieces) replay pieces and
    capture none, the encoder's replaying the decoder's (``LayerGraphs.share``); and they read as the
    eager forwards do against float32 (``as_accurate``)."""
    exact, rounded = twins
    canvas_read = reader(generator)
    schema = ids(generator, 700)
    reads = [canvas_read((schema, ids(generator, 20 + 53 * k)), 16, q) for k in range(6) for q in range(1 + k % 3)]
    engine = DiffusionGemmaEngine(rounded, fast=FastPaths(cuda_graphs=False))
    engine.prepare()
    captured = engine.counters()["layer_graph_captures"]
    layers = len(rounded.config.get_text_config().layer_types)
    assert captured == len(token_buckets(LAYER_GRAPH_TOKENS)) * (layers + 2)  # the encoder's last piece its own
    engine.read([canvas_read((schema,), 16, 0)])  # the schema cached
    graphed = engine.read(reads)
    counters = engine.counters()
    assert counters["layer_graph_captures"] == captured and counters["layer_graph_replays"] > 0
    assert counters["encode_forwards"] > 0  # the schema's, through the encoder's (shared) pieces
    truth = logits_of(DiffusionGemmaEngine(exact, fast=REFERENCE).read(reads))
    eager = DiffusionGemmaEngine(rounded, fast=EAGER).read(reads)
    assert as_accurate("prepared layer graphs", errors(logits_of(graphed), truth), errors(logits_of(eager), truth))


def test_attention_kernels_agree(twins, generator) -> None:
    """The engine with cuDNN's attention, then also flash attention, against the memory-efficient kernel
    with the masks as biases everywhere: new states with one canvas and with three of two widths after a
    cached head, draws of a cached prompt, prompts encoded from scratch. Each engine first reads batches
    of the same shapes, so the measured ones replay CUDA graphs where it takes them. Each against float32
    (the reference road on the float32 twin): as accurate as the memory-efficient kernel (``as_accurate``)."""
    exact, rounded = twins
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
    kernels = {
        "efficient": FastPaths(cudnn_attention=False, flash_attention=False),
        "cudnn": FastPaths(flash_attention=False),
        "cudnn+flash": FastPaths(),
    }
    results = {}
    for name, fast in kernels.items():
        engine = DiffusionGemmaEngine(rounded, shared_min=256, fast=fast)
        for batch in warm:
            engine.read(batch)
        results[name] = logits_of([result for batch in batches for result in engine.read(batch)])
    truth_engine = DiffusionGemmaEngine(exact, shared_min=256, fast=REFERENCE)
    truth = logits_of([result for batch in batches for result in truth_engine.read(batch)])
    reference = errors(results["efficient"], truth)
    for name in ("cudnn", "cudnn+flash"):
        assert as_accurate(
            f"{name} attention (yardstick: the memory-efficient kernel)", errors(results[name], truth), reference
        )


def test_every_fast_path_off_reads_alike(twins, generator) -> None:
    """The engine with all its fast paths in effect on a GPU and the reference road (none of them), each
    in bfloat16 against float32 (the reference road on the float32 twin), beside the library's error on
    the same reads: both roads as accurate as the library; and the options do switch (the start-up
    log's list)."""
    exact, rounded = twins
    fast = DiffusionGemmaEngine(rounded)
    slow = DiffusionGemmaEngine(rounded, fast=REFERENCE)
    truth_engine = DiffusionGemmaEngine(exact, fast=REFERENCE)
    on = {"cuda_graphs", "layer_graphs", "joint_encode", "cudnn_attention", "flash_attention", "compiled"}
    assert on <= set(fast.fast.on())
    assert slow.fast.on() == []
    canvas_read = reader(generator)
    head = ids(generator, 1500)
    decisions = [
        canvas_read((head, state), 16, q) for state in [ids(generator, 90) for _ in range(4)] for q in range(3)
    ]
    for engine in (fast, slow):
        engine.read([canvas_read((head, ids(generator, 90)), 16, 0)])  # the head cached
        engine.read(decisions[:3])  # a graph bucket seen once
    truth = logits_of(truth_engine.read(decisions))
    library = errors(naive_logits(rounded, decisions, cached=1), truth)
    print(f"float32: the reference road vs the library {max(errors(naive_logits(exact, decisions, 1), truth)):.2e}")
    assert as_accurate("every fast path", errors(logits_of(fast.read(decisions)), truth), library)
    assert as_accurate("no fast path", errors(logits_of(slow.read(decisions)), truth), library)
    assert slow.counters()["graph_replays"] == 0


def test_deterministic_reads_are_bit_identical(bfloat16_model: DiffusionGemmaForBlockDiffusion, generator) -> None:
    """The deterministic engine's reads, every label logit bit for bit: a read whose state is new (cold)
    and the same read again (warm); alone and inside a batch of 64 with new and cached states of other
    lengths and other canvases; a read first made cold inside such a batch, then alone. The batched
    engine's move between a read alone and in a mixed batch of 16 is printed beside it."""
    strict = DiffusionGemmaEngine(bfloat16_model, deterministic=True)
    assert strict.mode == "batch-invariant"
    canvas_read = reader(generator)
    schema = ids(generator, 1500)

    def batch_around(read: ReadRequest, cold: bool) -> list[ReadRequest]:
        others = [canvas_read((schema, ids(generator, 60 + 7 * k)), 16 + 16 * (k % 4), 100 + k) for k in range(63)]
        if not cold:
            strict.read(others[::2])  # half of them cached
        return [*others[:30], read, *others[30:]]

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
    batched = DiffusionGemmaEngine(bfloat16_model)
    prompt = (schema, ids(generator, 100))
    batched.read([canvas_read(prompt, 64, 0)])  # the prompt cached: the read below decodes it alone
    read = canvas_read(prompt, 64, 7)
    alone = batched.read([read])
    others = [canvas_read((schema, ids(generator, 100)), 64, s) for s in range(15)]
    batched.read(others)  # their prompts cached: the 16 canvases then share one decoder forward
    in_batch = batched.read([*others[:7], read, *others[7:]])[7:8]
    print(
        f"bf16, batched: a read alone vs in a mixed batch of 16: max |Δ logit| {largest_difference(alone, in_batch):.3g}"
    )
    identical = {}
    for name, (a, b) in pairs.items():
        identical[name] = all(np.array_equal(x, y) for x, y in zip(logits_of(a), logits_of(b), strict=True))
        print(
            f"bf16, {strict.mode}: {name}: bit-identical {identical[name]} (max |Δ logit| {largest_difference(a, b):.3g})"
        )
    assert all(identical.values()), identical


def test_an_engine_call_waits_for_the_gpu_only_to_score(
    bfloat16_model: DiffusionGemmaForBlockDiffusion, generator
) -> None:
    """A call of several forwards (30 decisions' isolated questions, 30 canvases a forward) queues
    them all before it copies any result to the host: a host sync between two forwards leaves the GPU
    idle while the host prepares the next one. Every synchronising call (torch's sync debug
    mode) must come from the scoring at the end (``engines/scores.py``)."""
    engine = DiffusionGemmaEngine(bfloat16_model, max_canvases=30)
    canvas_read = reader(generator)
    instructions = ids(generator, 1500)
    questions = [ids(generator, n) for n in (20, 41, 60)]
    for question in questions:  # each question's prompt cached after the instructions
        engine.read([canvas_read((instructions, question), 16, 0)])

    def decisions(count: int) -> list[ReadRequest]:
        states = [ids(generator, 100) for _ in range(count)]
        return [canvas_read((instructions, q, s), 16, k) for s in states for k, q in enumerate(questions)]

    # three forwards of 10 decisions, each over the three questions' prompts: one graph's bucket,
    # captured on its second use
    engine.read(decisions(30))
    engine.read(decisions(30))
    calls = decisions(30)
    before = engine.counters()
    torch.cuda.synchronize()
    with pytest.warns(UserWarning) as caught:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.read(calls)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    forwards, replays = (engine.counters()[key] - before[key] for key in ("joint_forwards", "graph_replays"))
    syncs = [f"{w.filename.split('slotread/')[-1]}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    print(f"host syncs in one call of {forwards} joint forwards ({replays} replayed): {syncs}")
    assert (forwards, replays) == (3, 3), f"{engine.counters()['graph_captures']} graphs captured"
    # torch's own (one, in torch/cuda, seen on torch 2.11) are not this engine's to move
    ours = [place for place in syncs if "site-packages" not in place]
    assert ours and all(place.startswith("engines/scores.py") for place in ours), syncs


def test_one_decisions_isolated_questions_take_one_graphed_forward(
    bfloat16_model: DiffusionGemmaForBlockDiffusion, generator
) -> None:
    """Three isolated questions of one decision continue three cached prompts (the instructions, then
    each question); where graphs run they are read in one joint forward over the three parents (one
    graph, ``graphs.Layout``), as the eager engine reads them."""
    engine = DiffusionGemmaEngine(bfloat16_model)
    canvas_read = reader(generator)
    instructions = ids(generator, 1500)
    questions = [ids(generator, n) for n in (20, 41, 60)]
    for question in questions:
        engine.read([canvas_read((instructions, question), 16, 0)])

    def decision() -> list[ReadRequest]:
        state = ids(generator, 100)
        return [canvas_read((instructions, q, state), 16, k) for k, q in enumerate(questions)]

    engine.read(decision())
    engine.read(decision())  # captured on its second use
    reads = decision()
    before = engine.counters()["joint_forwards"]
    graphed = replayed(engine, reads)
    assert engine.counters()["joint_forwards"] - before == 1
    eager = DiffusionGemmaEngine(bfloat16_model, fast=EAGER)
    for question in questions:
        eager.read([canvas_read((instructions, question), 16, 0)])
    reference = eager.read(reads)
    delta = largest_difference(reference, graphed)
    scale = max(float(np.abs(x).max()) for x in logits_of(reference))
    print(
        "bf16: one decision's 3 questions, one graphed forward over 3 parents vs eager:"
        f" max |Δ logit| {delta:.3g} on logits up to {scale:.1f}"
    )
    # the same forward, unpadded (a row and a canvas per parent): a wrong parent or mask moves a read
    # by about the logits' scale
    assert delta <= 0.01 * scale
