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
2. plans rows: each missing boundary prefix is encoded once, in a row of its own that continues the
   prefix one segment shorter (cached, or encoded one "wave" before), so a prompt is always encoded
   segment by segment and a segment's KV is computed the same way whether or not a prefix was cached;
   each request's row then runs its last segment and canvas after its longest boundary prefix;
3. runs each wave in forwards of ``max_batch_rows`` rows: a row's prefix KV left-padded to the longest
   prefix of the forward (a prefix shared by every row is an ``expand`` view, not a copy), its new
   tokens right-padded, a 2D attention mask and per-row position ids;
4. keeps the KV of each encoded boundary prefix, and at the rows that are read applies ``lm_head``
   (the vocabulary diagnostics) and the exact float32 label logits (``scores.OutputHead``); a request
   with ``hidden=True`` gets those rows' final hidden states back.

Tolerance: with ``max_batch_rows=1`` (the default) every forward runs one row of one segment, so a
read's label logits are bit-identical whatever else the call holds and whatever the prefix cache
holds, in any dtype, for one device, torch build and thread count. Batching rows is not: CPU matmul
kernels round a row differently in batches of different shapes (bfloat16 outputs move by one unit in
the last place, e.g. 0.25 on values near 100; float32 logits of real weights by about 6e-7 of their
size, 1.2e-5 on SmolLM2-135M's logits near 20; 1e-5 on the tiny test models). On the 2-core CPU a
3-question decision costs about the same batched or row by row, the forwards being compute-bound
(``bench/causal_branches.py``, qwen2.5-coder-1.5b in bfloat16, warm: 2.72 s batched, 2.76 s row by
row, best of 3 on a loaded machine); a GPU (``make_engine``) batches ``GPU_BATCH`` rows and takes
that rounding.
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

from slotread.engines.base import Family, ReadRequest, SlotScores, check_slots
from slotread.engines.causal_thought import greedy_thoughts
from slotread.engines.prefix_cache import PrefixCache, PrefixKV
from slotread.engines.scores import OutputHead, score_slots, with_hidden
from slotread.engines.thought import ThoughtRequest
from slotread.errors import ModelLoadError, PromptTooLong

logger = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 512 * 2**20

Ids = tuple[int, ...]


@dataclass(frozen=True)
class Row:
    """One row of a batched forward: the KV of ``parent`` extended by ``tokens``.

    ``request`` is the index of the request read at the row's last token; None for a row that
    encodes a boundary prefix (``parent + tokens``) and stores its KV.
    """

    parent: Ids
    tokens: Ids
    request: int | None


def plan_waves(
    fed: Sequence[Ids], boundaries: Sequence[Sequence[int]], is_cached: Callable[[Ids], bool]
) -> list[list[Row]]:
    """The rows of one read, in waves: each row's parent is cached or encoded in an earlier wave.

    ``fed[i]`` is request i's fed ids, ``boundaries[i]`` the increasing lengths of its cacheable
    prefixes. Each missing boundary prefix is one row (once, however many requests pass it)
    continuing the boundary before it; each request's row continues its longest boundary prefix.
    """
    ready: dict[Ids, int] = {}  # a planned prefix -> the first wave that may continue it
    waves: defaultdict[int, list[Row]] = defaultdict(list)
    for index, (ids, lengths) in enumerate(zip(fed, boundaries, strict=True)):
        parent = next((length for length in reversed(lengths) if is_cached(ids[:length])), 0)
        depth = 0
        for length in (length for length in lengths if length > parent):
            prefix = ids[:length]
            if prefix not in ready:
                waves[depth].append(Row(ids[:parent], ids[parent:length], None))
                ready[prefix] = depth + 1
            parent, depth = length, max(depth, ready[prefix])
        waves[depth].append(Row(ids[:parent], ids[parent:], index))
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

    ``max_batch_rows`` bounds the rows of one forward (1: every read's result bit-identical in any
    batch and cache state, see the module docstring); ``max_tokens`` defaults to the model's
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
        max_batch_rows: int = 1,
    ) -> None:
        if not isinstance(model, PreTrainedModel):
            raise ModelLoadError(type(model).__name__, "the causal engine reads transformers models only")
        config = model.config.get_text_config()
        self.max_tokens = int(max_tokens if max_tokens is not None else config.max_position_embeddings)
        self.max_batch_rows = max_batch_rows
        self.deterministic = max_batch_rows == 1
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(DEFAULT_CACHE_BYTES)
        self._model = model.eval()
        self._body: torch.nn.Module = model.base_model
        head = model.get_output_embeddings()
        if self._body is model or not isinstance(head, torch.nn.Linear):
            raise ModelLoadError(type(model).__name__, "no separate base model and linear output embeddings")
        self._vocab = head.out_features
        # Logit transforms the causal LMs of transformers 5.17 apply after lm_head, named by config.
        scale = float(getattr(config, "logit_scale", None) or 1.0)  # Cohere multiplies
        scale /= float(getattr(config, "logits_scaling", None) or 1.0)  # Granite divides
        softcap = getattr(config, "final_logit_softcapping", None)  # Gemma: cap * tanh(x / cap)
        self._head = OutputHead(head.weight, head.bias, scale, float(softcap) if softcap else None)
        self._check_logit_head()
        logger.info(
            "causal engine: %s, max_tokens=%d, max_batch_rows=%d, prefix cache %d MiB",
            type(model).__name__,
            self.max_tokens,
            max_batch_rows,
            self.prefix_cache.max_bytes // 2**20,
        )

    def think(self, requests: list[ThoughtRequest]) -> list[tuple[int, ...]]:
        """Each request's thought, generated greedily in one batch (``causal_thought``)."""
        if not requests:
            return []
        return greedy_thoughts(
            self._model,
            [r.prompt_ids for r in requests],
            [r.max_tokens for r in requests],
            [r.stop_ids for r in requests],
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
                        results = score_slots(self._head.vocabulary(at_reads), at_reads, slots, self._head)
                        wanted = [requests[index].hidden for _, index in read]
                        if any(wanted):  # every slot of a request reads the same row
                            counts = torch.tensor([len(s) for s in slots], device=at_reads.device)
                            results = with_hidden(results, at_reads.repeat_interleave(counts, dim=0), wanted)
                        for (_, index), result in zip(read, results, strict=True):
                            scores[index] = result
        return [scores[index] for index in range(len(requests))]

    def _extend(self, rows: list[Row], known: dict[Ids, PrefixKV]) -> torch.Tensor:
        """Run one batched forward; store the KV of each boundary prefix row in ``known`` and the
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
            if row.request is None:  # a boundary prefix: keep its KV
                start = width - len(row.parent)
                window = (slice(r, r + 1), slice(None), slice(start, start + len(row.parent) + len(row.tokens)))
                kv = PrefixKV(
                    keys=tuple(keys[window].clone() for keys, _ in layers),
                    values=tuple(values[window].clone() for _, values in layers),
                )
                prefix = (*row.parent, *row.tokens)
                known[prefix] = kv
                self.prefix_cache.put(prefix, kv)
        last = torch.tensor([len(row.tokens) - 1 for row in rows], device=device)
        return hidden[torch.arange(len(rows), device=device), last]

    def _check_logit_head(self) -> None:
        """Refuse a model whose own logits differ from ``self._head``'s (an unknown head transform), over
        the vocabulary and, exactly, at a few ids and its top ones."""
        probe = torch.arange(1, min(5, self._vocab), device=self._model.device).unsqueeze(0)
        # the body's output caught inside the model's own forward: one forward of the model, not a second
        # of the body (each Decider of a causal model runs this check at start-up)
        bodies: list[torch.Tensor] = []
        hook = self._body.register_forward_hook(lambda _module, _args, output: bodies.append(output[0]))
        with torch.inference_mode():
            try:
                expected = self._model(input_ids=probe).logits[0, -1].float()
            finally:
                hook.remove()
            hidden = bodies[0][0, -1:]  # (1, H)
            ids = torch.cat([torch.arange(0, self._vocab, max(1, self._vocab // 64)), expected.topk(8).indices.cpu()])
            ids = ids.to(self._model.device)
            vocabulary = self._head.vocabulary(hidden)[0]
            exact = self._head.at(hidden.expand(len(ids), -1), ids)
        tolerance = 1e-4 if self._model.dtype == torch.float32 else 3e-2
        scale = float(expected.abs().max()) + 1.0
        difference = max(float((vocabulary - expected).abs().max()), float((exact - expected[ids]).abs().max()))
        if difference > tolerance * scale:
            raise ModelLoadError(
                type(self._model).__name__,
                f"its logits differ from lm_head at the slot rows by {difference:.3g}: the model "
                "transforms its logits in a way the causal engine does not know",
            )

    def _fed_ids(self, index: int, request: ReadRequest) -> Ids:
        """The ids a read feeds (``prompt + canvas[:p]``), after checking the request."""
        check_slots(index, request, self._vocab, end_ok=True)
        positions = sorted({slot.position for slot in request.slots})
        if len(positions) > 1:
            raise ValueError(
                f"request {index}: slots at positions {positions}; a causal read feeds nothing from its "
                "slot on, so a later slot would need an earlier slot's token as input"
            )
        fed = request.prompt_ids + request.canvas[: positions[0]]
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
