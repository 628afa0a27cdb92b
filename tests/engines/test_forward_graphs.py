"""The CUDA graphs' buckets, on the CPU: a joint forward padded to its bucket reads as the unpadded one.

Capture and replay need a GPU (bench/gpu_reads.py checks them on an H200); the padding they rely on
is plain torch and is checked here, on a tiny random-weight DiffusionGemma in float32.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DiffusionGemmaForBlockDiffusion

from slotread.engines.base import ReadRequest, Slot
from slotread.engines.diffusion_gemma.attention import MASKED
from slotread.engines.diffusion_gemma.engine import DiffusionGemmaEngine
from slotread.engines.diffusion_gemma.forward import encode_decode
from slotread.engines.diffusion_gemma.graphs import _pad_states, bucket, length_bucket, padded
from slotread.engines.diffusion_gemma.inputs import Canvases, JointMasks, NewTokens, SharedPart
from slotread.engines.diffusion_gemma.layer_attention import visible_runs
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


@pytest.mark.parametrize("new", [5, 37])  # within the sliding window's 15 held tokens, and past it
def test_a_padded_joint_forward_reads_as_the_unpadded_one(model: DiffusionGemmaForBlockDiffusion, new: int) -> None:
    generator = torch.Generator().manual_seed(3)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randint(3, GEMMA4_VOCAB_SIZE, shape, generator=generator)

    config = model.config.text_config
    schema = tuple(draw(30).tolist())
    engine = DiffusionGemmaEngine(model)
    engine.read([ReadRequest((schema,), (5, 6), (Slot(0, (7, 8)),))])
    parent = engine.prefix_cache.get(schema)
    assert parent is not None
    held = config.sliding_window - 1
    rows, canvas_rows, columns = 5, 5, 4  # padded to 6 rows, 6 canvas rows; 5 new tokens stay 5, 37 become 38
    own_rows = torch.tensor([0, 1, 1, 4, 3])
    length = len(schema) + new
    skip = max(0, (length - held) - (len(schema) - held))  # the shared sliding keys out of a canvas's window
    inputs = (
        NewTokens(
            draw(rows, new), torch.arange(30, length).expand(rows, -1), [SharedPart(rows, parent.keys, parent.values)]
        ),
        Canvases(
            draw(canvas_rows, columns),
            torch.arange(length, length + columns).expand(canvas_rows, -1),
            torch.tensor([[0.0] * columns] * 4 + [[0.0] * (columns - 1) + [MASKED]]),  # one padded canvas
            [SharedPart(canvas_rows, parent.keys, parent.values)],
        ),
        own_rows,
        JointMasks(
            own={
                "full_attention": torch.zeros(canvas_rows, new),
                "sliding_attention": torch.where(torch.arange(new) >= new - held, 0.0, MASKED).expand(canvas_rows, -1),
            },
            shared={"sliding_attention": torch.where(torch.arange(held) >= skip, 0.0, MASKED).expand(canvas_rows, -1)},
        ),
    )
    args = (model.model.decoder, config.layer_types, config.sliding_window)
    with torch.inference_mode():
        kv, hidden = encode_decode(*args, *inputs)
        padded_inputs = padded(*inputs)
        assert padded_inputs[0].tokens.shape == (6, length_bucket(new)) and padded_inputs[1].tokens.shape == (
            6,
            columns,
        )
        padded_kv, padded_hidden = encode_decode(*args, *padded_inputs)
    torch.testing.assert_close(padded_hidden[:canvas_rows], hidden, atol=1e-5, rtol=0)
    for (keys, values), (padded_keys, padded_values) in zip(kv, padded_kv, strict=True):
        torch.testing.assert_close(padded_keys[:rows, :, :new], keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(padded_values[:rows, :, :new], values, atol=1e-5, rtol=0)


def test_padded_states_have_no_canvases_and_the_last_run_takes_the_padded_canvases() -> None:
    states = torch.tensor([0, 2, 3, 5], dtype=torch.int32)  # 3 new-token rows, 5 canvases
    assert _pad_states(states, 4, 6).tolist() == [0, 2, 3, 5, 6]
    assert _pad_states(states, 3, 6).tolist() == [0, 2, 3, 6]


def test_visible_runs_find_each_states_window_in_the_flat_new_tokens() -> None:
    new = 6
    window = torch.where(torch.arange(new) >= 2, 0.0, MASKED)  # tokens 2..5 visible
    padded_window = torch.tensor([MASKED, 0.0, 0.0, 0.0, 0.0, MASKED])  # 1..4, then padding
    own = torch.stack([window, window, window, padded_window])  # canvases 0-2 read row 0, canvas 3 row 1
    states = torch.tensor([0, 3, 4, 4], dtype=torch.int32)  # row 2 (padding) has no canvases
    starts, counts = visible_runs(own, states)
    assert starts.tolist()[:3] == [2, new + 1, 2 * new] and counts.tolist() == [4, 4, 0]
