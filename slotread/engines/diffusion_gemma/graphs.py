"""CUDA graphs of DiffusionGemma forwards at small batches: a decoder step over one cached prompt,
and a joint step that encodes new states after one cached prompt with their canvases.

At a few canvases a forward is bound by the CPU, not the GPU: ~1,500 kernel launches through Python
and compiled-function guards take 75-130 ms where the GPU needs ~30 (bench/RESULTS.md). These common
cases have a fixed shape per bucket, so each bucket's forward is captured once as a CUDA graph and
replayed: inputs are copied into static buffers, the graph runs every kernel without the CPU.

Buckets: rows are padded to a power of two or three quarters of one (``bucket``), a joint step's
new tokens per row to a sixteenth of a power of two (``length_bucket``), so a few graphs serve every
batch. Padded rows copy row 0 and their outputs are dropped; padded new tokens come after a row's
own, which causal attention hides from them, and the canvases' masks hide them in turn. A graph holds
its own copy of the prompt KV it was captured with, refreshed before every replay (a device copy,
~0.1 ms for a 1,600-token prompt). A bucket is captured the second time it is asked for: a shape
seen once runs eagerly rather than paying a capture and evicting a graph in use. After a capture the
process's objects are frozen out of the cycle collector (``_settle``): what compiling leaves behind
made a full collection a 260-410 ms stall.
"""

from __future__ import annotations

import gc
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaDecoderModel

from slotread.engines.diffusion_gemma.attention import MASKED
from slotread.engines.diffusion_gemma.forward import decode, encode_decode
from slotread.engines.diffusion_gemma.inputs import Canvases, JointMasks, NewTokens, SharedPart

logger = logging.getLogger(__name__)

KV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]  # static: copied into before each replay
    outputs: Any  # static: what the captured forward returned


class ForwardGraphs:
    """Replays captured forwards; at most ``max_graphs`` kept, least recently used dropped, and
    captured on a bucket's second use (the last ``max_graphs * 8`` buckets asked for are counted).

    A forward that cannot be captured here (a kernel that refuses capture) returns None, and so does
    every forward after it: the caller runs it eagerly."""

    def __init__(
        self, decoder: DiffusionGemmaDecoderModel, layer_types: Sequence[str], window: int, max_graphs: int = 32
    ) -> None:
        self._decoder = decoder
        self._layer_types = list(layer_types)
        self._window = window
        self._graphs: OrderedDict[tuple[object, ...], _Graph] = OrderedDict()
        self._asked: OrderedDict[tuple[object, ...], None] = OrderedDict()  # keys run eagerly once
        self._max_graphs = max_graphs
        self._pool = torch.cuda.graph_pool_handle()
        self._failed = False  # a capture failed once: every caller stays eager
        self.replays = 0  # graphs replayed so far (the benchmark checks that its graphed reads were)
        self.captures = 0  # graphs captured so far (the server's benchmark counts those under traffic)

    def decode(self, canvases: Canvases) -> torch.Tensor | None:
        """``forward.decode`` for canvases that all read one shared part and nothing else; (B, C, H)."""
        (part,) = canvases.shared
        rows = canvases.tokens.shape[0]
        padded = bucket(rows)
        layers = len(part.keys)
        inputs = [_pad_rows(t, padded) for t in (canvases.tokens, canvases.positions, canvases.bias)]

        def forward(static: list[torch.Tensor]) -> torch.Tensor:
            shared = SharedPart(padded, tuple(static[3 : 3 + layers]), tuple(static[3 + layers :]))
            return decode(self._decoder, self._layer_types, Canvases(static[0], static[1], static[2], [shared]), None)

        key = ("decode", padded, canvases.tokens.shape[1], tuple(k.shape[-2] for k in part.keys))
        hidden: torch.Tensor | None = self._replay(key, [*inputs, *part.keys, *part.values], forward)
        return None if hidden is None else hidden[:rows]

    def encode_decode(
        self, new: NewTokens, canvases: Canvases, own_rows: torch.Tensor, masks: JointMasks
    ) -> tuple[KV, torch.Tensor] | None:
        """``forward.encode_decode`` for new tokens that all continue one parent, which is also
        the canvases' one shared part, through the graph of its bucket (``padded``)."""
        (rows, length), canvas_rows = new.tokens.shape, canvases.tokens.shape[0]
        new, canvases, own_rows, masks = padded(new, canvases, own_rows, masks)
        (part,) = new.parents
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
        states_at, fixed, layers = shared_at + len(shared_kinds), len(inputs), len(part.keys)

        def forward(static: list[torch.Tensor]) -> tuple[KV, torch.Tensor]:
            keys, values = tuple(static[fixed : fixed + layers]), tuple(static[fixed + layers :])
            own = dict(zip(kinds, static[own_at:shared_at], strict=True))
            shared = dict(zip(shared_kinds, static[shared_at:states_at], strict=True))
            return encode_decode(
                self._decoder,
                self._layer_types,
                self._window,
                NewTokens(static[0], static[1], [SharedPart(part.rows, keys, values)]),
                Canvases(static[2], static[3], static[4], [SharedPart(canvases.shared[0].rows, keys, values)]),
                static[5],
                JointMasks(own, shared, static[states_at] if states else None),
            )

        shapes = tuple(tuple(tensor.shape) for tensor in (*inputs, *part.keys))
        replayed = self._replay(("encode_decode", *shapes), [*inputs, *part.keys, *part.values], forward)
        if replayed is None:
            return None
        kv, hidden = replayed
        # copies: the next replay overwrites the graph's outputs, and the prefix cache keeps these
        return [(k[:rows, :, :length].clone(), v[:rows, :, :length].clone()) for k, v in kv], hidden[:canvas_rows]

    def _replay(
        self, key: tuple[object, ...], inputs: list[torch.Tensor], forward: Callable[[list[torch.Tensor]], Any]
    ) -> Any:
        """``forward`` of ``inputs`` through the graph captured for ``key`` (captured now if asked for
        before); None the first time, and once a capture has failed."""
        if self._failed:
            return None
        graph = self._graphs.get(key)
        if graph is None and key not in self._asked:
            self._asked[key] = None
            while len(self._asked) > self._max_graphs * 8:
                self._asked.popitem(last=False)
            return None
        try:
            if graph is None:
                graph = self._capture(key, inputs, forward)
                self._graphs[key] = graph
                while len(self._graphs) > self._max_graphs:
                    self._graphs.popitem(last=False)
        except RuntimeError:  # a kernel that cannot be captured here: eager from now on
            logger.warning("CUDA graph capture failed; running eagerly", exc_info=True)
            self._failed = True
            return None
        for static, source in zip(graph.inputs, inputs, strict=True):
            static.copy_(source)
        self._graphs.move_to_end(key)
        graph.graph.replay()
        self.replays += 1
        return graph.outputs

    def _capture(
        self, key: tuple[object, ...], inputs: list[torch.Tensor], forward: Callable[[list[torch.Tensor]], Any]
    ) -> _Graph:
        static = [t.clone() for t in inputs]
        # warm up on a side stream (compiles the fused kernels for these shapes), then capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                forward(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = forward(static)
        logger.info("captured a CUDA graph: %s", key)
        self.captures += 1
        _settle()
        return _Graph(graph, static, outputs)


