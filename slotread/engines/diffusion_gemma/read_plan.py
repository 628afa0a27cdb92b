"""How each read takes its prompt's KV, and which reads share a decoder forward.

* ``split``: a read's prompt is split at its shortest available boundary of at least ``shared_min``
  tokens: the rows whose prompts share that boundary read its KV in place, in one attention for all
  of them, and each row reads its own prompt tokens after it (``inputs.OwnPrompt``);
* ``decoder_chunks``: the reads whose prompt KV is all stored, rows sharing a prompt KV adjacent,
  similar own lengths together, one number of denoise steps and at most ``max_canvases`` a forward;
* ``joint_chunks``: the reads whose last segment is encoded with their canvases, in forwards of
  segments of similar lengths; ``graph_tokens`` counts such a forward's tokens padded to its CUDA
  graph's buckets, and ``by_parent`` splits one too large for a graph into forwards of whole parents.

Sliding-window layers: a sliding layer's prompt KV holds the prompt's last ``window - 1`` tokens, and
the decoder attends to all of them and to the whole canvas (the window is anchored at the end of the
prompt, not at each canvas token): ``sliding_skip`` is where that run starts in a shared part's KV.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import groupby

from slotread.engines.base import ReadRequest
from slotread.engines.diffusion_gemma.graphs import bucket, length_bucket
from slotread.engines.prefix_cache import PrefixKV

Ids = tuple[int, ...]
#: per prompt, the KV at each boundary found cached or encoded (``kv_schedule.Found``)
Boundaries = dict[Ids, dict[int, PrefixKV]]

#: A read's prompt is split at its shortest cached boundary of at least this many tokens: the KV
#: before it is read in place by every row sharing it, the tokens after it are copied per row.
SHARED_MIN = 256

#: A joint forward pads its states to its longest one's ``length_bucket``: at most this share of its new
#: tokens may be padding, so that states of different lengths share a forward without wasting much.
PAD_SHARE = 0.25


@dataclass(frozen=True)
class SplitRead:
    """How one request reads its prompt KV: ``shared`` (the first ``split`` tokens) read in place,
    starting ``skip`` tokens into a sliding layer's, then its own tokens from ``full``."""

    shared: PrefixKV
    full: PrefixKV
    split: int
    length: int
    skip: int
    order_key: tuple[object, ...]


def sliding_skip(length: int, split: int, window: int) -> int:
    """Where a sliding layer's read of a prompt of ``length`` tokens split at ``split`` starts in the
    shared part's KV: the layer reads prompt positions [length - window + 1, length) and the shared KV
    holds positions [split - held, split), ``window`` being the config's ``sliding_window``."""
    held = window - 1  # prompt tokens a sliding layer holds and reads
    return max(0, (length - held) - (split - min(split, held)))


def split(request: ReadRequest, boundaries: dict[int, PrefixKV], shared_min: int, window: int) -> SplitRead:
    """Split the request's prompt into the shared part (the shortest available boundary of at least
    ``shared_min`` tokens, so a schema cached once is read in place by every state after it) and its
    own tokens after that boundary."""
    length = len(request.prompt_ids)
    at = min((end for end in boundaries if end >= min(length, shared_min)), default=length)
    shared, full = boundaries[at], boundaries[length]
    skip = sliding_skip(length, at, window)
    return SplitRead(shared, full, at, length, skip, (id(shared), skip, length - at, id(full)))


def parent_of(request: ReadRequest, deferred: dict[Ids, int], boundaries: Boundaries) -> PrefixKV:
    """The KV that a request's deferred last segment continues (its canvases' shared part)."""
    ids = request.prompt_ids
    return boundaries[ids][deferred[ids]]


def decoder_chunks(
    indices: list[int], requests: list[ReadRequest], reads: dict[int, SplitRead], max_canvases: int
) -> Iterable[list[int]]:
    """The reads of ``indices`` in decoder forwards: one number of denoise steps a forward, rows sharing
    a prompt KV adjacent (one shared part), similar own lengths together, at most ``max_canvases``."""
    order = sorted(indices, key=lambda i: (requests[i].steps, reads[i].order_key))
    for _, run in groupby(order, key=lambda i: requests[i].steps):
        same = list(run)
        for start in range(0, len(same), max_canvases):
            yield same[start : start + max_canvases]


