"""The CUDA graphs' buckets, on the CPU: a joint forward padded to its buckets (one or more parents)
reads as the unpadded one, and through the layers' graph pieces (``layer_graphs.py``, run eagerly over
their static buffers here) as the eager forward.

Capture and replay need a GPU (bench/gpu_reads.py checks them on an H200); the padding they rely on
is plain torch and is checked here, on a tiny random-weight DiffusionGemma in float32.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DiffusionGemmaForBlockDiffusion

from slotread.engines.base import ReadRequest, Slot
from slotread.engines.diffusion_gemma import read_plan
from slotread.engines.diffusion_gemma.attention import MASKED
from slotread.engines.diffusion_gemma.engine import DiffusionGemmaEngine
from slotread.engines.diffusion_gemma.forward import encode_decode
from slotread.engines.diffusion_gemma.graphs import Layout, _padded_states, bucket, length_bucket, padded
from slotread.engines.diffusion_gemma.inputs import Canvases, JointMasks, NewTokens, SharedPart
from slotread.engines.diffusion_gemma.layer_attention import visible_runs
from slotread.engines.diffusion_gemma.layer_graphs import LayerGraphs, token_bucket, token_buckets
from slotread.engines.prefix_cache import PrefixKV
from slotread.models.tiny import GEMMA4_VOCAB_SIZE, tiny_diffusion_gemma


@pytest.fixture(scope="module")
def model() -> DiffusionGemmaForBlockDiffusion:
    return tiny_diffusion_gemma(seed=0)


def test_buckets_are_powers_of_two_or_three_quarters_of_one() -> None:
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 96, 100, 128, 129)] == [1, 2, 3, 6, 8, 96, 128, 128, 192]


def test_length_buckets_are_sixteenths_of_a_power_of_two() -> None:
    sizes = range(1, 2049)
    assert [length_bucket(n) for n in (1, 32, 33, 64, 65, 100, 128, 129)] == [1, 32, 34, 64, 68, 100, 128, 136]
    assert all(n <= length_bucket(n) < n * 17 / 16 + 1 for n in sizes)
    assert len({length_bucket(n) for n in range(1025, 2049)}) == 16  # sixteen graphs per doubling


def joint_inputs(
    model: DiffusionGemmaForBlockDiffusion, new: int, parts: tuple[tuple[int, int], ...]
) -> tuple[NewTokens, Canvases, torch.Tensor, JointMasks]:
    """A joint forward's inputs: ``new`` tokens a row after each part's cached parent (30 and 22 tokens),
    per part (its new-token rows, its canvases of 4 columns), canvases reading their rows out of order."""
    generator = torch.Generator().manual_seed(3)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randint(3, GEMMA4_VOCAB_SIZE, shape, generator=generator)

    config = model.config.text_config
    engine = DiffusionGemmaEngine(model)
    held, columns = config.sliding_window - 1, 4
    tokens, positions, parents, canvas_parts, canvas_tokens, canvas_positions, own = [], [], [], [], [], [], []
    for part, (rows, canvas_rows) in enumerate(parts):
        schema = tuple(draw(30 - 8 * part).tolist())  # parents of 30 and 22 tokens
        engine.read([ReadRequest((schema,), (5, 6), (Slot(0, (7, 8)),))])
        parent = engine.prefix_cache.get(schema)
        assert parent is not None
        length = len(schema) + new
        tokens.append(draw(rows, new))
        positions.append(torch.arange(len(schema), length).expand(rows, -1))
        parents.append(SharedPart(rows, parent.keys, parent.values))
        canvas_parts.append(SharedPart(canvas_rows, parent.keys, parent.values))
        canvas_tokens.append(draw(canvas_rows, columns))
        canvas_positions.append(torch.arange(length, length + columns).expand(canvas_rows, -1))
        first = sum(r for r, _ in parts[:part])
        own.append(torch.tensor([first + (k * 3) % rows for k in range(canvas_rows)]))  # out of order, some rows twice
    canvas_rows = sum(c for _, c in parts)
    bias = torch.zeros(canvas_rows, columns)
    bias[parts[0][1] - 1, -1] = MASKED  # one padded canvas
    # the shared sliding keys out of a canvas's window: past the parent's last (held - new)
    skip = torch.where(torch.arange(held) >= max(0, new), 0.0, MASKED)
    return (
        NewTokens(torch.cat(tokens), torch.cat(positions), parents),
        Canvases(torch.cat(canvas_tokens), torch.cat(canvas_positions), bias, canvas_parts),
        torch.cat(own),
        JointMasks(
            own={
                "full_attention": torch.zeros(canvas_rows, new),
                "sliding_attention": torch.where(torch.arange(new) >= new - held, 0.0, MASKED).expand(canvas_rows, -1),
            },
            shared={"sliding_attention": skip.expand(canvas_rows, -1)},
        ),
    )


@pytest.mark.parametrize(
    ("new", "parts"),
    [
        (5, ((5, 5),)),  # within the sliding window's 15 held tokens: 5 new tokens stay 5
        (37, ((5, 5),)),  # past it: 37 become 38
        (37, ((5, 5), (3, 2))),  # two parents (isolated questions), each padded apart
    ],
)
def test_a_padded_joint_forward_reads_as_the_unpadded_one(
    model: DiffusionGemmaForBlockDiffusion, new: int, parts: tuple[tuple[int, int], ...]
) -> None:
    """Per parent (its new-token rows, its canvases): 5 rows pad to 6, 5 canvases to 6, 3 rows and 2
    canvases stay."""
    config = model.config.text_config
    inputs = joint_inputs(model, new, parts)
    args = (model.model.decoder, config.layer_types, config.sliding_window)
    layout = Layout.of(inputs[0], inputs[1])
    assert layout is not None and layout.rows == tuple(bucket(r) for r, _ in parts)
    with torch.inference_mode():
        kv, hidden = encode_decode(*args, *inputs)
        padded_inputs = padded(*inputs, layout)
        assert padded_inputs[0].tokens.shape == (sum(layout.rows), length_bucket(new))
        assert padded_inputs[1].tokens.shape == (sum(layout.canvases), 4)  # canvases keep their 4 columns
        padded_kv, padded_hidden = encode_decode(*args, *padded_inputs)
    rows, read = layout.real(torch.device("cpu"))
    torch.testing.assert_close(padded_hidden[read], hidden, atol=1e-5, rtol=0)
    for (keys, values), (padded_keys, padded_values) in zip(kv, padded_kv, strict=True):
        torch.testing.assert_close(padded_keys[rows, :, :new], keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(padded_values[rows, :, :new], values, atol=1e-5, rtol=0)


def test_token_buckets_are_eighths_of_a_power_of_two() -> None:
    assert [token_bucket(n) for n in (1, 16, 17, 100, 128, 129, 324, 5600)] == [16, 16, 32, 112, 128, 144, 352, 5632]
    assert all(n <= token_bucket(n) < n + max(16, n / 8) for n in range(1, 5000))
    assert len({token_bucket(n) for n in range(1025, 2049)}) == 8  # eight token counts per doubling


def test_token_buckets_list_every_bucket_a_forward_can_ask_for() -> None:
    assert token_buckets(8192) == sorted({token_bucket(n) for n in range(1, 8193)})
    assert len(token_buckets(8192)) == 56 and token_buckets(300) == token_buckets(288)


def test_joint_forwards_through_layer_graphs_read_as_eager(model: DiffusionGemmaForBlockDiffusion) -> None:
    """Two joint forwards of different sizes (324 tokens padded to 352, then 33 to 48: the rows after
    them hold the first forward's values) through one ``LayerGraphs``, each against the eager forward;
    the first again reads as it did (the pieces keep nothing of a forward but their buffers)."""
    config = model.config.text_config
    args = (model.model.decoder, config.layer_types, config.sliding_window)
    pieces = LayerGraphs(max_tokens=512)
    results = []
    for new, parts in ((37, ((5, 5), (3, 2))), (5, ((5, 2),)), (37, ((5, 5), (3, 2)))):
        inputs = joint_inputs(model, new, parts)
        with torch.inference_mode():
            (kv, hidden), (graphed_kv, graphed_hidden) = (
                encode_decode(*args, *inputs),
                encode_decode(*args, *inputs, pieces),
            )
        torch.testing.assert_close(graphed_hidden, hidden, atol=1e-5, rtol=0)
        for (keys, values), (graphed_keys, graphed_values) in zip(kv, graphed_kv, strict=True):
            torch.testing.assert_close(graphed_keys, keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(graphed_values, values, atol=1e-5, rtol=0)
        results.append(graphed_hidden)
    assert torch.equal(results[0], results[2])


def test_a_layout_pads_each_parents_rows_apart() -> None:
    layout = Layout(rows=(4, 3), canvases=(6, 2), real_rows=(3, 3), real_canvases=(5, 2))
    assert layout.sources() == ([0, 1, 2, 0, 3, 4, 5], [0, 1, 2, 3, 4, 0, 5, 6])
    rows, read = layout.real(torch.device("cpu"))
    assert rows.tolist() == [0, 1, 2, 4, 5, 6] and read.tolist() == [0, 1, 2, 3, 4, 6, 7]


def test_padded_states_give_padded_rows_no_canvases_but_a_parts_last_row_its_padded_canvases() -> None:
    # part 0: rows 0-2 read canvases 0-1, 2, 3-4; part 1: rows 3-5 read canvas 5, none, 6
    states = torch.tensor([0, 2, 3, 5, 6, 6, 7], dtype=torch.int32)
    layout = Layout(rows=(4, 3), canvases=(6, 2), real_rows=(3, 3), real_canvases=(5, 2))
    assert _padded_states(states, layout).tolist() == [0, 2, 3, 5, 6, 7, 7, 8]
    one = Layout(rows=(3,), canvases=(6,), real_rows=(3,), real_canvases=(5,))  # no padded row: the last takes them
    assert _padded_states(torch.tensor([0, 2, 3, 5], dtype=torch.int32), one).tolist() == [0, 2, 3, 6]


def test_visible_runs_find_each_states_window_in_the_flat_new_tokens() -> None:
    new = 6
    window = torch.where(torch.arange(new) >= 2, 0.0, MASKED)  # tokens 2..5 visible
    padded_window = torch.tensor([MASKED, 0.0, 0.0, 0.0, 0.0, MASKED])  # 1..4, then padding
    own = torch.stack([window, window, window, padded_window])  # canvases 0-2 read row 0, canvas 3 row 1
    states = torch.tensor([0, 3, 4, 4], dtype=torch.int32)  # row 2 (padding) has no canvases
    starts, counts = visible_runs(own, states)
    assert starts.tolist()[:3] == [2, new + 1, 2 * new] and counts.tolist() == [4, 4, 0]


def test_graph_tokens_pad_each_parents_rows_and_canvases_apart() -> None:
    """Part one: 3 states (5-7 new tokens) of 2 canvases of 4; part two: 5 states (9 new tokens) of one
    canvas of 6. Rows pad to 3 and 6, canvases to 6 and 6, every row to 9 tokens, every canvas to 6."""
    requests, deferred, boundaries = [], {}, {}
    for part, (states, new, canvases, columns) in enumerate([(3, (5, 6, 7), 2, 4), (5, (9,) * 5, 1, 6)]):
        schema = tuple(range(100 * part, 100 * part + 10))
        kv = PrefixKV(keys=(torch.zeros(1, 1, 10, 2),), values=(torch.zeros(1, 1, 10, 2),))
        for state in range(states):
            read = ReadRequest(
                (schema, tuple(range(1000 + 50 * state, 1000 + 50 * state + new[state]))), (1,) * columns, ()
            )
            deferred[read.prompt_ids] = len(schema)
            boundaries[read.prompt_ids] = {len(schema): kv}
            requests += [read] * canvases
    assert read_plan.graph_tokens(requests, deferred, boundaries) == 3 * 9 + 6 * 6 + 6 * 9 + 6 * 6


def test_a_chunk_too_large_for_a_graph_goes_in_forwards_of_whole_parents_that_fit_one() -> None:
    """Four parents of 3 states (9 new tokens) of one canvas of 6 each: a parent's part is 3 x 9 + 3 x 6
    = 45 graph tokens. Within 100, two parents share a forward; within 135, three, then the last alone;
    within 44, none fits, so one each."""
    requests, deferred, boundaries = [], {}, {}
    for part in range(4):
        schema = tuple(range(100 * part, 100 * part + 10))
        kv = PrefixKV(keys=(torch.zeros(1, 1, 10, 2),), values=(torch.zeros(1, 1, 10, 2),))
        for state in range(3):
            read = ReadRequest((schema, tuple(range(1000 + 50 * state, 1009 + 50 * state))), (1,) * 6, ())
            deferred[read.prompt_ids] = len(schema)
            boundaries[read.prompt_ids] = {len(schema): kv}
            requests.append(read)
    chunk = list(range(len(requests)))
    assert read_plan.graph_tokens(requests[:3], deferred, boundaries) == 45
    assert read_plan.by_parent(chunk, requests, deferred, boundaries, 100) == [chunk[:6], chunk[6:]]
    assert read_plan.by_parent(chunk, requests, deferred, boundaries, 135) == [chunk[:9], chunk[9:]]
    assert read_plan.by_parent(chunk, requests, deferred, boundaries, 44) == [chunk[k : k + 3] for k in (0, 3, 6, 9)]
    assert read_plan.by_parent(chunk, requests, deferred, boundaries, 10**6) == [chunk]
