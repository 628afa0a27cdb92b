"""Real shapes with random weights: ``slotread models shape`` and ``load_model("random:DIR")``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from slotread.errors import ModelLoadError
from slotread.models.load import load_model, load_tokenizer
from slotread.models.shapes import DIFFUSION_GEMMA_26B_A4B, GEMMA4_LARGE_VISION, write_shape


def test_a_written_shape_holds_the_real_config_and_tokenizer_and_no_weights(tmp_path: Path, cache_dir: Path) -> None:
    out = write_shape("diffusion-gemma-26b-a4b", tmp_path / "dg26", cache_dir=cache_dir)
    text = json.loads((out / "config.json").read_text())["text_config"]
    shown = {k: text[k] for k in DIFFUSION_GEMMA_26B_A4B if k in text}
    assert shown == {k: DIFFUSION_GEMMA_26B_A4B[k] for k in shown} and len(shown) >= 12
    assert text["layer_types"].count("full_attention") == 5 and text["layer_types"][-1] == "full_attention"
    assert not list(out.glob("*.safetensors"))
    tokenizer = load_tokenizer(f"random:{out}")
    assert (tokenizer.family, tokenizer.vocab_size) == ("diffusion", 262_144)


def test_random_weights_are_drawn_without_reading_any(tiny_diffusion_dir: Path, tmp_path: Path) -> None:
    """A copy of the tiny checkpoint without its weights loads as ``random:``, drawn from seed 0 as the
    tiny checkpoint's own were; loaded plainly it is refused."""
    for file in tiny_diffusion_dir.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, tmp_path / file.name)
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path))
    drawn = load_model(f"random:{tmp_path}", dtype=torch.float32)
    saved = load_model(str(tiny_diffusion_dir))
    assert drawn.name == f"random:{tmp_path}" and drawn.family == "diffusion"
    shape = ("num_hidden_layers", "hidden_size", "num_experts", "vocab_size", "sliding_window", "layer_types")
    mine, theirs = drawn.model.config.get_text_config(), saved.model.config.get_text_config()
    assert all(getattr(mine, name) == getattr(theirs, name) for name in shape)
    for (name, weight), (_, stored) in zip(
        drawn.model.state_dict().items(), saved.model.state_dict().items(), strict=True
    ):
        assert torch.equal(weight, stored), name


def test_random_needs_a_checkpoint_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no registry model, directory or file"):
        load_model(f"random:{tmp_path / 'nothing'}")


def test_the_26b_shape_carries_the_large_vision_tower(tmp_path: Path, cache_dir: Path) -> None:
    config = json.loads(
        (write_shape("diffusion-gemma-26b-a4b", tmp_path / "dg26", cache_dir=cache_dir) / "config.json").read_text()
    )
    vision = config["vision_config"]
    assert {k: vision[k] for k in GEMMA4_LARGE_VISION} == GEMMA4_LARGE_VISION
    # an image's tokens attend to each other both ways in the real model's encoder
    assert config["text_config"]["use_bidirectional_attention"] == "vision"
