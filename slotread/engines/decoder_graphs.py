"""CUDA graphs of the DiffusionGemma decoder step, for canvases that all read one cached prompt.

A decoder step at a few canvases is bound by the CPU, not the GPU: ~1,500 kernel launches through
Python and compiled-function guards take 75-130 ms where the GPU needs ~30 (bench/RESULTS.md). The
common case (K draws of one prompt, or one read whose whole prompt is cached) has a fixed shape per
(rows, canvas width, prompt length), so its step is captured once as a CUDA graph and replayed:
inputs are copied into static buffers, the graph runs every kernel without the CPU.

Rows are padded to a power of two (copies of row 0, whose outputs are dropped) so a few graphs serve
every batch size. A graph holds its own copy of the prompt KV it was captured with, refreshed from
the read's prompt KV before every replay (a device copy, ~0.1 ms for a 1,600-token prompt).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaDecoderModel

from slotread.engines.gemma_forward import SharedPart, decode

logger = logging.getLogger(__name__)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    canvas: torch.Tensor  # (B, C) static inputs
    positions: torch.Tensor
    canvas_bias: torch.Tensor
    part: SharedPart  # static prompt KV, B rows
    hidden: torch.Tensor  # (B, C, H) static output


class DecoderGraphs:
    """Replays captured decoder steps; at most ``max_graphs`` kept, least recently used dropped."""

    def __init__(self, decoder: DiffusionGemmaDecoderModel, layer_types: Sequence[str], max_graphs: int = 8) -> None:
        self._decoder = decoder
        self._layer_types = list(layer_types)
        self._graphs: OrderedDict[tuple[object, ...], _Graph] = OrderedDict()
        self._max_graphs = max_graphs
        self._pool = torch.cuda.graph_pool_handle()
        self.failed = False  # a capture failed once: the engine stays eager

    def decode(
        self, canvas: torch.Tensor, positions: torch.Tensor, canvas_bias: torch.Tensor, part: SharedPart
    ) -> torch.Tensor:
        """``gemma_forward.decode`` for rows that all read ``part`` and nothing else; (B, C, H)."""
        rows = canvas.shape[0]
        padded = 1 << (rows - 1).bit_length()
        key = (padded, canvas.shape[1], tuple(k.shape[-2] for k in part.keys))
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(padded, canvas, positions, canvas_bias, part)
            self._graphs[key] = graph
            while len(self._graphs) > self._max_graphs:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        fill = padded - rows
        graph.canvas.copy_(_pad_rows(canvas, fill))
        graph.positions.copy_(_pad_rows(positions, fill))
        graph.canvas_bias.copy_(_pad_rows(canvas_bias, fill))
        for static, source in zip((*graph.part.keys, *graph.part.values), (*part.keys, *part.values), strict=True):
            static.copy_(source)
        graph.graph.replay()
        return graph.hidden[:rows]

    def _capture(
        self, padded: int, canvas: torch.Tensor, positions: torch.Tensor, canvas_bias: torch.Tensor, part: SharedPart
    ) -> _Graph:
        fill = padded - canvas.shape[0]
        static_canvas = _pad_rows(canvas, fill).clone()
        static_positions = _pad_rows(positions, fill).clone()
        static_bias = _pad_rows(canvas_bias, fill).clone()
        static_part = SharedPart(
            rows=padded,
            keys=tuple(k.clone() for k in part.keys),
            values=tuple(v.clone() for v in part.values),
        )

        def step() -> torch.Tensor:
            return decode(
                self._decoder, self._layer_types, static_canvas, static_positions, static_bias, [static_part], None
            )

        # warm up on a side stream (compiles the fused kernels for these shapes), then capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = step()
        logger.info("captured a decoder graph: %d rows x %d canvas tokens", padded, canvas.shape[1])
        return _Graph(graph, static_canvas, static_positions, static_bias, static_part, hidden)


def _pad_rows(tensor: torch.Tensor, fill: int) -> torch.Tensor:
    """``tensor`` with ``fill`` copies of its first row appended."""
    return tensor if fill == 0 else torch.cat([tensor, tensor[:1].expand(fill, *tensor.shape[1:])])
