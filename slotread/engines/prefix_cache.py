"""A least-recently-used store of prompt-prefix KV, keyed by the prefix's token ids.

Engines put the per-layer keys and values of an encoded prefix here and look them up by the exact
token ids, so a prefix shared by many reads (a schema, a state) is encoded once. The store is
bounded by bytes, not entries: prefixes differ in length by orders of magnitude.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefixKV:
    """Per-layer keys and values of one encoded prefix, each (1, kv_heads, tokens, head_dim)."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def length(self) -> int:
        """Tokens held (a sliding-window layer may hold fewer than the prefix has; this is the longest)."""
        return max(k.shape[-2] for k in self.keys)

    @property
    def nbytes(self) -> int:
        """Bytes held by all tensors."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class PrefixCache:
    """LRU map from token-id prefixes to their ``PrefixKV``, holding at most ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], PrefixKV] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, ids: tuple[int, ...]) -> PrefixKV | None:
        """The KV stored for exactly these ids, marking it recently used; None if absent."""
        entry = self._entries.get(ids)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(ids)
        return entry

    def put(self, ids: tuple[int, ...], kv: PrefixKV) -> None:
        """Store ``kv`` for ``ids``, evicting the least recently used entries to stay in budget.

        An entry larger than the whole budget is not stored.
        """
        if ids in self._entries:
            self._bytes -= self._entries.pop(ids).nbytes
        if kv.nbytes > self.max_bytes:
            return
        self._entries[ids] = kv
        self._bytes += kv.nbytes
        while self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes currently held."""
        return self._bytes
