"""A least-recently-used store of prompt-prefix KV, keyed by the prefix's token ids.

Engines put the per-layer keys and values of an encoded prefix here and look them up by the exact
token ids, so a prefix shared by many reads (a schema, a state) is encoded once. The store is
bounded by bytes, not entries: prefixes differ in length by orders of magnitude.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

#: one tensor per layer
Layers = tuple[torch.Tensor, ...]


class PrefixKV:
    """Per-layer keys and values of one encoded prefix, each (1, kv_heads, tokens, head_dim).

    Entries made by ``joined`` (rows that continue one parent) hold the parent's entry and their new
    tokens' KV, and join them on the first use of any row's ``keys`` or ``values``, all rows in one
    copy per layer, keeping each layer's last ``keep`` tokens: a state read once, in the forward
    that encoded it, never pays the copy (240 MB for a 1,600-token prompt of the 26B-A4B shape).
    ``nbytes`` is the joined size either way.
    """

    def __init__(self, keys: Layers, values: Layers) -> None:
        self._keys, self._values = keys, values
        self._lengths = tuple(k.shape[-2] for k in keys)
        self._bytes_per_token = _bytes_per_token(keys)
        self._pending: tuple[_Join, int] | None = None

    @classmethod
    def joined(cls, parent: PrefixKV | None, keys: Layers, values: Layers, keep: tuple[int, ...]) -> list[PrefixKV]:
        """One entry per row of new tokens with ``keys``/``values`` (B, kvh, N, d) per layer, each
        ``parent``'s tokens then its own, each layer keeping its last ``keep`` tokens."""
        held = parent._lengths if parent is not None else (0,) * len(keys)
        lengths = tuple(min(k, h + n.shape[-2]) for k, h, n in zip(keep, held, keys, strict=True))
        join = _Join(parent, keys, values, lengths)
        bytes_per_token = _bytes_per_token(keys)
        entries = []
        for row in range(keys[0].shape[0]):
            # no per-row tensors until joined: slicing 30 layers' keys and values for 48 rows took 5 ms
            # of host time (this CPU), for states most of which are never read again
            entry = cls.__new__(cls)
            entry._keys = entry._values = ()
            entry._lengths, entry._bytes_per_token, entry._pending = lengths, bytes_per_token, (join, row)
            entries.append(entry)
        return entries

    @property
    def keys(self) -> Layers:
        self._join()
        return self._keys

    @property
    def values(self) -> Layers:
        self._join()
        return self._values

    @property
    def nbytes(self) -> int:
        """Bytes held by all tensors once joined."""
        return sum(n * b for n, b in zip(self._lengths, self._bytes_per_token, strict=True))

    def _join(self) -> None:
        if self._pending is None:
            return
        join, row = self._pending
        keys, values = join.result()
        # each row views its row of the run's tensors (evicting it frees the run's bytes only once
        # every row of the run is evicted)
        self._keys = tuple(k[row : row + 1] for k in keys)
        self._values = tuple(v[row : row + 1] for v in values)
        self._pending = None


def _bytes_per_token(keys: Layers) -> tuple[int, ...]:
    """Per layer, the bytes one token's keys and values take."""
    return tuple(k.shape[1] * k.shape[-1] * k.element_size() * 2 for k in keys)


class _Join:
    """The joined KV of rows continuing one parent, computed once for all of them."""

    def __init__(self, parent: PrefixKV | None, keys: Layers, values: Layers, lengths: tuple[int, ...]) -> None:
        self._inputs: tuple[PrefixKV | None, Layers, Layers] | None = (
            parent,
            keys,
            values,
        )
        self._lengths = lengths
        self._result: tuple[Layers, Layers] = ((), ())

    def result(self) -> tuple[Layers, Layers]:
        if self._inputs is not None:
            parent, keys, values = self._inputs
            old_keys = parent.keys if parent is not None else (None,) * len(keys)
            old_values = parent.values if parent is not None else (None,) * len(values)
            self._result = (
                tuple(_tail(o, n, k) for o, n, k in zip(old_keys, keys, self._lengths, strict=True)),
                tuple(_tail(o, n, k) for o, n, k in zip(old_values, values, self._lengths, strict=True)),
            )
            self._inputs = None  # the parent and the new tokens' tensors are free to go
        return self._result


def _tail(old: torch.Tensor | None, new: torch.Tensor, length: int) -> torch.Tensor:
    """Per row, the last ``length`` tokens of ``old`` (1, kvh, P, d) then ``new`` (B, kvh, N, d),
    in one new tensor (B, kvh, length, d)."""
    from_new = min(length, new.shape[-2])
    out = new.new_empty((*new.shape[:-2], length, new.shape[-1]))
    if old is not None and length > from_new:
        out[..., : length - from_new, :] = old[..., old.shape[-2] - (length - from_new) :, :]
    out[..., length - from_new :, :] = new[..., new.shape[-2] - from_new :, :]
    return out


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
