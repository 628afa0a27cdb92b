"""The DiffusionGemma engine: every slot of a canvas read in one decoder step.

DiffusionGemma (transformers ``DiffusionGemmaForBlockDiffusion``, 5.17) uses one set of weights twice:
a causal *encoder* writes the prompt into a KV cache, and a *decoder* attends bidirectionally over
that cache plus the canvas and predicts the clean token at every canvas position (no shift). There
is no mask token: the model was trained to denoise uniform random token ids. A read:

1. encodes each distinct prompt once, segment by segment, into a ``DynamicCache`` and keeps the KV
   of every segment boundary in the ``PrefixCache``; a prompt is always encoded segment by segment,
   so its KV (and every result) is the same whether or not a prefix was cached;
2. noises the canvas: each slot's token becomes a noise token (``noise_canvas``, from the request's
   seed; a request without a seed is read as given);
3. runs one decoder step, without self-conditioning, over a batch of canvases against their
   prompts' KV: prompt KV left-padded to the batch's longest prompt (one prompt shared by the whole
   batch is an ``expand`` view), canvases right-padded, a 2D mask over ``prompt + canvas`` that hides
   both paddings, and per-row canvas positions that continue each row's own prompt;
4. applies ``lm_head`` to the hidden states at the slots only, then the final softcap
   ``cap * tanh(x / cap)`` in float32, and keeps each slot's label logits.

The library's own ``forward`` builds float32 logits over all 262,144 ids at every canvas position;
step 4 builds them at the slots only. Its static-cache path hides the last canvas token once the
prompt fills the sliding window (DESIGN.md section 1), so only ``DynamicCache`` is used here.

Sliding-window layers: the encoder's ``DynamicCache`` keeps only a sliding layer's last
``sliding_window - 1`` prompt tokens, and the decoder attends to all of them and to the whole canvas
(the window is anchored at the end of the prompt, not at each canvas token). A batch cache reproduces
that per row: left padding keeps each row's last tokens at the right end, where the mask's window
slice ``[P - W + 1, P)`` of the padded prompt width ``P`` looks.

Tolerance: a read's result does not depend on the other requests of the call, on chunking or on the
cache state beyond float rounding: within 1e-5 in float32 on the CPU (tests measure it). In bfloat16
batch composition moves logits far more (up to 6.5 on random 26B-A4B weights); compare fixed shapes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import DiffusionGemmaForBlockDiffusion, DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from slotread.engines.base import Family, ReadRequest, SlotScores
from slotread.engines.noise import noise_canvas
from slotread.engines.prefix_cache import PrefixCache, PrefixKV
from slotread.engines.scores import score_slots
from slotread.errors import PromptTooLong

logger = logging.getLogger(__name__)

#: A prompt's KV is large: a 1,600-token prompt of the 26B-A4B shape holds roughly 240 MB in bfloat16
#: (25 sliding layers x 1,023 tokens x 8 kv heads x 256, plus 5 full layers), so the store is bounded.
DEFAULT_CACHE_BYTES = 2**30

Ids = tuple[int, ...]


class DiffusionGemmaEngine:
    """Reads label logits at the slots of DiffusionGemma canvases, caching prompt KV across reads.

    ``max_canvases`` bounds the canvases of one decoder forward; ``max_tokens`` (prompt + canvas of
    one read) defaults to the model's ``max_position_embeddings``.
    """

    family: Family = "diffusion"
    noisy = True

    def __init__(
        self,
        model: DiffusionGemmaForBlockDiffusion,
        *,
        prefix_cache: PrefixCache | None = None,
        max_tokens: int | None = None,
        max_canvases: int = 32,
    ) -> None:
        self._config = model.config.get_text_config()
        self.max_tokens = int(max_tokens if max_tokens is not None else self._config.max_position_embeddings)
        self.max_canvases = max_canvases
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(DEFAULT_CACHE_BYTES)
        self._model = model.eval()
        self._encoder = model.model.encoder
        self._decoder = model.model.decoder
        self._head = model.lm_head
        self._softcap = float(self._config.final_logit_softcapping)
        self._vocab = int(self._config.vocab_size)
        self._pad_id = int(self._config.pad_token_id or 0)
        logger.info(
            "diffusion_gemma engine: %s, max_tokens=%d, max_canvases=%d, prefix cache %d MiB",
            model.dtype,
            self.max_tokens,
            max_canvases,
            self.prefix_cache.max_bytes // 2**20,
        )

    def read(self, requests: list[ReadRequest]) -> list[SlotScores]:
        """One ``SlotScores`` per request, in order (the recipe is in the module docstring)."""
        for index, request in enumerate(requests):
            self._check(index, request)
        scores: dict[int, SlotScores] = {}
        with torch.inference_mode():
            prompts: dict[Ids, PrefixKV] = {}
            for request in requests:
                if request.prompt_ids not in prompts:
                    prompts[request.prompt_ids] = self._encode(request.prompt)
            # Equal prompts adjacent (one expand view when a chunk shares one), similar lengths together.
            order = sorted(
                range(len(requests)),
                key=lambda i: (len(requests[i].prompt_ids), requests[i].prompt_ids, len(requests[i].canvas)),
            )
            for start in range(0, len(order), self.max_canvases):
                chunk = order[start : start + self.max_canvases]
                batch = [requests[i] for i in chunk]
                logits = self._slot_logits(batch, [prompts[request.prompt_ids] for request in batch])
                per_slot = iter(score_slots(logits, [(slot,) for request in batch for slot in request.slots]))
                for index, request in zip(chunk, batch, strict=True):
                    slots = [next(per_slot) for _ in request.slots]
                    scores[index] = SlotScores(
                        logits=tuple(s.logits[0] for s in slots),
                        label_mass=tuple(s.label_mass[0] for s in slots),
                        argmax_is_label=tuple(s.argmax_is_label[0] for s in slots),
                        argmax_id=tuple(s.argmax_id[0] for s in slots),
                        argmax_logit=tuple(s.argmax_logit[0] for s in slots),
                        log_normalizer=tuple(s.log_normalizer[0] for s in slots),
                    )
        return [scores[index] for index in range(len(requests))]

    def _encode(self, segments: tuple[Ids, ...]) -> PrefixKV:
        """The prompt's KV, from the prefix cache or encoded from its longest cached boundary on.

        Each segment is one encoder forward continuing the cache of the segments before it, and the
        KV at every boundary is stored.
        """
        ids = tuple(token for segment in segments for token in segment)
        ends = sorted({sum(len(segment) for segment in segments[: k + 1]) for k in range(len(segments))} - {0})
        start, kv = 0, None
        for end in reversed(ends):
            if (kv := self.prefix_cache.get(ids[:end])) is not None:
                start = end
                break

        device = self._model.device
        cache = DynamicCache(config=self._config) if kv is None else self._batch_cache([kv], [start])
        for end in (end for end in ends if end > start):
            self._encoder(
                input_ids=torch.tensor([ids[start:end]], device=device),  # (1, S)
                position_ids=torch.arange(start, end, device=device)[None],  # (1, S)
                past_key_values=cache,
                use_cache=True,
            )
            # A sliding layer holds a view of its last W - 1 tokens: copy it so the entry owns its bytes.
            layers = list(cache)  # per layer: keys, values (1, kvh, T_l, hd), sliding window or None
            kv = PrefixKV(
                keys=tuple(keys.contiguous() for keys, _, _ in layers),
                values=tuple(values.contiguous() for _, values, _ in layers),
            )
            self.prefix_cache.put(ids[:end], kv)
            start = end
        assert kv is not None, "a read's prompt is never empty"
        return kv

    def _batch_cache(self, prompts: Sequence[PrefixKV], lengths: Sequence[int]) -> DynamicCache:
        """A decoder cache holding row r's prompt KV (``lengths[r]`` tokens), left-padded with zeros.

        Layers are filled directly: ``DynamicCache.update`` would copy an expanded view, and a
        sliding layer must report the padded prompt width as its ``cumulative_length`` (not the
        W - 1 tokens it holds) for the library to cut the 2D mask at the right place.
        """
        width = max(lengths)  # P
        cache = DynamicCache()
        for index, layer_type in enumerate(self._config.layer_types):
            held = max(kv.keys[index].shape[-2] for kv in prompts)  # P, or min(P, W - 1) when sliding
            keys = _left_padded([kv.keys[index] for kv in prompts], held)  # (B, kvh, held, hd)
            values = _left_padded([kv.values[index] for kv in prompts], held)
            sliding = layer_type == "sliding_attention"
            layer = DynamicSlidingWindowLayer(self._config.sliding_window) if sliding else DynamicLayer()
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
            if isinstance(layer, DynamicSlidingWindowLayer):
                layer.cumulative_length = width
            cache.layers.append(layer)
        return cache

    def _slot_logits(self, batch: list[ReadRequest], prompts: list[PrefixKV]) -> torch.Tensor:
        """Float32 logits (S, V) at every slot of ``batch``, in request then slot order."""
        device = self._model.device
        lengths = [len(request.prompt_ids) for request in batch]
        width = max(lengths)  # P: the padded prompt width
        columns = max(len(request.canvas) for request in batch)  # C: the padded canvas width
        canvases, positions, masks = [], [], []
        for request, length in zip(batch, lengths, strict=True):
            noised = (
                request.canvas
                if request.seed is None
                else noise_canvas(request.canvas, [slot.position for slot in request.slots], request.seed, self._vocab)
            )
            fill = columns - len(noised)
            canvases.append([*noised, *[self._pad_id] * fill])
            positions.append(list(range(length, length + columns)))
            masks.append([0] * (width - length) + [1] * (length + len(noised)) + [0] * fill)

        hidden = self._decoder(
            decoder_input_ids=torch.tensor(canvases, device=device),  # (B, C)
            past_key_values=self._batch_cache(prompts, lengths),  # per layer (B, kvh, P or min(P, W-1), hd)
            decoder_attention_mask=torch.tensor(masks, device=device),  # (B, P + C)
            decoder_position_ids=torch.tensor(positions, device=device),  # (B, C)
        ).last_hidden_state  # (B, C, H)

        rows = [r for r, request in enumerate(batch) for _ in request.slots]
        cols = [slot.position for request in batch for slot in request.slots]
        at_slots = hidden[torch.tensor(rows, device=device), torch.tensor(cols, device=device)]  # (S, H)
        logits = self._head(at_slots).to(torch.float32)  # (S, V)
        return self._softcap * torch.tanh(logits / self._softcap)

    def _check(self, index: int, request: ReadRequest) -> None:
        """Refuse a request the engine cannot read (a caller's bug, except for its length)."""
        if not request.prompt_ids:
            raise ValueError(f"request {index}: empty prompt (the decoder reads the prompt's KV)")
        if not request.slots:
            raise ValueError(f"request {index}: no slots")
        for slot in request.slots:
            if not 0 <= slot.position < len(request.canvas):
                raise ValueError(f"request {index}: slot position {slot.position} outside the canvas")
            if not slot.label_ids or not all(0 <= i < self._vocab for i in slot.label_ids):
                raise ValueError(f"request {index}: label ids must be 1+ ids below {self._vocab}")
        tokens = len(request.prompt_ids) + len(request.canvas)
        if tokens > self.max_tokens:
            raise PromptTooLong(tokens, self.max_tokens)


def _left_padded(tensors: list[torch.Tensor], width: int) -> torch.Tensor:
    """Stack (1, kvh, L_r, hd) tensors into (B, kvh, width, hd), each row left-padded with zeros.

    One tensor shared by every row and already ``width`` long becomes an ``expand`` view (no copy).
    """
    first = tensors[0]
    if first.shape[-2] == width and all(t is first for t in tensors):
        return first.expand(len(tensors), -1, -1, -1)
    return torch.cat([F.pad(t, (0, 0, width - t.shape[-2], 0)) for t in tensors])