def joint_chunks(
    indices: list[int],
    requests: list[ReadRequest],
    deferred: dict[Ids, int],
    boundaries: Boundaries,
    max_canvases: int,
    max_encode_tokens: int,
) -> Iterable[list[int]]:
    """The requests whose last prompt segment is encoded with their canvases, in forwards of segments
    of similar lengths: taken shortest first, a forward holds at most ``max_canvases`` canvases and
    ``max_encode_tokens`` new tokens, counted padded to its longest segment's ``length_bucket``, of
    which at most ``PAD_SHARE`` padding (or one prompt). In a forward a prompt's requests are
    together and prompts continuing one parent adjacent (one shared part)."""
    # each prompt as the index of its first request (comparing and hashing the 1,600-id tuples over
    # and over cost milliseconds per call), with its requests and segment length
    reads: dict[int, list[int]] = {}
    first: dict[Ids, int] = {}
    for index in indices:
        reads.setdefault(first.setdefault(requests[index].prompt_ids, index), []).append(index)

    def new(prompt: int) -> int:
        ids = requests[prompt].prompt_ids
        return len(ids) - deferred[ids]

    def parent(prompt: int) -> tuple[int, int]:
        # by length first: the same parents then come in the same order in every call, and so do a
        # CUDA graph's parts (its key)
        return deferred[requests[prompt].prompt_ids], id(parent_of(requests[prompt], deferred, boundaries))

    chunk: list[int] = []  # prompts
    canvases = tokens = 0
    for prompt in sorted(reads, key=new):
        rows, width = len(chunk) + 1, length_bucket(new(prompt))  # the longest so far
        padded = rows * width
        too_many = (
            canvases + len(reads[prompt]) > max_canvases
            or padded > max_encode_tokens
            or padded - tokens - new(prompt) > PAD_SHARE * padded
        )
        if chunk and too_many:
            yield [index for p in sorted(chunk, key=parent) for index in reads[p]]
            chunk, canvases, tokens = [], 0, 0
        chunk.append(prompt)
        canvases += len(reads[prompt])
        tokens += new(prompt)
    if chunk:
        yield [index for p in sorted(chunk, key=parent) for index in reads[p]]


def graph_tokens(batch: list[ReadRequest], deferred: dict[Ids, int], boundaries: Boundaries) -> int:
    """The tokens of ``batch``'s joint forward (its reads' prompts adjacent, by parent) padded to its
    CUDA graph's buckets (``graphs.Layout``): per parent, its prompts' new-token rows and its canvases
    each to their ``bucket``, the rows to the longest new segment's ``length_bucket``, the canvases to
    the longest canvas."""
    width = length_bucket(max(len(r.prompt_ids) - deferred[r.prompt_ids] for r in batch))
    columns = max(len(r.canvas) for r in batch)
    tokens = 0
    for _, run in groupby(batch, key=lambda r: id(parent_of(r, deferred, boundaries))):
        reads = list(run)
        tokens += bucket(len({r.prompt_ids for r in reads})) * width + bucket(len(reads)) * columns
    return tokens


def by_parent(
    chunk: list[int], requests: list[ReadRequest], deferred: dict[Ids, int], boundaries: Boundaries, limit: int
) -> list[list[int]]:
    """A joint chunk (prompts continuing one parent adjacent) too large for a CUDA graph, as forwards of
    whole parents' runs: consecutive parents together while their forward's ``graph_tokens`` stay
    within ``limit`` (a parent over it alone), so each part may replay a graph. Eager forwards over a
    few canvases are bound by their launches (165 ms for 3 parents on an H200 host, where one graph
    replay of a parent takes ~20 ms), and every forward reads every expert's weights: one forward per
    parent gave mixed traffic ~12 forwards a call (W2's ~14 parents), whose keys rarely repeat."""
    parts: list[list[int]] = []
    for _, group in groupby(chunk, key=lambda i: id(parent_of(requests[i], deferred, boundaries))):
        run = list(group)
        if parts and graph_tokens([requests[i] for i in parts[-1] + run], deferred, boundaries) <= limit:
            parts[-1] += run
        else:
            parts.append(run)
    return parts
