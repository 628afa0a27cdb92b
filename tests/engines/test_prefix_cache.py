"""The prefix cache's entries: joined entries read as the parent's KV then the new tokens'."""

from __future__ import annotations

import torch

from slotread.engines.prefix_cache import PrefixCache, PrefixKV


def kv(rows: int, tokens: int, seed: int) -> torch.Tensor:
    """Random (rows, kv_heads=2, tokens, head_dim=4) keys or values."""
    return torch.randn(rows, 2, tokens, 4, generator=torch.Generator().manual_seed(seed))


def test_joined_rows_hold_the_parent_then_their_own_tokens_as_each_layer_keeps() -> None:
    # two layers: one keeps 5 tokens (a sliding window), one everything
    parent = PrefixKV(keys=(kv(1, 4, 0), kv(1, 7, 1)), values=(kv(1, 4, 2), kv(1, 7, 3)))
    new_keys, new_values = (kv(3, 2, 4), kv(3, 2, 5)), (kv(3, 2, 6), kv(3, 2, 7))
    rows = PrefixKV.joined(parent, new_keys, new_values, keep=(5, 1000))

    assert len(rows) == 3
    per_token = 2 * 4 * 4 * 2  # kv heads x head dim x float32 bytes x (keys, values)
    assert all(row.nbytes == (5 + 9) * per_token for row in rows)  # before joining: what it will hold
    for r, row in enumerate(rows):
        for layer, keep in enumerate((5, 1000)):
            whole_keys = torch.cat([parent.keys[layer], new_keys[layer][r : r + 1]], dim=2)
            whole_values = torch.cat([parent.values[layer], new_values[layer][r : r + 1]], dim=2)
            torch.testing.assert_close(row.keys[layer], whole_keys[:, :, -keep:], rtol=0, atol=0)
            torch.testing.assert_close(row.values[layer], whole_values[:, :, -keep:], rtol=0, atol=0)
    assert all(row.nbytes == (5 + 9) * per_token for row in rows)


def test_joined_rows_without_a_parent_keep_their_last_tokens() -> None:
    keys, values = (kv(2, 6, 0),), (kv(2, 6, 1),)
    rows = PrefixKV.joined(None, keys, values, keep=(4,))
    for r, row in enumerate(rows):
        torch.testing.assert_close(row.keys[0], keys[0][r : r + 1, :, 2:], rtol=0, atol=0)
        torch.testing.assert_close(row.values[0], values[0][r : r + 1, :, 2:], rtol=0, atol=0)


def test_the_cache_counts_joined_entries_at_their_joined_size() -> None:
    parent = PrefixKV(keys=(kv(1, 10, 0),), values=(kv(1, 10, 1),))
    rows = PrefixKV.joined(parent, (kv(2, 3, 2),), (kv(2, 3, 3),), keep=(1000,))
    per_entry = 13 * 2 * 4 * 4 * 2
    cache = PrefixCache(max_bytes=per_entry + per_entry // 2)
    cache.put((1,), rows[0])
    cache.put((2,), rows[1])  # over budget: the first is evicted
    assert cache.nbytes == per_entry and cache.get((1,)) is None and cache.get((2,)) is rows[1]