def _settle() -> None:
    """Move every object alive now out of the cycle collector's generations, for good: compiling and
    capturing leave ~600k objects (functions, guards, graphs) that live as long as the process, and a
    full collection scanning them took 260-410 ms, once every ~40 batches at (d) c=32 on an H200 host
    (2.6 ms once frozen). Garbage first, so that no cycle is frozen with them."""
    gc.collect()
    gc.freeze()


def padded(
    new: NewTokens, canvases: Canvases, own_rows: torch.Tensor, masks: JointMasks
) -> tuple[NewTokens, Canvases, torch.Tensor, JointMasks]:
    """A joint forward's inputs (new tokens continuing one parent, the canvases' one shared part)
    padded to their bucket: rows and canvas rows by ``bucket``, new tokens by ``length_bucket``. Its outputs' first
    rows and new tokens are the unpadded forward's."""
    (part,), (canvas_part,) = new.parents, canvases.shared
    (rows, length), canvas_rows = new.tokens.shape, canvases.tokens.shape[0]
    padded_rows, padded_length, padded_canvases = bucket(rows), length_bucket(length), bucket(canvas_rows)
    steps = torch.arange(padded_length, device=new.tokens.device)
    new = NewTokens(
        _pad_rows(F.pad(new.tokens, (0, padded_length - length)), padded_rows),
        _pad_rows(new.positions[:, :1] + steps, padded_rows),
        [SharedPart(padded_rows, part.keys, part.values)],
    )
    canvases = Canvases(
        _pad_rows(canvases.tokens, padded_canvases),
        _pad_rows(canvases.positions, padded_canvases),
        _pad_rows(canvases.bias, padded_canvases),
        [SharedPart(padded_canvases, canvas_part.keys, canvas_part.values)],
    )
    masks = JointMasks(
        own={
            kind: _pad_rows(F.pad(bias, (0, padded_length - length), value=MASKED), padded_canvases)
            for kind, bias in masks.own.items()
        },
        shared={kind: _pad_rows(bias, padded_canvases) for kind, bias in masks.shared.items()},
        states=None if masks.states is None else _pad_states(masks.states, padded_rows, padded_canvases),
    )
    return new, canvases, _pad_rows(own_rows, padded_canvases), masks


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


def _pad_states(states: torch.Tensor, rows: int, canvases: int) -> torch.Tensor:
    """``JointMasks.states`` for ``rows`` new-token rows and ``canvases`` canvas rows: padded rows
    have no canvases but the last row's run takes the padded canvases (their outputs are dropped)."""
    padded = torch.cat([states, states[-1:].expand(rows + 1 - states.shape[0])])
    padded[-1:].fill_(canvases)  # not ``padded[-1] = canvases``: a copy from a host scalar waits for the GPU
    return padded


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with copies of its first row appended up to ``rows`` rows."""
    fill = rows - tensor.shape[0]
    return tensor if fill == 0 else torch.cat([tensor, tensor[:1].expand(fill, *tensor.shape[1:])])
