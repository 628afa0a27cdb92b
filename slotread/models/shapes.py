"""Real model shapes with random weights: benchmark the GPU path without a 50 GB checkpoint on disk.

``write_shape`` writes a checkpoint directory holding a real shape's ``config.json`` and the real
tokenizer, and no weights; ``load_model("random:DIR")`` builds that model with random weights drawn on
the device (seconds on a GPU). Its answers are noise: only its speed and memory mean anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the command line imports this module for its names; transformers loads when used
    import torch
    from transformers import DiffusionGemmaConfig

#: The prefix of a model spec whose weights are random (``random:DIR``).
RANDOM_PREFIX = "random:"

#: DiffusionGemma 26B-A4B's text shape (Gemma-4 26B-A4B): 25.2B parameters, 3.8B active per token.
DIFFUSION_GEMMA_26B_A4B: dict[str, Any] = {
    "hidden_size": 2816,
    "intermediate_size": 2112,
    "num_hidden_layers": 30,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "global_head_dim": 512,
    "num_global_key_value_heads": 2,
    "num_experts": 128,
    "top_k_experts": 8,
    "moe_intermediate_size": 704,
    "sliding_window": 1024,
    "max_position_embeddings": 131072,
    "final_logit_softcapping": 30.0,
    "vocab_size": 262144,
}

#: The vision tower of the larger Gemma-4 models, 26B-A4B's: 1152 wide, 16 heads of 72, standardized
#: soft tokens, 16-pixel patches pooled 3x3 (280 soft tokens an image, a 10,240-entry position table, the
#: library's defaults). Depth 27 and MLP width 4304 are SigLIP-so400m's: with Gemma-4's gated MLP they
#: give the ~550M parameters stated for these models' encoder; no released config was readable here to
#: confirm those two.
GEMMA4_LARGE_VISION: dict[str, Any] = {
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 72,
    "patch_size": 16,
    "pooling_kernel_size": 3,
    "position_embedding_size": 10240,
    "standardize": True,
}

#: The shapes ``slotread models shape`` writes, by name: (text shape, vision shape).
SHAPES = {"diffusion-gemma-26b-a4b": (DIFFUSION_GEMMA_26B_A4B, GEMMA4_LARGE_VISION)}


def diffusion_gemma_config(
    shape: dict[str, Any], layers: int | None = None, vision: dict[str, Any] | None = None
) -> DiffusionGemmaConfig:
    """The DiffusionGemma config of a text ``shape`` (``layers`` of them: every sixth and the last full
    attention, the rest sliding, as in the real model) and a ``vision`` tower shape (default: the tiny
    one-layer tower, for text-only measurements)."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaTextConfig
    from transformers.models.gemma4 import Gemma4VisionConfig

    from slotread.models.tiny import TINY_VISION

    count = layers or int(shape["num_hidden_layers"])
    kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(count)]
    kinds[-1] = "full_attention"
    text = DiffusionGemmaTextConfig(
        **{**shape, "num_hidden_layers": count, "layer_types": kinds, "use_bidirectional_attention": "vision"}
    )
    return DiffusionGemmaConfig(text_config=text, vision_config=Gemma4VisionConfig(**(vision or TINY_VISION)))


def write_shape(name: str, out_dir: Path, *, cache_dir: Path | None = None) -> Path:
    """Write ``SHAPES[name]``'s config and the Gemma-4 tokenizer (no weights) into ``out_dir``; returns it."""
    from slotread.models.gemma_tokenizer import gemma_tokenizer

    config = diffusion_gemma_config(*SHAPES[name][:1], vision=SHAPES[name][1])
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    gemma_tokenizer("gemma4", cache_dir=cache_dir).save_pretrained(out_dir)
    return out_dir


def random_weights(model_class: Any, config: Any, device: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """``model_class``'s model of ``config`` (an auto class's ``from_config``) with random weights drawn from
    ``seed`` directly on ``device`` in ``dtype``."""
    import torch

    build = getattr(model_class, "from_config", model_class)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model: torch.nn.Module = build(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)
