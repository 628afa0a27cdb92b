"""CUDA graphs of DiffusionGemma forwards at small batches: a decoder step over one cached prompt,
and a joint step that encodes new states after one or more cached prompts with their canvases.

At a few canvases a forward is bound by the CPU, not the GPU: ~1,500 kernel launches through Python
and compiled-function guards take 75-130 ms where the GPU needs ~30 (bench/RESULTS.md). These common
cases have a fixed shape per bucket, so each bucket's forward is captured once as a CUDA graph and
replayed: inputs are copied into static buffers, the graph runs every kernel without the CPU.

Buckets: rows are padded to a power of two or three quarters of one (``bucket``), in a joint step
each parent's rows and canvases apart (``Layout``: a decision's isolated questions continue three
cached prompts, one part each), and a joint step's new tokens per row to a sixteenth of a power of
two (``length_bucket``), so a few graphs serve every batch. Padded rows copy their part's first row
and their outputs are dropped; padded new tokens come after a row's own, which causal attention
hides from them, and the canvases' masks hide them in turn. A graph reads static copies of the
prompt KV, refreshed before a replay unless they hold that prompt already (a device copy, ~0.1 ms
for a 1,600-token prompt). A bucket is captured the second time it is asked for: a shape seen once
runs eagerly rather than paying a capture. After a capture the process's objects are frozen out of
the cycle collector (``_settle``): what compiling leaves behind made a full collection a 260-410 ms
stall.
"""

from __future__ import annotations

import gc
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaDecoderModel

from slotread.engines.diffusion_gemma.attention import MASKED
from slotread.engines.diffusion_gemma.forward import decode, encode_decode
from slotread.engines.diffusion_gemma.inputs import Canvases, JointMasks, NewTokens, SharedPart, on_device

logger = logging.getLogger(__name__)

KV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]  # static: copied into before each replay
    outputs: Any  # static: what the captured forward returned
    shared: list[tuple[object, ...]]  # its prompt KV statics, which other graphs share (``ForwardGraphs._shared``)


