"""The DiffusionGemma engine's fast paths as options: which take effect where, the start-up log that lists
them, and the context a read runs them in. The GPU tests (tests/gpu) compare each with its reference road.
"""

from __future__ import annotations

import logging

import pytest
from transformers import DiffusionGemmaForBlockDiffusion

from slotread.decider import make_engine
from slotread.engines.diffusion_gemma.engine import DiffusionGemmaEngine
from slotread.engines.diffusion_gemma.fast_paths import ALL, FastPaths, taken, taking
from slotread.errors import SettingsError
from slotread.models.load import LoadedModel
from slotread.models.tiny import tiny_diffusion_gemma
from slotread.settings import DeciderSettings


@pytest.fixture(scope="module")
def model() -> DiffusionGemmaForBlockDiffusion:
    return tiny_diffusion_gemma(vocab_size=256, seed=0)


def test_on_the_cpu_only_joint_encoding_takes_effect_and_the_log_says_so(
    model: DiffusionGemmaForBlockDiffusion, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="slotread.engines.diffusion_gemma.engine"):
        engine = DiffusionGemmaEngine(model)
    assert engine.fast.on() == ["joint_encode"]
    assert "diffusion_gemma fast paths on: joint_encode" in caplog.messages
    with caplog.at_level(logging.INFO, logger="slotread.engines.diffusion_gemma.engine"):
        off = DiffusionGemmaEngine(model, fast=FastPaths(joint_encode=False))
    assert off.fast.on() == []
    assert "diffusion_gemma fast paths on: none" in caplog.messages


def test_the_deterministic_mode_encodes_prompts_apart(model: DiffusionGemmaForBlockDiffusion) -> None:
    assert DiffusionGemmaEngine(model, deterministic=True).fast.on() == []


def test_a_read_takes_its_engines_fast_paths_and_restores_the_default() -> None:
    assert taken() == ALL
    chosen = FastPaths(cudnn_attention=False)
    with taking(chosen):
        assert taken() == chosen
        with taking(FastPaths(compiled=False)):
            assert not taken().compiled
        assert taken() == chosen
    assert taken() == ALL


def test_a_slow_path_named_in_the_settings_reaches_the_engine(
    tiny_diffusion: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--slow-path`` / ``SLOTREAD_SLOW_PATHS`` leave the named fast paths off; an unknown name is refused
    with the names there are, before anything loads."""

    assert FastPaths.without(["cuda_graphs", "compiled"]).on() == [
        "layer_graphs",
        "joint_encode",
        "cudnn_attention",
        "flash_attention",
        "triton_kernels",
    ]
    monkeypatch.setenv("SLOTREAD_SLOW_PATHS", "joint_encode, compiled")
    settings = DeciderSettings()
    assert settings.slow_paths == ["joint_encode", "compiled"]
    engine = make_engine(tiny_diffusion, slow_paths=settings.slow_paths)
    assert isinstance(engine, DiffusionGemmaEngine) and engine.fast.on() == []
    default = make_engine(tiny_diffusion)
    assert isinstance(default, DiffusionGemmaEngine) and default.fast.on() == ["joint_encode"]
    with pytest.raises(SettingsError, match="no fast path is called graphs; the fast paths: cuda_graphs"):
        DeciderSettings(slow_paths=["graphs"])
