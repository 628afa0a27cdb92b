"""Tiny random-weight DiffusionGemma models for tests: the real architecture, shrunk.

DiffusionGemma 26B-A4B is a Gemma-4 mixture-of-experts text model (sliding-window and full-attention
layers, full layers with a larger head and keys reused as values, a dense MLP beside top-k routed
experts, final logit softcap 30) used twice: as a causal encoder of the prompt and as a bidirectional
decoder of the canvas. The tiny one keeps every one of those parts, with sizes small enough that a
checkpoint is a few tens of MB (the 262,144-entry embedding, tied to ``lm_head``, dominates:
262,144 x 32 float32 is 32 MiB). Its weights are random: it tests plumbing and maths, never answers.

The transformers config needs a ``vision_config``, so a one-layer vision tower comes along.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DiffusionGemmaTextConfig
from transformers.models.gemma4 import Gemma4VisionConfig

#: Gemma-4's vocabulary size (the tokenizer DiffusionGemma shares).
GEMMA4_VOCAB_SIZE = 262_144

_TINY_TEXT: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    # sliding layers first and a full-attention layer last, as in the real 5:1 pattern
    "num_hidden_layers": 3,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    # full-attention layers use their own head size and kv-head count, as in the real model
    "global_head_dim": 16,
    "num_global_key_value_heads": 1,
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 16,
    # small, so tests can push prompts past it; the real model's window is 1024
    "sliding_window": 16,
    "max_position_embeddings": 4096,
    "final_logit_softcapping": 30.0,
    "use_bidirectional_attention": "vision",
    # larger than the library's 0.02 so random logits spread over several units and the softcap bends
    "initializer_range": 0.2,
}

#: A one-layer vision tower: the config needs one; text reads never run it.
TINY_VISION: dict[str, Any] = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "patch_size": 4,
    "position_embedding_size": 64,
    "pooling_kernel_size": 2,
}


def tiny_diffusion_gemma_config(vocab_size: int = GEMMA4_VOCAB_SIZE, **overrides: Any) -> DiffusionGemmaConfig:
    """The tiny DiffusionGemma config; ``overrides`` replace text-config fields (e.g. ``sliding_window=8``)."""
    text_fields = {**_TINY_TEXT, "vocab_size": vocab_size, **overrides}
    text_config = DiffusionGemmaTextConfig(**text_fields)
    return DiffusionGemmaConfig(
        text_config=text_config,
        vision_config=Gemma4VisionConfig(**TINY_VISION),
        initializer_range=text_config.initializer_range,
        # the canvas length of the library's own generate loop; reads choose their own canvas
        canvas_length=32,
    )


def tiny_diffusion_gemma(
    vocab_size: int = GEMMA4_VOCAB_SIZE,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> DiffusionGemmaForBlockDiffusion:
    """A tiny DiffusionGemma with random weights drawn from ``seed``, in eval mode, on the CPU.

    The global torch RNG is left as it was.
    """
    config = tiny_diffusion_gemma_config(vocab_size, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DiffusionGemmaForBlockDiffusion(config)
    # transformers 5.17 wraps PreTrainedModel.to in a decorator whose signature mypy misreads
    return model.to(dtype).eval()  # type: ignore[arg-type]