class ForwardGraphs:
    """Replays captured forwards; at most ``max_graphs`` kept, least recently used dropped, and
    captured on a bucket's second use (the last ``max_graphs * 8`` buckets asked for are counted).

    What a graph holds is mostly shared, so that many fit: a prompt KV is copied into static tensors
    that every graph with a prompt of that shape in that place reads (``_shared``; a replay copies its
    own prompt in first, unless it is there already), and a joint forward's new KV is written into
    one buffer of ``max_tokens`` tokens per layer that all graphs write (``_kv_out``), copied out
    after each replay. A graph's own tensors are its small inputs and the pool's intermediates, which
    graphs share as they replay one at a time. (W1 at concurrency 32 on an H200 asked for ~40
    buckets, each graph then holding its own ~220 MB prompt copy and up to ~400 MB of KV outputs: 32
    were kept, and evicted and captured again in turn under traffic.)

    A forward that cannot be captured here (a kernel that refuses capture) returns None, and so does
    every forward after it: the caller runs it eagerly."""

    def __init__(
        self,
        decoder: DiffusionGemmaDecoderModel,
        layer_types: Sequence[str],
        window: int,
        max_tokens: int,
        max_graphs: int = 128,
    ) -> None:
        self._decoder = decoder
        self._layer_types = list(layer_types)
        self._window = window
        self._max_tokens = max_tokens
        self._graphs: OrderedDict[tuple[object, ...], _Graph] = OrderedDict()
        self._asked: OrderedDict[tuple[object, ...], None] = OrderedDict()  # keys run eagerly once
        self._max_graphs = max_graphs
        self._shared: dict[tuple[object, ...], torch.Tensor] = {}  # prompt KV statics by (part, index, shape)
        self._users: Counter[tuple[object, ...]] = Counter()  # graphs reading each of ``_shared``
        self._loaded: dict[tuple[object, ...], tuple[object, torch.Tensor]] = {}  # what each holds (``_load``)
        self._kv_out: list[torch.Tensor] = []  # per layer, keys then values: flat buffers of ``max_tokens`` tokens
        self._pool = torch.cuda.graph_pool_handle()
        self._failed = False  # a capture failed once: every caller stays eager
        self.replays = 0  # graphs replayed so far (the benchmark checks that its graphed reads were)
        self.captures = 0  # graphs captured so far (the server's benchmark counts those under traffic)

    def decode(self, canvases: Canvases) -> torch.Tensor | None:
        """``forward.decode`` for canvases that all read one shared part and nothing else; (B, C, H)."""
        (part,) = canvases.shared
        rows = canvases.tokens.shape[0]
        padded = bucket(rows)
        inputs = [_pad_rows(t, padded) for t in (canvases.tokens, canvases.positions, canvases.bias)]

        def forward(static: list[torch.Tensor], kv: list[list[torch.Tensor]]) -> torch.Tensor:
            shared = SharedPart(padded, *_split(kv[0]))
            return decode(self._decoder, self._layer_types, Canvases(static[0], static[1], static[2], [shared]), None)

        key = ("decode", padded, canvases.tokens.shape[1])
        hidden: torch.Tensor | None = self._replay(key, inputs, [_joined(part)], forward)
        return None if hidden is None else hidden[:rows]

    def encode_decode(
        self, new: NewTokens, canvases: Canvases, own_rows: torch.Tensor, masks: JointMasks
    ) -> tuple[KV, torch.Tensor] | None:
        """``forward.encode_decode`` for new tokens continuing one or more parents, the canvases'
        shared parts in the same order (each parent's canvases read it), through the graph of its
        buckets (``padded``); None where the parts do not pair up."""
        layout = Layout.of(new, canvases)
        length = new.tokens.shape[1]
        if layout is None or sum(layout.rows) * length_bucket(length) > self._max_tokens:
            return None
        new, canvases, own_rows, masks = padded(new, canvases, own_rows, masks, layout)
        kinds, shared_kinds = sorted(masks.own), sorted(masks.shared)
        tensors = [new.tokens, new.positions, canvases.tokens, canvases.positions, canvases.bias, own_rows]
        states = [] if masks.states is None else [masks.states]
        inputs = [
            *tensors,
            *(masks.own[kind] for kind in kinds),
            *(masks.shared[kind] for kind in shared_kinds),
            *states,
        ]
        own_at, shared_at = len(tensors), len(tensors) + len(kinds)
        states_at = shared_at + len(shared_kinds)

        def forward(static: list[torch.Tensor], kv: list[list[torch.Tensor]]) -> tuple[KV, torch.Tensor]:
            own = dict(zip(kinds, static[own_at:shared_at], strict=True))
            shared = dict(zip(shared_kinds, static[shared_at:states_at], strict=True))
            parents = [SharedPart(rows, *_split(part)) for rows, part in zip(layout.rows, kv, strict=True)]
            read = [SharedPart(rows, *_split(part)) for rows, part in zip(layout.canvases, kv, strict=True)]
            encoded, hidden = encode_decode(
                self._decoder,
                self._layer_types,
                self._window,
                NewTokens(static[0], static[1], parents),
                Canvases(static[2], static[3], static[4], read),
                static[5],
                JointMasks(own, shared, static[states_at] if states else None),
            )
            return self._written(encoded), hidden

        key = ("encode_decode", layout.rows, layout.canvases, *(tuple(t.shape) for t in inputs))
        replayed = self._replay(key, inputs, [_joined(part) for part in new.parents], forward)
        if replayed is None:
            return None
        kv, hidden = replayed
        rows, read = layout.real(own_rows.device)
        # copies: the next replay overwrites the graph's outputs, and the prefix cache keeps these
        kv = [(k[:, :, :length].index_select(0, rows), v[:, :, :length].index_select(0, rows)) for k, v in kv]
        return kv, hidden.index_select(0, read)

    def _written(self, kv: KV) -> KV:
        """``kv`` (per layer (B, kvh, N, d)) copied into the shared output buffers (``_kv_out``); views of them."""
        if not self._kv_out:  # allocated on the first forward, outside any capture (its warm-up)
            self._kv_out = [
                torch.empty(self._max_tokens * t.shape[1] * t.shape[3], dtype=t.dtype, device=t.device)
                for t in _flat(kv)
            ]
        written = []
        for tensor, buffer in zip(_flat(kv), self._kv_out, strict=True):
            rows, heads, tokens, dim = tensor.shape
            view = buffer[: tensor.numel()].view(rows, tokens, heads, dim).transpose(1, 2)
            view.copy_(tensor)
            written.append(view)
        return list(zip(written[0::2], written[1::2], strict=True))

    def _replay(
        self,
        key: tuple[object, ...],
        inputs: list[torch.Tensor],
        kv: list[list[torch.Tensor]],
        forward: Callable[[list[torch.Tensor], list[list[torch.Tensor]]], Any],
    ) -> Any:
        """``forward`` of ``inputs`` and the prompt KV ``kv`` (per part: every layer's keys, then
        values) through the graph captured for ``key`` (captured now if asked for before); None the
        first time, and once a capture has failed."""
        if self._failed:
            return None
        key = (*key, *(tuple(t.shape) for part in kv for t in part))
        graph = self._graphs.get(key)
        if graph is None and key not in self._asked:
            self._asked[key] = None
            while len(self._asked) > self._max_graphs * 8:
                self._asked.popitem(last=False)
            return None
        try:
            if graph is None:
                graph = self._capture(key, inputs, kv, forward)
                self._graphs[key] = graph
                while len(self._graphs) > self._max_graphs:
                    self._dropped(self._graphs.popitem(last=False)[1])
        except RuntimeError:  # a kernel that cannot be captured here: eager from now on
            logger.warning("CUDA graph capture failed; running eagerly", exc_info=True)
            self._failed = True
            return None
        for static, source in zip(graph.inputs, inputs, strict=True):
            static.copy_(source)
        for name, source in zip(graph.shared, (t for part in kv for t in part), strict=True):
            self._load(name, source)
        self._graphs.move_to_end(key)
        graph.graph.replay()
        self.replays += 1
        return graph.outputs

    def _capture(
        self,
        key: tuple[object, ...],
        inputs: list[torch.Tensor],
        kv: list[list[torch.Tensor]],
        forward: Callable[[list[torch.Tensor], list[list[torch.Tensor]]], Any],
    ) -> _Graph:
        static = [t.clone() for t in inputs]
        shared: list[tuple[object, ...]] = [
            (part, index, tuple(t.shape), t.dtype) for part, tensors in enumerate(kv) for index, t in enumerate(tensors)
        ]
        for name, tensor in zip(shared, (t for part in kv for t in part), strict=True):
            if name not in self._shared:
                self._shared[name] = torch.empty_like(tensor)
            self._load(name, tensor)
            self._users[name] += 1
        prompts = [[self._shared[name] for name in shared if name[0] == part] for part in range(len(kv))]
        graph, outputs = captured(lambda: forward(static, prompts), self._pool)
        logger.info("captured a CUDA graph: %s", key[:4])
        self.captures += 1
        return _Graph(graph, static, outputs, shared)

    def _load(self, name: tuple[object, ...], source: torch.Tensor) -> None:
        """Copy a prompt's KV tensor into its shared static unless that holds it already: cached KV
        is never written again, and ``_loaded`` keeps the source alive, so its storage, shape and
        strides name its values (W1's three questions' prompts: 180 copies a call saved)."""
        signature = (source.data_ptr(), tuple(source.shape), source.stride())
        loaded = self._loaded.get(name)
        if loaded is None or loaded[0] != signature:
            self._shared[name].copy_(source)
            self._loaded[name] = (signature, source)

    def _dropped(self, graph: _Graph) -> None:
        """Forget what only ``graph`` (evicted) read of the shared statics."""
        for name in graph.shared:
            self._users[name] -= 1
            if not self._users[name]:
                del self._users[name], self._shared[name]
                self._loaded.pop(name, None)


