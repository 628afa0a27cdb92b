"""Attention in parts (``diffusion_gemma.attention``) against plain grouped-query attention in float64, the
merge of parts over disjoint keys, and when flash attention's window means the engine's rule
(``window_fits``: cases worked out by hand)."""

from __future__ import annotations

import pytest
import torch

from slotread.engines.diffusion_gemma.attention import MASKED, attend, grouped, merge, ungrouped, window_fits


@pytest.mark.parametrize(
    ("queries", "keys", "causal", "left", "fits"),
    [
        (937, 937, True, 1023, True),  # the encoder's own tokens, causal within the window
        (60, 1023, False, 963, True),  # a question's tokens after 1,500 cached instructions (held: 1,023)
        (937, 163, False, 86, False),  # a 937-token segment after a 163-token parent: flash hides all keys from row 0
        (164, 163, False, 10, False),  # one query more than keys
        (390, 4, False, 633, True),  # instructions after the 4-token template head: the window reaches every key
        (163, 163, False, 10, True),
        (5, 9, False, None, True),  # no window: flash's right bound never applies
        (5, 9, False, -3, False),  # a window that hides every key is left to the bias path
    ],
)
def test_window_fits(queries: int, keys: int, causal: bool, left: int | None, fits: bool) -> None:
    assert window_fits(queries, keys, causal, left) is fits


def reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain grouped-query attention, scale 1, in float64: queries (B, L, H, d) against keys and values
    (B, S, kvh, d), each key repeated for its heads, ``visible`` (B, L, S) bool; the output (B, L, H, d)
    and the log-sum-exp (B, L, H)."""
    groups = query.shape[2] // keys.shape[2]
    k = keys.double().repeat_interleave(groups, dim=2)  # head h reads kv head h // groups
    v = values.double().repeat_interleave(groups, dim=2)
    scores = torch.einsum("blhd,bshd->bhls", query.double(), k)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, L)
    out = torch.einsum("bhls,bshd->blhd", torch.softmax(scores, dim=-1), v)
    return out, lse.transpose(1, 2)


def parts_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries (2, 5, 4, 8) of 4 heads over 2 kv heads, keys and values (2, 9, 2, 8), and a random
    visibility (2, 5, 9) in which every query sees at least one key."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(2, 5, 4, 8, generator=generator)
    keys, values = torch.randn(2, 2, 9, 2, 8, generator=generator)
    visible = torch.rand(2, 5, 9, generator=generator) < 0.6
    visible[..., 0] = True
    return query, keys, values, visible


def test_attend_matches_plain_grouped_query_attention() -> None:
    query, keys, values, visible = parts_inputs(0)
    bias = torch.where(visible, 0.0, MASKED)  # (B, L, S): one bias row per query, repeated per head group
    grouped_bias = bias.repeat(1, query.shape[2] // keys.shape[2], 1)[:, None]  # (B, 1, g * L, S)
    out, lse = attend(grouped(query, 2), keys.transpose(1, 2), values.transpose(1, 2), grouped_bias)
    want, want_lse = reference(query, keys, values, visible)
    assert torch.allclose(ungrouped(out, 5).double(), want, atol=1e-5)
    assert torch.allclose(ungrouped(lse, 5).double(), want_lse, atol=1e-5)


def test_parts_over_disjoint_keys_merge_into_the_whole() -> None:
    """Keys split into three parts, one of them empty and one hiding every key from some queries: the
    merged parts equal attention over all the keys."""
    query, keys, values, visible = parts_inputs(1)
    visible[0, 2, 4:] = False  # query 2 of row 0 sees none of the second part's keys
    by_kv_head = grouped(query, 2)
    parts = []
    for span in (slice(0, 4), slice(4, 4), slice(4, 9)):
        bias = torch.where(visible[..., span], 0.0, MASKED).repeat(1, 2, 1)[:, None]
        out, lse = attend(by_kv_head, keys[:, span].transpose(1, 2), values[:, span].transpose(1, 2), bias)
        parts.append((ungrouped(out, 5), ungrouped(lse, 5)))
    want, _ = reference(query, keys, values, visible)
    assert torch.allclose(merge(parts).double(), want, atol=1e-5)


def test_grouped_queries_round_trip() -> None:
    query = torch.randn(3, 7, 6, 4)
    by_kv_head = grouped(query, 2)
    assert by_kv_head.shape == (3, 2, 21, 4)
    assert torch.equal(by_kv_head[:, 1, 7:14], query[:, :, 4])  # kv head 1's second query group: head 4
    assert torch.equal(ungrouped(by_kv_head.contiguous(), 7), query)
