"""CUDA graphs of a forward's layers between its attention calls, keyed by token count alone.

A whole-forward graph (``graphs.py``) is keyed by everything attention sees: parents, rows per
parent, lengths. Mixed traffic rarely repeats those (W2 asked for 144 distinct keys in 153 joint
forwards), so its forwards ran eagerly: ~1,500 launches through Python, the GPU waiting on the host.
Attention is the only part of a layer that looks at the streams; norms, projections, the dense MLP,
the router and the experts work per token on a flat (T, hidden) matrix (``layer.py``). So the
forward is cut at its attention calls: piece 0 is layer 0's work before attention, piece i the rest
of layer i - 1 and layer i's work before attention, the last piece the rest of the last layer. Each
piece is captured once per padded token count (``token_bucket``) and replayed; attention runs
eagerly between them, as in any forward. A forward is then L + 1 replays and its attention calls.

The pieces of every graph read and write one set of static buffers of ``max_tokens`` rows: the
hidden states in two (a piece reads one and writes the other, so running it again, as its warm-up
before capture does, gives the same), queries, keys, values, the attention output and the rotary
tables. Padded rows copy the first real rows everywhere (the input, the rotary tables, each
attention output), so they route to the experts as real tokens do (zeros would all pick the same
eight experts and load them), and their results are dropped. A piece is captured the second time
its key is asked for; before that, and after a capture has failed, it runs eagerly on the same
buffers. Off a GPU nothing is captured: the pieces run eagerly, which the CPU tests use.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers.models.diffusion_gemma.modeling_diffusion_gemma import (
    DiffusionGemmaDecoderModel,
    DiffusionGemmaEncoderTextModel,
)

from slotread.engines.diffusion_gemma.graphs import captured
from slotread.engines.diffusion_gemma.layer import (
    Attend,
    Layer,
    after_attention,
    before_attention,
    by_stream,
    merged,
    rotary_tables,
    run_layers,
)

logger = logging.getLogger(__name__)

Model = DiffusionGemmaDecoderModel | DiffusionGemmaEncoderTextModel


def token_bucket(tokens: int) -> int:
    """``tokens`` rounded up to a multiple of an eighth of the power of two below it, and of 16
    (16, 32, ..., 128, 144, ..., 256, 288, ...): padding is at most an eighth of a forward's tokens
    (or 15), eight token counts per doubling (each L + 1 graphs)."""
    step = 1 << max(4, (tokens - 1).bit_length() - 4)
    return -(-tokens // step) * step


def token_buckets(max_tokens: int) -> list[int]:
    """Every ``token_bucket`` up to ``max_tokens``, in order."""
    buckets = [16]
    while (following := token_bucket(buckets[-1] + 1)) <= max_tokens:
        buckets.append(following)
    return buckets


@dataclass
class _Buffers:
    """The static tensors every piece reads and writes, flat where their width varies by layer kind."""

    hidden: tuple[torch.Tensor, torch.Tensor]  # (max_tokens, hidden) each: a piece reads one, writes the other
    query: torch.Tensor  # flat: (tokens, H, d) views, H * d per token at most
    keys: torch.Tensor
    values: torch.Tensor
    attended: torch.Tensor  # flat: the attention output (tokens, H * d)
    rotary: dict[str, tuple[torch.Tensor, torch.Tensor]]  # per layer kind: cos, sin (max_tokens, d)


class LayerGraphs:
    """Runs ``layer.run_layers`` as captured pieces between eager attention calls (the module
    docstring); forwards of more than ``max_tokens`` tokens run as ``run_layers`` does.

    Every piece captured is kept. Their keys are few by construction: per token bucket up to
    ``max_tokens``, the L + 1 pieces and the last one without its feed-forward (the encoder's, whose
    other pieces are the decoder's: ``share``), 56 x 32 = 1,792 on the 26B-A4B shape at 8,192 tokens;
    and a piece holds only its kernels (the pieces share their buffers, and their memory pool).
    Keeping the last 1,024 used, mixed traffic kept evicting pieces and capturing them again; a server
    captures them all at start-up (``capture``)."""

    def __init__(self, max_tokens: int) -> None:
        self._max_tokens = max_tokens
        self._graphs: dict[tuple[object, ...], torch.cuda.CUDAGraph] = {}
        self._same: dict[int, int] = {}  # a model whose pieces are another's (``share``): by id
        self._asked: set[tuple[object, ...]] = set()  # keys run eagerly once
        self._buffers: _Buffers | None = None
        self._pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None
        self._failed = False  # a capture failed once: every piece runs eagerly from then on
        self.captures = 0  # pieces captured so far
        self.replays = 0  # pieces replayed so far

    def run(
        self,
        model: Model,
        layer_types: Sequence[str],
        hidden: torch.Tensor,
        streams: list[tuple[int, int]],
        rotary: dict[str, tuple[torch.Tensor, torch.Tensor]],
        attention: Attend,
        last_feed_forward: bool,
    ) -> torch.Tensor:
        """``run_layers`` with the same arguments and result, through the pieces."""
        tokens = hidden.shape[0]
        padded = token_bucket(tokens)
        if not tokens or padded > self._max_tokens:
            return run_layers(model, layer_types, hidden, streams, rotary, attention, last_feed_forward)
        layers = [_layer(model, index) for index in range(len(layer_types))]
        buffers = self._buffers_like(layers, hidden, rotary)
        _padded_copy(buffers.hidden[0][:padded], hidden)
        for kind, tables in rotary.items():
            for static, table in zip(buffers.rotary[kind], tables, strict=True):
                _padded_copy(static[:padded], table)
        count = len(layers)
        for piece in range(count + 1):
            feed_forward = last_feed_forward or piece < count  # of the layer before the piece
            key = (self._same.get(id(model), id(model)), piece, padded, feed_forward, hidden.dtype)
            self._run(key, functools.partial(self._piece, layers, layer_types, piece, padded, feed_forward))
            if piece == count:
                break
            query, keys, values = (view[:tokens] for view in _attention_views(buffers, layers[piece], padded))
            # keys and values copied: the next layer's piece overwrites the buffers, and an encoder keeps them
            outputs = attention(piece, *by_stream(streams, query, keys.clone(), values.clone()))
            attended = merged(outputs, streams)
            _padded_copy(buffers.attended[: padded * attended.shape[1]].view(padded, -1), attended)
        return buffers.hidden[count % 2][:tokens].clone()

    def share(self, model: Model, like: Model) -> None:
        """Replay ``like``'s pieces for ``model``, whose layers are tied to ``like``'s (DiffusionGemma's
        encoder and decoder: a piece captured over one reads the same weights as the other's, and
        buffers of equal values; ``fast_paths.tied``): half the captures."""
        self._same[id(model)] = id(like)

    def capture(self, model: Model, layer_types: Sequence[str], last_feed_forward: bool) -> None:
        """Capture every piece of ``model``'s forwards (``last_feed_forward`` as ``run`` takes it) at
        every token bucket now, so that no forward captures one under traffic (W2 at concurrency 32
        on an H200 captured 465 in a 10 s timed phase, its calls 3.4x slower than replayed, bench/
        RESULTS.md). Each bucket runs twice through ``run``: the first asks for its pieces, the second
        captures them. Attention is left out (its output is the queries): the pieces' kernels do not
        depend on what flows through them."""
        param = next(model.parameters())
        if not param.is_cuda or self._failed:
            return
        positions = torch.arange(self._max_tokens, device=param.device)
        embed = model.embed_tokens
        hidden = embed(positions % embed.num_embeddings)  # varied tokens: the experts route as in real traffic
        rotary = rotary_tables(model, layer_types, hidden[None], positions[None])
        for tokens in token_buckets(self._max_tokens):
            tables = {kind: (cos[:tokens], sin[:tokens]) for kind, (cos, sin) in rotary.items()}
            for _ in range(2):
                self.run(model, layer_types, hidden[:tokens], [(1, tokens)], tables, _queries, last_feed_forward)

    def _piece(self, layers: list[Layer], layer_types: Sequence[str], piece: int, padded: int, ff: bool) -> None:
        """Piece ``piece`` over the buffers' first ``padded`` rows: the rest of layer ``piece - 1``
        (``ff``: with its feed-forward), then layer ``piece``'s work before attention."""
        buffers = self._buffers
        assert buffers is not None
        hidden = buffers.hidden[0][:padded]
        if piece:
            layer = layers[piece - 1]
            width = layer.self_attn.o_proj.in_features
            attended = buffers.attended[: padded * width].view(padded, width)
            hidden = after_attention(layer, buffers.hidden[(piece - 1) % 2][:padded], attended, ff)
            buffers.hidden[piece % 2][:padded].copy_(hidden)
        if piece < len(layers):
            cos, sin = buffers.rotary[layer_types[piece]]
            outputs = before_attention(layers[piece], hidden, cos[:padded], sin[:padded])
            for static, output in zip(_attention_views(buffers, layers[piece], padded), outputs, strict=True):
                static.copy_(output)

    def _run(self, key: tuple[object, ...], piece: Callable[[], None]) -> None:
        """``piece()`` through its graph: replayed if captured, captured if asked for before (on a
        GPU), else run eagerly."""
        graph = self._graphs.get(key)
        if graph is None:
            cuda = self._buffers is not None and self._buffers.query.is_cuda
            if self._failed or not cuda or key not in self._asked:
                self._asked.add(key)
                piece()
                return
            try:
                graph, _ = captured(piece, self._pool)
            except RuntimeError:  # a kernel that cannot be captured here: eager from now on
                logger.warning("CUDA graph capture of a layer piece failed; running eagerly", exc_info=True)
                self._failed = True
                piece()
                return
            self.captures += 1
            self._graphs[key] = graph
        graph.replay()
        self.replays += 1

    def _buffers_like(
        self, layers: list[Layer], hidden: torch.Tensor, rotary: dict[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> _Buffers:
        """The static buffers for ``layers`` over ``hidden`` and ``rotary``'s dtypes and device, allocated
        on first use (and again, dropping the graphs captured over the old ones, if those change)."""
        widths = [(layer.self_attn.q_proj.out_features, layer.self_attn.k_proj.out_features) for layer in layers]
        query_width, kv_width = max(q for q, _ in widths), max(k for _, k in widths)
        buffers = self._buffers
        if (
            buffers is None
            or buffers.hidden[0].dtype != hidden.dtype
            or buffers.hidden[0].device != hidden.device
            or buffers.hidden[0].shape[1] != hidden.shape[1]
            or buffers.query.numel() < self._max_tokens * query_width
            or buffers.keys.numel() < self._max_tokens * kv_width
            or any(_unlike(buffers.rotary.get(kind), tables) for kind, tables in rotary.items())
        ):
            rows = self._max_tokens
            buffers = _Buffers(
                hidden=(hidden.new_zeros((rows, hidden.shape[1])), hidden.new_zeros((rows, hidden.shape[1]))),
                query=hidden.new_zeros(rows * query_width),
                keys=hidden.new_zeros(rows * kv_width),
                values=hidden.new_zeros(rows * kv_width),
                attended=hidden.new_zeros(rows * query_width),
                rotary={
                    kind: (cos.new_zeros((rows, *cos.shape[1:])), sin.new_zeros((rows, *sin.shape[1:])))
                    for kind, (cos, sin) in rotary.items()
                },
            )
            self._buffers = buffers
            self._graphs.clear()  # captured over the old buffers
        return buffers


def _queries(
    index: int, queries: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor]
) -> list[torch.Tensor]:
    """An ``Attend`` that returns the queries, shaped as attention's output (``capture``)."""
    return queries


def _unlike(static: tuple[torch.Tensor, torch.Tensor] | None, tables: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether rotary buffers ``static`` cannot hold ``tables`` (none yet, another width or dtype)."""
    return static is None or any(
        s.shape[1:] != t.shape[1:] or s.dtype != t.dtype or s.device != t.device
        for s, t in zip(static, tables, strict=True)
    )


def _layer(model: Model, index: int) -> Layer:
    layer = model.layers[index]
    assert isinstance(layer, Layer)
    return layer


def _attention_views(buffers: _Buffers, layer: Layer, padded: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The query (padded, H, d), keys and values (padded, kvh, d) buffers of ``layer``."""
    attn = layer.self_attn
    dim = attn.head_dim
    query_width, kv_width = attn.q_proj.out_features, attn.k_proj.out_features
    return (
        buffers.query[: padded * query_width].view(padded, query_width // dim, dim),
        buffers.keys[: padded * kv_width].view(padded, kv_width // dim, dim),
        buffers.values[: padded * kv_width].view(padded, kv_width // dim, dim),
    )


def _padded_copy(static: torch.Tensor, source: torch.Tensor) -> None:
    """``source`` (T, ...) into ``static``'s first T rows, and its rows again, in order and over again
    where needed, into the rest (the padding)."""
    tokens, fill = source.shape[0], static.shape[0] - source.shape[0]
    static[:tokens].copy_(source)
    if fill:
        again = torch.arange(fill, device=source.device) % tokens if fill > tokens else slice(fill)
        static[tokens:].copy_(source[again])