def captured(run: Callable[[], Any], pool: Any) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``run()`` captured as a CUDA graph in ``pool``, and what it returned (tensors the graph writes
    on each replay): run twice first on a side stream (compiling the fused kernels for these shapes),
    then captured; then ``_settle``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = run()
    _settle()
    return graph, outputs


def _settle() -> None:
    """Move every object alive now out of the cycle collector's generations, for good: compiling and
    capturing leave ~600k objects (functions, guards, graphs) that live as long as the process, and a
    full collection scanning them took 260-410 ms, once every ~40 batches at (d) c=32 on an H200 host
    (2.6 ms once frozen). Garbage first, so that no cycle is frozen with them."""
    gc.collect()
    gc.freeze()


@dataclass(frozen=True)
class Layout:
    """Where a joint forward's rows go in its graph: each part's new-token rows (one per state) and
    its canvas rows padded to their ``bucket``, parts in order (``rows``, ``canvases``: padded counts
    per part; ``real_*``: the real ones)."""

    rows: tuple[int, ...]
    canvases: tuple[int, ...]
    real_rows: tuple[int, ...]
    real_canvases: tuple[int, ...]

    @classmethod
    def of(cls, new: NewTokens, canvases: Canvases) -> Layout | None:
        """The layout of a joint forward's inputs; None where its canvases' parts are not its parents'."""
        if len(new.parents) != len(canvases.shared):
            return None
        rows = tuple(part.rows for part in new.parents)
        read = tuple(part.rows for part in canvases.shared)
        return cls(tuple(map(bucket, rows)), tuple(map(bucket, read)), rows, read)

    def sources(self) -> tuple[list[int], list[int]]:
        """For each padded new-token row and canvas row, the real row it copies (padding copies its
        part's first)."""
        return _sources(self.rows, self.real_rows), _sources(self.canvases, self.real_canvases)

    def real(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the real new-token rows and canvas rows sit among the padded ones (int64 on ``device``)."""
        return (
            on_device(device, _places(self.rows, self.real_rows), torch.int64),
            on_device(device, _places(self.canvases, self.real_canvases), torch.int64),
        )


def padded(
    new: NewTokens, canvases: Canvases, own_rows: torch.Tensor, masks: JointMasks, layout: Layout
) -> tuple[NewTokens, Canvases, torch.Tensor, JointMasks]:
    """A joint forward's inputs padded to ``layout``, its new tokens per row to their ``length_bucket``.
    Padded rows copy their part's first row and their outputs are dropped; a part's padded canvases
    belong to its last row (``JointMasks.states``)."""
    length, device = new.tokens.shape[1], new.tokens.device
    padded_length = length_bucket(length)
    row_sources, canvas_sources = (on_device(device, s, torch.int64) for s in layout.sources())
    steps = torch.arange(padded_length, device=device)
    new = NewTokens(
        F.pad(new.tokens, (0, padded_length - length)).index_select(0, row_sources),
        (new.positions[:, :1] + steps).index_select(0, row_sources),
        [SharedPart(size, part.keys, part.values) for size, part in zip(layout.rows, new.parents, strict=True)],
    )
    canvases = Canvases(
        canvases.tokens.index_select(0, canvas_sources),
        canvases.positions.index_select(0, canvas_sources),
        canvases.bias.index_select(0, canvas_sources),
        [SharedPart(size, part.keys, part.values) for size, part in zip(layout.canvases, canvases.shared, strict=True)],
    )
    row_places = on_device(device, _places(layout.rows, layout.real_rows), own_rows.dtype)
    masks = JointMasks(
        own={
            kind: F.pad(bias, (0, padded_length - length), value=MASKED).index_select(0, canvas_sources)
            for kind, bias in masks.own.items()
        },
        shared={kind: bias.index_select(0, canvas_sources) for kind, bias in masks.shared.items()},
        states=None if masks.states is None else _padded_states(masks.states, layout),
    )
    return new, canvases, row_places[own_rows.index_select(0, canvas_sources)], masks


def bucket(size: int) -> int:
    """The smallest power of two, or three quarters of one, at or above ``size`` (1, 2, 3, 4, 6, 8,
    12, ...): at most a third wasted, two graphs per doubling."""
    power = 1 << (size - 1).bit_length()
    return power * 3 // 4 if power >= 4 and size <= power * 3 // 4 else power


def length_bucket(size: int) -> int:
    """``size`` new tokens per row rounded up to a multiple of a sixteenth of the power of two below
    it (..., 64, 68, 72, ..., 128, 136, ...): every padded token costs a token's whole forward, so at
    most a sixteenth is wasted (a 100-token state stays 100; ``bucket`` would give 128, 22% of a
    32-state decision batch's tokens), sixteen graphs per doubling, each captured only once asked
    for twice."""
    step = 1 << max(0, (size - 1).bit_length() - 5)
    return -(-size // step) * step


def _padded_states(states: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``JointMasks.states`` for the padded rows: each real row's canvases where they moved, padded
    rows none, and a part's padded canvases in the run of its last row (padded or not), whose
    outputs are dropped."""
    pieces, row, canvas, padded = [], 0, 0, 0
    for rows, real_rows, canvases, real_canvases in zip(
        layout.rows, layout.real_rows, layout.canvases, layout.real_canvases, strict=True
    ):
        pieces.append(states[row : row + real_rows] + (padded - canvas))  # a device add: no host sync
        pieces.append(states.new_full((rows - real_rows,), padded + real_canvases))
        row, canvas, padded = row + real_rows, canvas + real_canvases, padded + canvases
    return torch.cat([*pieces, states.new_full((1,), padded)])


def _sources(padded: tuple[int, ...], real: tuple[int, ...]) -> list[int]:
    """For each padded row, the real row it copies: a part's own rows, then its first row again."""
    sources: list[int] = []
    start = 0
    for size, count in zip(padded, real, strict=True):
        sources += [*range(start, start + count), *[start] * (size - count)]
        start += count
    return sources


def _places(padded: tuple[int, ...], real: tuple[int, ...]) -> list[int]:
    """Where each real row sits among the padded ones."""
    places: list[int] = []
    start = 0
    for size, count in zip(padded, real, strict=True):
        places += range(start, start + count)
        start += size
    return places


def _joined(part: SharedPart) -> list[torch.Tensor]:
    """A prompt KV as one list: every layer's keys, then its values."""
    return [*part.keys, *part.values]


def _split(tensors: list[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """``_joined``'s list as (keys, values) per layer."""
    layers = len(tensors) // 2
    return tuple(tensors[:layers]), tuple(tensors[layers:])


def _flat(kv: KV) -> list[torch.Tensor]:
    """Per layer keys then values, as one list."""
    return [tensor for pair in kv for tensor in pair]


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with copies of its first row appended up to ``rows`` rows."""
    fill = rows - tensor.shape[0]
    return tensor if fill == 0 else torch.cat([tensor, tensor[:1].expand(fill, *tensor.shape[1:])])
