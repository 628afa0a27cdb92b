"""The causal engine: slot reads for any ``AutoModelForCausalLM`` by next-token prediction.

A read feeds ``prompt + canvas[:p]``, where ``p`` is the slot's position in the canvas, and takes the
logits of the last fed token (overall position ``len(prompt) + p - 1``): they predict the slot.
Nothing from the slot on is fed, so all slots of a request sit at one position (each may read its
own label set there). A slot further on would need the token at an earlier slot fed as input
(teacher forcing); such a request is refused with ``ValueError``.

Reads are branches that share prompt prefixes. The KV of every prefix ending on a segment boundary
before the last segment is kept in a ``PrefixCache``; the last segment (the question, in a
state-first layout) is the branch's own text and always runs with the canvas, because caching it
would copy the shared prefix once per branch for prompts that are not read again. One ``read``:

1. finds each request's longest cached boundary prefix;
2. plans rows: a missing prefix that two or more requests continue differently is encoded once, in
   a row of its own, one "wave" before the rows that extend it;
3. runs each wave in batched forwards: a row's prefix KV left-padded to the longest prefix of the
   batch (a prefix shared by every row is an ``expand`` view, not a copy), its new tokens right-padded,
   a 2D attention mask and per-row position ids, so each row computes what it computes alone;
4. keeps the KV of the boundary prefixes each row passed, and applies ``lm_head`` only at the rows
   that are read (whose final hidden states a request with ``hidden=True`` gets back).

Tolerance: a result does not depend on the other requests of the call, on the chunking or on the
cache state beyond float32 rounding, which CPU matmul kernels do differently for different batch
shapes: at most 1e-5 on the O(1) logits of the tiny test models, about 6e-7 of the logit size on
real ones (SmolLM2-135M: 1.2e-5 on logits near 20). In bfloat16 batch composition moves logits by
far more; compare fixed shapes there.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import groupby

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from slotread.engines.base import Family, ReadRequest, SlotScores
from slotread.engines.prefix_cache import PrefixCache, PrefixKV
from slotread.engines.scores import score_slots, with_hidden
from slotread.errors import ModelLoadError, PromptTooLong

logger = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 512 * 2**20

Ids = tuple[int, ...]


@dataclass(frozen=True)
class Row:
    """One row of a batched forward: the KV of ``parent`` extended by ``tokens``.

    ``keep`` lists the lengths of the boundary prefixes (of ``parent + tokens``) whose KV the row
    stores; ``request`` is the index of the request read at the row's last token, None for a row
    that only encodes a shared prefix.
    """

    parent: Ids
    tokens: Ids
    keep: tuple[int, ...]
    request: int | None


def plan_waves(
    fed: Sequence[Ids], boundaries: Sequence[Sequence[int]], is_cached: Callable[[Ids], bool]
) -> list[list[Row]]:
    """The rows of one read, in waves: each row's parent is cached or encoded in an earlier wave.

    ``fed[i]`` is request i's fed ids, ``boundaries[i]`` the increasing lengths of its cacheable
    prefixes. A missing prefix becomes a row of its own only where requests continue it in two or
    more ways (a branch point); otherwise it is encoded inside the one row that passes it.
    """
    paths: list[tuple[int, list[int]]] = []  # per request: deepest cached length, missing lengths
    for ids, lengths in zip(fed, boundaries, strict=True):
        start = next((length for length in reversed(lengths) if is_cached(ids[:length])), 0)
        paths.append((start, [length for length in lengths if length > start]))

    continuations: defaultdict[Ids, set[Ids | int]] = defaultdict(set)
    for index, (ids, (_, missing)) in enumerate(zip(fed, paths, strict=True)):
        for step, length in enumerate(missing):
            successor = ids[: missing[step + 1]] if step + 1 < len(missing) else index
            continuations[ids[:length]].add(successor)
    branch_points = {prefix for prefix, successors in continuations.items() if len(successors) > 1}

    waves: defaultdict[int, list[Row]] = defaultdict(list)
    planned: set[Ids] = set()
    for index, (ids, (start, missing)) in enumerate(zip(fed, paths, strict=True)):
        parent, depth = start, 0
        keep: list[int] = []
        for length in missing:
            keep.append(length)
            prefix = ids[:length]
            if prefix in branch_points:
                if prefix not in planned:
                    planned.add(prefix)
                    waves[depth].append(Row(ids[:parent], ids[parent:length], tuple(keep), None))
                parent, keep, depth = length, [], depth + 1
        waves[depth].append(Row(ids[:parent], ids[parent:], tuple(keep), index))
    return [waves[depth] for depth in sorted(waves)]


def cache_from_prefixes(parents: Sequence[PrefixKV | None], width: int) -> DynamicCache:
    """A batch cache holding each row's prefix KV left-padded to ``width`` tokens.

    Rows must come grouped by parent (equal parents adjacent). A prefix shared by every row becomes
    an ``expand`` view; otherwise each group is written once into a zero tensor. The layers are
    filled directly, because ``DynamicCache(ddp_cache_data=...)`` would copy an expanded view, and
    every layer is a full one (sliding-window models too): the mask applies the window, and a
    sliding layer would drop the prefix tokens a padded row still needs.
    """
    cache = DynamicCache()
    known = next((parent for parent in parents if parent is not None), None)
    if width == 0 or known is None:
        return cache
    for layer_index in range(len(known.keys)):
        keys = _pad_rows([p.keys[layer_index] if p else None for p in parents], width)  # (B, kvh, P, hd)
        values = _pad_rows([p.values[layer_index] if p else None for p in parents], width)
        layer = DynamicLayer()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        cache.layers.append(layer)
    return cache


def _pad_rows(tensors: list[torch.Tensor | None], width: int) -> torch.Tensor:
    """Stack (1, kvh, L_r, hd) tensors into (B, kvh, width, hd), each row left-padded with zeros."""
    first = tensors[0]
    if first is not None and first.shape[-2] == width and all(t is first for t in tensors):
        return first.expand(len(tensors), -1, -1, -1)
    template = next(t for t in tensors if t is not None)
    out = template.new_zeros(len(tensors), template.shape[1], width, template.shape[3])
    row = 0
    for _, group in groupby(tensors, key=id):
        members = list(group)
        tensor, count = members[0], len(members)
        if tensor is not None:
            out[row : row + count, :, width - tensor.shape[-2] :] = tensor
        row += count
    return out


class CausalEngine:
    """Reads label logits at answer slots of a causal LM, caching prompt prefixes across reads.

    ``max_batch_rows`` bounds the rows of one forward; ``max_tokens`` defaults to the model's
    ``max_position_embeddings``.
    """

    family: Family = "causal"
    noisy = False

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        prefix_cache: PrefixCache | None = None,
        max_tokens: int | None = None,
        max_batch_rows: int = 32,
    ) -> None:
        if not isinstance(model, PreTrainedModel):
            raise ModelLoadError(type(model).__name__, "the causal engine reads transformers models only")
        config = model.config.get_text_config()
        self.max_tokens = int(max_tokens if max_tokens is not None else config.max_position_embeddings)
        self.max_batch_rows = max_batch_rows
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(DEFAULT_CACHE_BYTES)
        self._model = model.eval()
        self._body: torch.nn.Module = model.base_model
        head = model.get_output_embeddings()
        if self._body is model or not isinstance(head, torch.nn.Module):
            raise ModelLoadError(type(model).__name__, "no separate base model and output embeddings")
        self._head: torch.nn.Module = head
        self._vocab = int(head.get_parameter("weight").shape[0])
        # Logit transforms the causal LMs of transformers 5.17 apply after lm_head, named by config.
        self._logit_scale = float(getattr(config, "logit_scale", None) or 1.0)  # Cohere multiplies
        self._logit_scale /= float(getattr(config, "logits_scaling", None) or 1.0)  # Granite divides
        self._softcap = getattr(config, "final_logit_softcapping", None)  # Gemma: cap * tanh(x / cap)
        self._check_logit_head()
        logger.info(
            "causal engine: %s, max_tokens=%d, max_batch_rows=%d, prefix cache %d MiB",
            type(model).__name__,
            self.max_tokens,
            max_batch_rows,
            self.prefix_cache.max_bytes // 2**20,
        )

    def read(self, requests: list[ReadRequest]) -> list[SlotScores]:
        """One ``SlotScores`` per request, in order (see the module docstring for the recipe)."""
        fed = [self._fed_ids(index, request) for index, request in enumerate(requests)]
        boundaries = [_boundaries(request.prompt) for request in requests]
        scores: dict[int, SlotScores] = {}
        with torch.inference_mode():
            known: dict[Ids, PrefixKV] = {}
            probed: set[Ids] = set()

            def is_cached(prefix: Ids) -> bool:
                if prefix not in probed:
                    probed.add(prefix)
                    entry = self.prefix_cache.get(prefix)
                    if entry is not None:
                        known[prefix] = entry
                return prefix in known

            for wave in plan_waves(fed, boundaries, is_cached):
                # Equal parents adjacent (for cache_from_prefixes), similar lengths together (less padding).
                wave.sort(key=lambda row: (len(row.parent), row.parent, len(row.tokens)))
                for start in range(0, len(wave), self.max_batch_rows):
                    chunk = wave[start : start + self.max_batch_rows]
                    last_hidden = self._extend(chunk, known)  # (B, H)
                    read = [(r, row.request) for r, row in enumerate(chunk) if row.request is not None]
                    if read:
                        at_reads = last_hidden[[r for r, _ in read]]  # (R, H)
                        slots = [requests[index].slots for _, index in read]
                        results = score_slots(self._logits(at_reads), slots)  # logits (R, V) float32
                        wanted = [requests[index].hidden for _, index in read]
                        if any(wanted):  # every slot of a request reads the same row
                            counts = torch.tensor([len(s) for s in slots], device=at_reads.device)
                            results = with_hidden(results, at_reads.repeat_interleave(counts, dim=0), wanted)
                        for (_, index), result in zip(read, results, strict=True):
                            scores[index] = result
        return [scores[index] for index in range(len(requests))]

    def _extend(self, rows: list[Row], known: dict[Ids, PrefixKV]) -> torch.Tensor:
        """Run one batched forward; store the KV of each row's ``keep`` prefixes in ``known`` and the
        prefix cache; return the hidden state at each row's last token, (B, H)."""
        device = self._model.device
        width = max(len(row.parent) for row in rows)  # P: the padded prefix width
        steps = max(len(row.tokens) for row in rows)  # S: the padded new-token width
        input_ids, position_ids, mask = [], [], []
        for row in rows:
            fill = steps - len(row.tokens)
            input_ids.append([*row.tokens, *[0] * fill])
            position_ids.append([*range(len(row.parent), len(row.parent) + len(row.tokens)), *[0] * fill])
            pad = width - len(row.parent)
            mask.append([0] * pad + [1] * (len(row.parent) + len(row.tokens)) + [0] * fill)
        cache = cache_from_prefixes([known[row.parent] if row.parent else None for row in rows], width)
        hidden = self._body(
            input_ids=torch.tensor(input_ids, device=device),  # (B, S)
            attention_mask=torch.tensor(mask, device=device),  # (B, P + S)
            position_ids=torch.tensor(position_ids, device=device),  # (B, S)
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state  # (B, S, H)

        layers = [(keys, values) for keys, values, _ in cache]  # each (B, kvh, P + S, hd)
        for r, row in enumerate(rows):
            start = width - len(row.parent)
            for length in row.keep:
                window = (slice(r, r + 1), slice(None), slice(start, start + length))
                kv = PrefixKV(
                    keys=tuple(keys[window].clone() for keys, _ in layers),
                    values=tuple(values[window].clone() for _, values in layers),
                )
                prefix = (*row.parent, *row.tokens)[:length]
                known[prefix] = kv
                self.prefix_cache.put(prefix, kv)
        last = torch.tensor([len(row.tokens) - 1 for row in rows], device=device)
        return hidden[torch.arange(len(rows), device=device), last]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary float32 logits of hidden states (R, H) -> (R, V), as the model's own head."""
        logits = self._head(hidden).float()
        if self._logit_scale != 1.0:
            logits = logits * self._logit_scale
        if self._softcap:
            logits = self._softcap * torch.tanh(logits / self._softcap)
        return logits

    def _check_logit_head(self) -> None:
        """Refuse a model whose own logits differ from ``_logits`` (an unknown head transform)."""
        probe = torch.arange(1, min(5, self._vocab), device=self._model.device).unsqueeze(0)
        with torch.inference_mode():
            expected = self._model(input_ids=probe).logits[0, -1].float()
            got = self._logits(self._body(input_ids=probe).last_hidden_state[0, -1:])[0]
        tolerance = 1e-4 if self._model.dtype == torch.float32 else 3e-2
        scale = float(expected.abs().max()) + 1.0
        difference = float((got - expected).abs().max())
        if difference > tolerance * scale:
            raise ModelLoadError(
                type(self._model).__name__,
                f"its logits differ from lm_head at the slot rows by {difference:.3g}: the model "
                "transforms its logits in a way the causal engine does not know",
            )

    def _fed_ids(self, index: int, request: ReadRequest) -> Ids:
        """The ids a read feeds (``prompt + canvas[:p]``), after checking the request."""
        if not request.slots:
            raise ValueError(f"request {index}: no slots")
        positions = sorted({slot.position for slot in request.slots})
        if len(positions) > 1:
            raise ValueError(
                f"request {index}: slots at positions {positions}; a causal read feeds nothing from its "
                "slot on, so a later slot would need an earlier slot's token as input"
            )
        position = positions[0]
        if not 0 <= position <= len(request.canvas):
            raise ValueError(f"request {index}: slot position {position} outside the canvas")
        for slot in request.slots:
            if not slot.label_ids or not all(0 <= i < self._vocab for i in slot.label_ids):
                raise ValueError(f"request {index}: label ids must be 1+ ids below {self._vocab}")
        fed = request.prompt_ids + request.canvas[:position]
        if not fed:
            raise ValueError(f"request {index}: nothing to feed before the slot")
        if len(fed) > self.max_tokens:
            raise PromptTooLong(len(fed), self.max_tokens)
        return fed


def _boundaries(prompt: tuple[Ids, ...]) -> list[int]:
    """Lengths of the cacheable prefixes: segment ends before the end of the prompt, increasing."""
    total = sum(len(segment) for segment in prompt)
    lengths: list[int] = []
    end = 0
    for segment in prompt:
        end += len(segment)
        if 0 < end < total and (not lengths or lengths[-1] != end):
            lengths.append(end)
    return lengths
