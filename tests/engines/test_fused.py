"""The fused steps of a DiffusionGemma layer (``diffusion_gemma.fused``, eager on the CPU) against the
library's own modules of a tiny random-weight layer, in float32: its norms, the query norm with the
rotary embedding, the residual chains around attention and the feed-forward, the gated MLP; and the
torch roads of the attention merge and the expert combine against the sums they stand for.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DiffusionGemmaForBlockDiffusion
from transformers.models.diffusion_gemma.modeling_diffusion_gemma import (
    DiffusionGemmaDecoderTextLayer,
    apply_rotary_pos_emb,
)

from slotread.engines.diffusion_gemma import fused, invariant
from slotread.models.tiny import tiny_diffusion_gemma

TOKENS = 7


@pytest.fixture(scope="module")
def model() -> DiffusionGemmaForBlockDiffusion:
    model = tiny_diffusion_gemma(vocab_size=256, seed=4)
    # random norm weights and scales: the library initialises them to ones, which would hide a swapped weight
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(6)
        for name, parameter in model.named_parameters():
            if "norm" in name or "scale" in name or "scalar" in name:
                parameter.copy_(0.5 + torch.rand_like(parameter))
    return model


@pytest.fixture(scope="module")
def layer(model: DiffusionGemmaForBlockDiffusion) -> DiffusionGemmaDecoderTextLayer:
    layer = model.model.decoder.layers[0]
    assert isinstance(layer, DiffusionGemmaDecoderTextLayer)
    return layer


@pytest.fixture
def hidden(model: DiffusionGemmaForBlockDiffusion) -> torch.Tensor:
    """(TOKENS, hidden) random activations."""
    return torch.randn(TOKENS, model.config.get_text_config().hidden_size, generator=torch.Generator().manual_seed(2))


def test_rms_norm_is_the_librarys(layer: DiffusionGemmaDecoderTextLayer, hidden: torch.Tensor) -> None:
    norm = layer.input_layernorm
    with torch.inference_mode():
        assert torch.allclose(fused.rms_norm(hidden, norm.weight, norm.eps), norm(hidden), atol=1e-6)
        without = layer.router.norm  # the router's norm has no weight
        assert torch.allclose(fused.rms_norm(hidden, None, without.eps), without(hidden), atol=1e-6)


def test_norm_rotary_is_the_librarys_norm_then_rotary(
    model: DiffusionGemmaForBlockDiffusion, layer: DiffusionGemmaDecoderTextLayer, hidden: torch.Tensor
) -> None:
    attn = layer.self_attn
    positions = torch.arange(3, 3 + TOKENS)[None]
    with torch.inference_mode():
        cos, sin = model.model.decoder.rotary_emb(hidden[None], positions, "sliding_attention")  # (1, T, d)
        heads = attn.q_proj(hidden).view(1, TOKENS, -1, attn.head_dim)  # (1, T, H, d)
        want = apply_rotary_pos_emb(attn.q_norm(heads), cos, sin, unsqueeze_dim=2)
        got = fused.norm_rotary(heads, attn.q_norm.weight, attn.q_norm.eps, cos, sin)
    assert torch.allclose(got, want, atol=1e-5)


def test_residual_chains_are_the_library_layers(layer: DiffusionGemmaDecoderTextLayer, hidden: torch.Tensor) -> None:
    """``attention_residual`` and ``feed_forward_residual`` against the library layer's steps after
    attention, in its order (``DiffusionGemmaDecoderTextLayer.forward``), and the gated MLP against its MLP."""
    generator = torch.Generator().manual_seed(3)
    attended = torch.randn(hidden.shape, generator=generator)
    router = layer.router
    with torch.inference_mode():
        residual = hidden + layer.post_attention_layernorm(attended)
        dense = layer.mlp(layer.pre_feedforward_layernorm(residual))
        _, weights, experts = router(residual)
        routed = layer.experts(layer.pre_feedforward_layernorm_2(residual), experts, weights)
        combined = layer.post_feedforward_layernorm_1(dense) + layer.post_feedforward_layernorm_2(routed)
        want = (residual + layer.post_feedforward_layernorm(combined)) * layer.layer_scalar

        got_residual, dense_in, experts_in, router_in = fused.attention_residual(
            hidden,
            attended,
            layer.post_attention_layernorm.weight,
            layer.pre_feedforward_layernorm.weight,
            layer.pre_feedforward_layernorm_2.weight,
            router.scale,
            float(router.scalar_root_size),
            float(router.eps),
        )
        mlp = layer.mlp
        got_dense = invariant.project(
            mlp.down_proj, fused.gated(invariant.project(mlp.gate_proj, dense_in), mlp.up_proj(dense_in), mlp.act_fn)
        )
        probabilities = torch.softmax(router.proj(router_in), dim=-1, dtype=torch.float32)
        top, chosen = torch.topk(probabilities, router.config.top_k_experts, dim=-1)
        got_weights = top / top.sum(dim=-1, keepdim=True) * router.per_expert_scale[chosen]
        got_routed = layer.experts(experts_in, chosen, got_weights)
        got = fused.feed_forward_residual(
            got_residual,
            got_dense,
            got_routed,
            layer.post_feedforward_layernorm_1.weight,
            layer.post_feedforward_layernorm_2.weight,
            layer.post_feedforward_layernorm.weight,
            layer.layer_scalar,
            float(router.eps),
        )
    assert torch.allclose(got_residual, residual, atol=1e-6)
    assert torch.allclose(got_dense, dense, atol=1e-5)
    assert torch.equal(chosen, experts)
    assert torch.allclose(got_weights, weights, atol=1e-6)
    assert torch.allclose(got, want, atol=1e-5)


def test_merge_two_weighs_each_part_by_its_share_of_the_softmax() -> None:
    """Two parts' outputs and log-sum-exps give the attention over both parts' keys."""
    generator = torch.Generator().manual_seed(8)
    query = torch.randn(5, 4, generator=generator)
    keys, values = torch.randn(2, 2, 6, 4, generator=generator)  # two parts of 6 keys each
    scores = [query @ k.T for k in keys]  # each (5, 6)
    outs = [torch.softmax(s, -1) @ v for s, v in zip(scores, values, strict=True)]
    lses = [torch.logsumexp(s, -1) for s in scores]
    want = torch.softmax(torch.cat(scores, -1), -1) @ torch.cat(list(values))
    assert torch.allclose(fused.merge_two(outs[0], lses[0], outs[1], lses[1]), want, atol=1e-6)


def test_combine_sums_each_tokens_weighted_expert_rows() -> None:
    generator = torch.Generator().manual_seed(9)
    tokens, top_k = 4, 3
    rows = torch.randn(tokens * top_k, 5, generator=generator)  # in expert order
    weights = torch.rand(tokens * top_k, generator=generator)  # in token order
    inverse = torch.randperm(tokens * top_k, generator=generator)
    want = torch.stack(
        [sum(weights[t * top_k + j] * rows[inverse[t * top_k + j]] for j in range(top_k)) for t in range(tokens)]
    )
    assert torch.allclose(fused.combine(rows, weights, inverse, top_k), want, atol=1e-6)
