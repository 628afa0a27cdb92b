"""A tiny Dream-style masked-diffusion LM, as remote code.

Tests copy this file into a checkpoint directory whose config.json names it in ``auto_map``, and
load it with ``trust_remote_code`` as a real Dream checkpoint is loaded. Like Dream (a Qwen2.5
transformer trained to denoise [MASK] tokens with bidirectional attention), it keeps the causal
model's shift (the logits at position p predict the token at p + 1), registers its LM under
``AutoModel``, names its mask in the config (``mask_token_id``), and hands ``attention_mask`` (None or
a boolean mask broadcastable to (B, heads, T, T)) to ``scaled_dot_product_attention`` unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput


class TinyDreamConfig(PretrainedConfig):
    model_type = "Dream"

    def __init__(
        self,
        vocab_size: int = 1000,
        hidden_size: int = 32,
        intermediate_size: int = 64,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        max_position_embeddings: int = 512,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.2,
        mask_token_id: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.mask_token_id = mask_token_id
        super().__init__(**kwargs)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of x (B, h, T, d) at positions (T,)."""
    half = x.shape[-1] // 2
    frequencies = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)  # (d/2,)
    angles = positions[:, None].float() * frequencies  # (T, d/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class Block(nn.Module):
    """Pre-norm bidirectional self-attention and a gated SiLU MLP, as in Qwen2."""

    def __init__(self, config: TinyDreamConfig) -> None:
        super().__init__()
        width, self.heads, self.theta = config.hidden_size, config.num_attention_heads, config.rope_theta
        self.attention_norm = nn.RMSNorm(width, eps=config.rms_norm_eps)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width, bias=False)
        self.mlp_norm = nn.RMSNorm(width, eps=config.rms_norm_eps)
        self.gate_up = nn.Linear(width, 2 * config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, width, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, positions, self.theta), rotate(k, positions, self.theta)  # (B, h, T, d)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, width))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TinyDreamModel(PreTrainedModel):
    config_class = TinyDreamConfig
    base_model_prefix = "model"

    def __init__(self, config: TinyDreamConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> MaskedLMOutput:
        x = self.embed(input_ids)  # (B, T, H)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        for block in self.blocks:
            x = block(x, attention_mask, positions)
        return MaskedLMOutput(logits=self.lm_head(self.norm(x)))
