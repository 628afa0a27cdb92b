"""DiffusionGemma's encoder and decoder forwards over batches, with cached prompt KV read in place.

The library's attention concatenates each row's cached KV with the new KV in every layer, so a prompt
shared by a batch is copied once per row and layer (20% of a decoder step on an H200 at 64
canvases). Here each layer attends in parts whose results merge exactly (``layer_attention.py``):

* a *shared* part: a cached prompt KV that a run of consecutive rows reads (one batch-1 attention for
  all of their queries, no copy); in the encoder a sliding layer hides, per query, the keys that
  fell out of its window;
* an *own* part, batched over rows: in the decoder each row's own prompt tokens after its shared
  part (if any) and its canvas, bidirectionally; in the encoder the new tokens, causally.

The layers themselves (``layer.py``) use the library's modules' weights in the library's order; the
float32 tests compare with the library's own forward. The encoder skips the last layer's
feed-forward and the final norm: a prompt's KV never reads them. ``encode_decode`` puts new prompt
tokens and the canvases that read them through one forward, as two streams of one token matrix.
Given ``layer_graphs`` (``layer_graphs.py``), a forward runs its layers' work outside attention as
replayed CUDA graph pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from transformers.models.diffusion_gemma.modeling_diffusion_gemma import (
    DiffusionGemmaDecoderModel,
    DiffusionGemmaEncoderTextModel,
)

from slotread.engines.diffusion_gemma.attention import heads_ok
from slotread.engines.diffusion_gemma.inputs import Canvases, JointMasks, NewTokens, OwnPrompt
from slotread.engines.diffusion_gemma.layer import rotary_tables, run_layers
from slotread.engines.diffusion_gemma.layer_attention import (
    canvas_runs,
    decoder_attention,
    encoder_attention,
    joint_canvas_attention,
    visible_runs,
)

if TYPE_CHECKING:  # layer_graphs imports graphs, which imports this module; the engine hands its LayerGraphs in
    from slotread.engines.diffusion_gemma.layer_graphs import LayerGraphs


def decode(
    decoder: DiffusionGemmaDecoderModel,
    layer_types: Sequence[str],
    canvases: Canvases,
    own: OwnPrompt | None,
    conditioning: torch.Tensor | None = None,
    layer_graphs: LayerGraphs | None = None,
) -> torch.Tensor:
    """The decoder's final hidden states (B, C, hidden) for ``canvases``, each row also attending to
    its ``own`` prompt tokens after its shared part. One step; ``conditioning`` (B, C, hidden) is the
    self-conditioning signal (the soft embeddings of the previous step's logits), None a zero one, as
    the library's first step. ``layer_graphs``: run the layers through its graphs (here and below)."""

    def attention(
        index: int, queries: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        own_kv = None if own is None else (own.keys[index], own.values[index], own.bias[index])
        return [decoder_attention(index, queries[0], keys[0], values[0], canvases, own_kv)]

    batch, columns = canvases.tokens.shape
    hidden, rotary = _decoder_input(decoder, layer_types, canvases, conditioning)
    run = run_layers if layer_graphs is None else layer_graphs.run
    hidden = run(decoder, layer_types, hidden, [(batch, columns)], rotary, attention, True)
    return decoder.norm(hidden).view(batch, columns, -1)


def encode(
    encoder: DiffusionGemmaEncoderTextModel,
    layer_types: Sequence[str],
    window: int,
    new: NewTokens,
    layer_graphs: LayerGraphs | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the keys and values (B, kvh, N, d) of the ``new`` tokens.

    A sliding layer's parent KV holds the parent's last ``min(P, window - 1)`` tokens; query ``t``
    sees keys within ``window`` positions of itself, in the parent and among the new tokens alike.
    """
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attention(
        index: int, queries: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        kv.append((keys[0].transpose(1, 2), values[0].transpose(1, 2)))
        blocks = None if new.images is None else new.images.blocks
        return [encoder_attention(index, queries[0], keys[0], values[0], layer_types, window, new.parents, blocks)]

    batch, length = new.tokens.shape
    hidden = encoder.embed_tokens(new.tokens)
    if new.images is not None:  # the features replace the embeddings, as the library's masked_scatter does
        flat = hidden.view(batch * length, -1).index_copy(0, new.images.where, new.images.features.to(hidden.dtype))
        hidden = flat.view(batch, length, -1)
    rotary = rotary_tables(encoder, layer_types, hidden, new.positions)
    # a prompt's KV never reads the last layer's feed-forward
    run = run_layers if layer_graphs is None else layer_graphs.run
    run(encoder, layer_types, hidden.view(batch * length, -1), [(batch, length)], rotary, attention, False)
    return kv


def encode_decode(
    decoder: DiffusionGemmaDecoderModel,
    layer_types: Sequence[str],
    window: int,
    new: NewTokens,
    canvases: Canvases,
    own_rows: torch.Tensor,
    masks: JointMasks,
    layer_graphs: LayerGraphs | None = None,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """``encode`` and ``decode`` in one pass over the layers, for canvases whose own prompt tokens are
    the ``new`` tokens being encoded: canvas row r reads new-token row ``own_rows[r]`` (B_c,), as
    ``masks`` lets it (the engine hides a sliding layer's tokens out of the window, and padding).

    The encoder's layers are the decoder's (tied weights, checked by the engine), so the new tokens
    and the canvases go through every projection, the dense MLP and the experts together: the
    weights are read once, and the launches are those of one forward. Returns ``encode``'s KV and
    ``decode``'s hidden states. New tokens right-padded after a row's own are harmless to it (causal).
    """
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    length = new.tokens.shape[1]  # N
    runs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # per kind: the visible new tokens' runs
    own_runs = canvas_runs(canvases)  # once, not in each layer

    def attention(
        index: int, queries: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        kv.append((keys[0].transpose(1, 2), values[0].transpose(1, 2)))
        encoded = encoder_attention(index, queries[0], keys[0], values[0], layer_types, window, new.parents)
        kind = layer_types[index]
        if masks.states is not None and heads_ok(queries[1], keys[1], False, None):
            if kind not in runs:
                runs[kind] = visible_runs(masks.own[kind], masks.states)
            decoded = joint_canvas_attention(
                index, queries[1], keys, values, canvases, masks.states, runs[kind], own_runs, masks.shared.get(kind)
            )
        else:
            own = (keys[0][own_rows].transpose(1, 2), values[0][own_rows].transpose(1, 2), masks.own[kind])
            decoded = decoder_attention(index, queries[1], keys[1], values[1], canvases, own, masks.shared.get(kind))
        return [encoded, decoded]

    rows, columns = canvases.tokens.shape
    new_hidden = decoder.embed_tokens(new.tokens)
    new_rotary = rotary_tables(decoder, layer_types, new_hidden, new.positions)
    canvas_hidden, canvas_rotary = _decoder_input(decoder, layer_types, canvases)
    hidden = torch.cat([new_hidden.view(new.tokens.numel(), -1), canvas_hidden])
    rotary = {
        kind: (torch.cat([table[0], canvas_rotary[kind][0]]), torch.cat([table[1], canvas_rotary[kind][1]]))
        for kind, table in new_rotary.items()
    }
    streams = [(new.tokens.shape[0], length), (rows, columns)]
    # the new tokens' last feed-forward is wasted work (1/L of theirs), cheaper than a split
    run = run_layers if layer_graphs is None else layer_graphs.run
    hidden = run(decoder, layer_types, hidden, streams, rotary, attention, True)
    return kv, decoder.norm(hidden[new.tokens.numel() :]).view(rows, columns, -1)


def _decoder_input(
    decoder: DiffusionGemmaDecoderModel,
    layer_types: Sequence[str],
    canvases: Canvases,
    conditioning: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The canvases' first hidden states (B * C, hidden) and rotary tables; ``conditioning`` as in ``decode``."""
    embeds = decoder.embed_tokens(canvases.tokens)
    hidden = decoder.self_conditioning(embeds, torch.zeros_like(embeds) if conditioning is None else conditioning)
    return hidden.view(canvases.tokens.numel(), -1), rotary_tables(decoder, layer_types, hidden, canvases.positions)
