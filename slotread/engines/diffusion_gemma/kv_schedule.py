"""Which prompt KV a read call needs, and in what order the encoder writes it.

A prompt is always encoded segment by segment, each segment continuing its parent's KV, so its KV is
the same whether or not a prefix was cached. For one call:

1. ``resume``: each distinct prompt resumes from its longest boundary (a segment's end) held by the
   ``PrefixCache``; the boundaries after it are left to encode;
2. ``deferrable``: a prompt whose last segment is left, after a parent, that no other prompt of the
   call continues and whose reads fit one decoder forward has that segment encoded in the forward of
   its canvases (``forward.encode_decode``, the ``joint_encode`` fast path) instead: isolated
   questions after one schema then take one forward for their state and canvases instead of two;
3. ``encode_waves``: the segments left are encoded in waves, one segment per prompt per wave (a
   boundary prefix two prompts share is encoded once), a wave's rows batched by ``encoder_batches``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from itertools import groupby

from slotread.engines.base import ReadRequest
from slotread.engines.diffusion_gemma.graphs import length_bucket
from slotread.engines.prefix_cache import PrefixCache, PrefixKV

Ids = tuple[int, ...]
#: per prompt, the KV at each boundary this call found cached or encoded
Found = dict[Ids, dict[int, PrefixKV]]
#: per boundary prefix to encode next, its parent's length and KV (None: encoded from the start)
Rows = dict[Ids, tuple[int, PrefixKV | None]]


def resume(requests: Sequence[ReadRequest], cache: PrefixCache) -> tuple[Found, dict[Ids, list[int]]]:
    """For each distinct prompt, the longest cached boundary's KV, and the boundary ends still to
    encode after it, in order."""
    found: Found = {}
    todo: dict[Ids, list[int]] = {}
    for request in requests:
        segments, ids = request.prompt, request.prompt_ids
        if ids in found:
            continue
        ends = sorted({sum(len(s) for s in segments[: k + 1]) for k in range(len(segments))} - {0})
        found[ids] = {}
        for position, end in enumerate(reversed(ends)):
            if (kv := cache.get(ids[:end])) is not None:
                found[ids][end] = kv
                ends = ends[len(ends) - position :]
                break
        todo[ids] = ends
    return found, todo


def deferrable(
    requests: Sequence[ReadRequest], found: Found, todo: dict[Ids, list[int]], max_canvases: int
) -> dict[Ids, int]:
    """The prompts whose last segment can be encoded in the same forward as their canvases, each with
    the end of its parent segment (which the canvases then read in place as their shared part): the
    segment is still to encode, it has a parent, no other prompt of the call continues from it, the
    prompt's reads fit one decoder forward (``max_canvases``), and they hold no image (encoded by
    ``forward.encode`` alone) and take one denoise step (more are ``denoise.py``'s)."""
    inner = {ids[:end] for ids, ends in todo.items() for end in ends if end < len(ids)}
    reads = Counter(request.prompt_ids for request in requests)
    seeing = {request.prompt_ids for request in requests if request.images}
    stepped = {request.prompt_ids for request in requests if request.steps > 1}
    deferred = {}
    for ids, ends in todo.items():
        apart = ids in seeing or ids in stepped
        if not ends or ends[-1] != len(ids) or ids in inner or reads[ids] > max_canvases or apart:
            continue
        boundaries = sorted({*found[ids], *ends})
        if len(boundaries) > 1:
            deferred[ids] = boundaries[-2]
    return deferred


def encode_waves(found: Found, todo: dict[Ids, list[int]], encode: Callable[[Rows], dict[Ids, PrefixKV]]) -> None:
    """Encode every boundary ``todo`` holds, a wave at a time (``encode``: the KV of each row's whole
    prefix), and record each in ``found``; ``todo`` is emptied."""
    while any(todo.values()):
        rows: Rows = {}
        for ids, ends in todo.items():
            if ends:
                parent = max(found[ids], default=0)
                rows[ids[: ends[0]]] = (parent, found[ids].get(parent))
        encoded = encode(rows)
        for ids, ends in todo.items():
            if ends:
                found[ids][ends[0]] = encoded[ids[: ends[0]]]
                ends.pop(0)


def encoder_batches(rows: Rows, max_encode_tokens: int) -> Iterable[list[Ids]]:
    """Rows that can share one encoder forward: new lengths in one ``length_bucket`` (shorter rows
    right-padded, which their causal attention never sees), all with or all without a parent, at
    most ``max_encode_tokens`` new tokens together."""

    def key(prefix: Ids) -> tuple[int, bool]:
        return length_bucket(len(prefix) - rows[prefix][0]), rows[prefix][1] is None

    for (new, _), run in groupby(sorted(rows, key=key), key=key):
        # rows sharing a parent adjacent, equal lengths adjacent (``assemble.kv_entries`` joins such runs at once)
        group = sorted(run, key=lambda prefix: (id(rows[prefix][1]), len(prefix)))
        size = max(1, max_encode_tokens // new)
        for start in range(0, len(group), size):
            yield group[start : start + size]
