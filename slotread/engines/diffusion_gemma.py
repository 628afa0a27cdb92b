"""The DiffusionGemma engine: every slot of a canvas read in one decoder step.

DiffusionGemma (transformers ``DiffusionGemmaForBlockDiffusion``, 5.17) uses one set of weights twice:
a causal *encoder* writes the prompt into a KV cache, and a *decoder* attends bidirectionally over
that cache plus the canvas and predicts the clean token at every canvas position (no shift). There
is no mask token: the model was trained to denoise uniform random token ids. A read:

1. finds each distinct prompt's longest cached segment boundary in the ``PrefixCache`` and encodes
   the segments left, one per wave, the same-length segments of a wave in one batch, each row
   continuing its parent's KV (``gemma_forward.encode``); the KV of every boundary is stored. A prompt
   is always encoded segment by segment, so its KV is the same whether or not a prefix was cached;
2. noises the canvas: each slot's token becomes a noise token (``noise_canvas``, from the request's
   seed; a request without a seed is read as given);
3. splits each prompt at its shortest available boundary of at least ``shared_min`` tokens: rows
   whose prompts share that boundary read its KV in place, in one attention for all of them, and
   each row attends separately to its own prompt tokens after it and to its canvas
   (``gemma_forward.decode``, one step, no self-conditioning; a request with ``steps`` > 1 is denoised
   that many steps, its template pinned, by ``engines/denoise.py``, eagerly and never joint-encoded);
4. applies ``lm_head`` to the hidden states at the slots only, then the final softcap
   ``cap * tanh(x / cap)`` in float32 (the vocabulary diagnostics), computes each slot's label logits
   exactly from the output embedding's rows of its labels (``scores.OutputHead``: float64 sums, the
   softcap, float32 out), and keeps them (and, for a request with ``hidden=True``, the slot's hidden
   state).

The library's own ``forward`` builds float32 logits over all 262,144 ids at every canvas position
and copies the prompt's KV into every row of a batch in every layer; steps 3 and 4 do neither. Its
static-cache path hides the last canvas token once the prompt fills the sliding window (DESIGN.md
section 1); this engine keeps no static cache.

Sliding-window layers: a sliding layer's prompt KV holds the prompt's last ``sliding_window - 1``
tokens, and the decoder attends to all of them and to the whole canvas (the window is anchored at
the end of the prompt, not at each canvas token); the encoder's queries see the ``sliding_window``
positions up to themselves.

Tolerance: a read's result does not depend on the other requests of the call, on chunking or on the
cache state beyond float rounding: within 1e-5 in float32 on the CPU (tests measure it). In bfloat16
batch composition moves logits far more (2.5 on random 26B-A4B weights through the library's own
path, bench/RESULTS.md); ``deterministic=True`` makes a read bit-identical in any batch and cache
state (on a GPU with batch-invariant kernels, ``engines/invariant.py``; elsewhere one read at a time).
The cache state matters through ``joint_encode`` only: a prompt whose last segment is not cached has
it encoded in the canvases' forward, one that finds it cached reads its stored KV, and the two round
differently (float32: 1.3e-6 on the tiny model's logits near 3; bfloat16: up to 0.5 there, random
weights amplifying it). With ``joint_encode=False`` a cold and a warm read are bit-identical on the CPU.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, groupby, pairwise

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DiffusionGemmaForBlockDiffusion

from slotread.engines import invariant
from slotread.engines.attention import MASKED
from slotread.engines.base import Family, ReadRequest, SlotScores
from slotread.engines.denoise import MAX_STEPS, Schedule, denoised_hidden
from slotread.engines.diffusion_thought import diffusion_thoughts
from slotread.engines.forward_graphs import ForwardGraphs, bucket, length_bucket
from slotread.engines.gemma_forward import (
    Canvases,
    ImageTokens,
    JointMasks,
    NewTokens,
    OwnPrompt,
    SharedPart,
    decode,
    encode,
    encode_decode,
)
from slotread.engines.noise import noise_canvas
from slotread.engines.prefix_cache import PrefixCache, PrefixKV
from slotread.engines.scores import OutputHead, score_slot_rows, with_hidden
from slotread.engines.thought import ThoughtRequest
from slotread.engines.vision import GemmaVision
from slotread.errors import PromptTooLong

logger = logging.getLogger(__name__)

#: A prompt's KV is large: a 1,600-token prompt of the 26B-A4B shape holds roughly 240 MB in bfloat16
#: (25 sliding layers x 1,023 tokens x 8 kv heads x 256, plus 5 full layers), so the store is bounded.
DEFAULT_CACHE_BYTES = 2**30

Ids = tuple[int, ...]

#: A joint forward (new states with their canvases) of at most this many tokens, padded to its
#: bucket, replays a CUDA graph. On an H200 (26B-A4B shape) a 3-canvas decision with a new state
#: takes 38 ms (205 as two eager forwards); at 6,144 and 5,632 padded tokens graphs gained 7% and 3%
#: over the eager joint forward: larger forwards are bound by the GPU.
GRAPH_TOKENS = 8192

#: A joint forward pads its states to its longest one's ``length_bucket``: at most this share of its new
#: tokens may be padding, so that states of different lengths share a forward without wasting much.
PAD_SHARE = 0.25

#: A read's prompt is split at its shortest cached boundary of at least this many tokens: the KV
#: before it is read in place by every row sharing it, the tokens after it are copied per row.
SHARED_MIN = 256


@dataclass(frozen=True)
class _Read:
    """How one request reads its prompt KV: ``shared`` (the first ``split`` tokens) read in place,
    starting ``skip`` tokens into a sliding layer's, then its own tokens from ``full``."""

    shared: PrefixKV
    full: PrefixKV
    split: int
    length: int
    skip: int
    order_key: tuple[object, ...]


class DiffusionGemmaEngine:
    """Reads label logits at the slots of DiffusionGemma canvases, caching prompt KV across reads.

    ``max_canvases`` bounds the canvases of one decoder forward and ``max_encode_tokens`` the new
    tokens of one encoder forward; ``max_tokens`` (prompt + canvas of one read) defaults to the
    model's ``max_position_embeddings``. ``shared_min`` is where a prompt is split (``SHARED_MIN``).

    ``deterministic=True`` makes a read's result independent of the rest of the call and of the
    cache's state, bit for bit: every canvas reads its whole prompt's KV as one part (the same
    attention parts however much of the prompt was cached), prompts are encoded segment by segment
    (no joint forward), and on a GPU with Triton the forwards run batch-invariant kernels
    (``engines/invariant.py``) and batch as usual; elsewhere every segment is encoded and every
    canvas decoded alone, so each read runs the same shapes whatever else is asked (the batching's
    cost; bench/gpu_reads.py measures both).

    ``joint_encode``: a prompt whose last segment is not cached (a new state after a cached schema)
    has that segment encoded in the same forward as its canvases (``gemma_forward.encode_decode``)
    instead of in a forward of its own: one pass over the weights and the launches instead of two.
    It needs the encoder's layers tied to the decoder's, as the library ties them.

    ``cuda_graphs`` (on a GPU, in bfloat16): decoder steps whose canvases all read one cached prompt
    replay captured CUDA graphs (``engines/forward_graphs.py``) instead of launching each kernel, and so do
    joint forwards of up to ``GRAPH_TOKENS`` tokens whose new states all continue one cached prompt.
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
        max_encode_tokens: int = 8192,
        shared_min: int = SHARED_MIN,
        deterministic: bool = False,
        cuda_graphs: bool = True,
        joint_encode: bool = True,
    ) -> None:
        self._config = model.config.get_text_config()
        self.max_tokens = int(max_tokens if max_tokens is not None else self._config.max_position_embeddings)
        self.deterministic = deterministic
        #: batch-invariant kernels: a deterministic read may share its forwards
        self.invariant = deterministic and invariant.available(model.device)
        alone = deterministic and not self.invariant  # one row per forward: fixed shapes for every read
        self.max_canvases = 1 if alone else max_canvases
        self.max_encode_tokens = 1 if alone else max_encode_tokens
        # the whole prompt as the shared part: a read's attention parts do not depend on the cache
        self.shared_min = self.max_tokens if deterministic else shared_min
        self.joint_encode = joint_encode and _tied(model)
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(DEFAULT_CACHE_BYTES)
        self._model = model.eval()
        self._encoder = model.model.encoder.language_model
        self._decoder = model.model.decoder
        self._head = OutputHead(model.lm_head.weight, softcap=float(self._config.final_logit_softcapping))
        #: prepares images and runs the vision tower (``engines/vision.py``); a prompt's image segment is
        #: encoded by ``encode`` with the tower's features in place of the image's handles
        self.vision = GemmaVision(model) if getattr(model.config, "vision_config", None) is not None else None
        self._image_blocks = self._config.use_bidirectional_attention == "vision"
        self._schedule = Schedule.of(model)
        # float32 grouped GEMMs copy their offsets to the host, which a graph cannot capture
        use_graphs = cuda_graphs and model.device.type == "cuda" and model.dtype == torch.bfloat16
        self._graphs = (
            ForwardGraphs(self._decoder, self._config.layer_types, self._config.sliding_window) if use_graphs else None
        )
        self._vocab = int(self._config.vocab_size)
        self._pad_id = int(self._config.pad_token_id or 0)
        self._prompt_tokens = 0  # prompt tokens encoded (``counters``)
        self._canvas_tokens = 0  # canvas tokens decoded
        logger.info(
            "diffusion_gemma engine: %s, max_tokens=%d, max_canvases=%d, prefix cache %d MiB, %s",
            model.dtype,
            self.max_tokens,
            self.max_canvases,
            self.prefix_cache.max_bytes // 2**20,
            self.mode,
        )

    @property
    def mode(self) -> str:
        """How reads are computed: ``batched``, ``batch-invariant`` or ``one at a time`` (deterministic)."""
        return "batch-invariant" if self.invariant else "one at a time" if self.deterministic else "batched"

    def read(self, requests: list[ReadRequest]) -> list[SlotScores]:
        """One ``SlotScores`` per request, in order (the recipe is in the module docstring)."""
        for index, request in enumerate(requests):
            self._check(index, request)
        scores: dict[int, SlotScores] = {}
        with torch.inference_mode(), invariant.batch_invariant(self.invariant):
            boundaries, deferred = self._encode_all(requests)
            joint = [index for index, request in enumerate(requests) if request.prompt_ids in deferred]
            for chunk in self._joint_chunks(joint, requests, deferred, boundaries):
                for part in self._graphable(chunk, requests, deferred, boundaries):
                    batch = [requests[i] for i in part]
                    logits, hidden = self._joint_slot_logits(batch, deferred, boundaries)
                    scores.update(zip(part, self._scored(batch, logits, hidden), strict=True))
            rest = [index for index, request in enumerate(requests) if request.prompt_ids not in deferred]
            reads = {i: self._plan(requests[i], boundaries[requests[i].prompt_ids]) for i in rest}
            # Rows sharing a prompt KV adjacent (one shared part), similar own lengths together.
            # A forward's canvases take one number of denoise steps.
            order = sorted(rest, key=lambda i: (requests[i].steps, reads[i].order_key))
            for _, run in groupby(order, key=lambda i: requests[i].steps):
                same = list(run)
                for start in range(0, len(same), self.max_canvases):
                    chunk = same[start : start + self.max_canvases]
                    batch = [requests[i] for i in chunk]
                    logits, hidden = self._slot_logits(batch, [reads[i] for i in chunk])  # (S, V), (S, H)
                    scores.update(zip(chunk, self._scored(batch, logits, hidden), strict=True))
        return [scores[index] for index in range(len(requests))]

    def think(self, requests: list[ThoughtRequest]) -> list[tuple[int, ...]]:
        """Each request's thought, generated by block diffusion as the library generates, the requests
        together (``diffusion_thought``)."""
        return diffusion_thoughts(self._model, self._schedule, requests) if requests else []

    def counters(self) -> dict[str, int]:
        """Running totals: prefix cache hits and misses, prompt and canvas tokens computed (padding not
        counted), CUDA graphs captured and replayed."""
        graphs = self._graphs
        return {
            "prefix_cache_hits": self.prefix_cache.hits,
            "prefix_cache_misses": self.prefix_cache.misses,
            "prompt_tokens": self._prompt_tokens,
            "canvas_tokens": self._canvas_tokens,
            "graph_captures": graphs.captures if graphs else 0,
            "graph_replays": graphs.replays if graphs else 0,
            "vision_runs": self.vision.runs if self.vision else 0,
            "vision_hits": self.vision.hits if self.vision else 0,
        }

    def _scored(self, batch: list[ReadRequest], logits: torch.Tensor, hidden: torch.Tensor) -> list[SlotScores]:
        """Each request's scores from its slots' rows of ``logits`` (S, V) and ``hidden`` (S, H)."""
        results = score_slot_rows(logits, hidden, [r.slots for r in batch], self._head)
        wanted = [r.hidden for r in batch]
        return with_hidden(results, hidden, wanted) if any(wanted) else results

    def _encode_all(self, requests: Sequence[ReadRequest]) -> tuple[dict[Ids, dict[int, PrefixKV]], dict[Ids, int]]:
        """For each distinct prompt, the KV at every boundary this call found cached or encoded; and
        the prompts whose last segment is left to ``encode_decode`` with their canvases, each with
        the end of its parent segment.

        Each prompt resumes from its longest cached boundary; the segments left are encoded in waves,
        one segment per prompt per wave, the rows of a wave batched by segment length (a boundary
        prefix two prompts share is encoded once).
        """
        found: dict[Ids, dict[int, PrefixKV]] = {}
        todo: dict[Ids, list[int]] = {}  # prompt -> boundary ends still to encode, in order
        for request in requests:
            segments, ids = request.prompt, request.prompt_ids
            if ids in found:
                continue
            ends = sorted({sum(len(s) for s in segments[: k + 1]) for k in range(len(segments))} - {0})
            found[ids] = {}
            for position, end in enumerate(reversed(ends)):
                if (kv := self.prefix_cache.get(ids[:end])) is not None:
                    found[ids][end] = kv
                    ends = ends[len(ends) - position :]
                    break
            todo[ids] = ends
        deferred = self._deferred(requests, found, todo)
        for ends in (todo[ids] for ids in deferred):
            ends.pop()
        images = [image for request in requests for image in request.images]
        features = self.vision.features(images) if images and self.vision is not None else {}
        while any(todo.values()):
            # one row per distinct boundary prefix to encode next, with its parent's length and KV
            rows: dict[Ids, tuple[int, PrefixKV | None]] = {}
            for ids, ends in todo.items():
                if ends:
                    parent = max(found[ids], default=0)
                    rows[ids[: ends[0]]] = (parent, found[ids].get(parent))
            encoded: dict[Ids, PrefixKV] = {}
            for group in self._encoder_batches(rows):
                starts = [rows[prefix][0] for prefix in group]
                parents = [rows[prefix][1] for prefix in group]
                for prefix, kv in zip(group, self._encode_rows(group, starts, parents, features), strict=True):
                    self.prefix_cache.put(prefix, kv)
                    encoded[prefix] = kv
            for ids, ends in todo.items():
                if ends:
                    found[ids][ends[0]] = encoded[ids[: ends[0]]]
                    ends.pop(0)
        return found, deferred

    def _deferred(
        self, requests: Sequence[ReadRequest], found: dict[Ids, dict[int, PrefixKV]], todo: dict[Ids, list[int]]
    ) -> dict[Ids, int]:
        """The prompts whose last segment can be encoded in the same forward as their canvases, each with
        the end of its parent segment (which the canvases then read in place as their shared part): the
        segment is still to encode, it has a parent, no other prompt of the call continues from it,
        and the prompt's reads fit one decoder forward. Isolated questions after one schema defer
        their states this way: one forward for the states and the canvases instead of two."""
        if not self.joint_encode or self.deterministic:
            return {}
        inner = {ids[:end] for ids, ends in todo.items() for end in ends if end < len(ids)}
        reads = Counter(request.prompt_ids for request in requests)
        seeing = {request.prompt_ids for request in requests if request.images}  # encoded by ``encode`` alone
        stepped = {request.prompt_ids for request in requests if request.steps > 1}  # read by ``denoise``
        deferred = {}
        for ids, ends in todo.items():
            apart = ids in seeing or ids in stepped
            if not ends or ends[-1] != len(ids) or ids in inner or reads[ids] > self.max_canvases or apart:
                continue
            boundaries = sorted({*found[ids], *ends})
            if len(boundaries) > 1:
                deferred[ids] = boundaries[-2]
        return deferred

    def _encoder_batches(self, rows: dict[Ids, tuple[int, PrefixKV | None]]) -> Iterable[list[Ids]]:
        """Rows that can share one encoder forward: new lengths in one ``length_bucket`` (shorter rows
        right-padded, which their causal attention never sees), all with or all without a parent, at
        most ``max_encode_tokens`` new tokens together."""

        def key(prefix: Ids) -> tuple[int, bool]:
            return length_bucket(len(prefix) - rows[prefix][0]), rows[prefix][1] is None

        for (new, _), run in groupby(sorted(rows, key=key), key=key):
            # rows sharing a parent adjacent, equal lengths adjacent (``_entries`` joins such runs at once)
            group = sorted(run, key=lambda prefix: (id(rows[prefix][1]), len(prefix)))
            size = max(1, self.max_encode_tokens // new)
            for start in range(0, len(group), size):
                yield group[start : start + size]

    def _encode_rows(
        self,
        prefixes: list[Ids],
        starts: list[int],
        parents: list[PrefixKV | None],
        features: dict[int, torch.Tensor] | None = None,
    ) -> list[PrefixKV]:
        """Encode ``prefix[start:]`` of each row continuing its parent's KV (rows sharing a parent
        adjacent; all rows have one or none), with ``features`` for the images' handles; returns each
        whole prefix's KV."""
        new = self._new_tokens(prefixes, starts, parents, features)
        layers = encode(self._encoder, self._config.layer_types, self._config.sliding_window, new)
        return self._entries(parents, layers, [len(p) - s for p, s in zip(prefixes, starts, strict=True)])

    def _new_tokens(
        self,
        prefixes: list[Ids],
        starts: list[int],
        parents: list[PrefixKV | None],
        features: dict[int, torch.Tensor] | None = None,
    ) -> NewTokens:
        """Encoder rows for ``prefix[start:]`` of each prefix, right-padded to the longest, continuing
        the parents (rows sharing one adjacent; all rows have one or none); an image's handles become
        pad tokens whose embeddings its ``features`` replace."""
        device = self._model.device
        lengths = [len(prefix) - start for prefix, start in zip(prefixes, starts, strict=True)]
        new = max(lengths)  # N
        self._prompt_tokens += sum(lengths)
        parts = [
            SharedPart(rows=len(run), keys=run[0].keys, values=run[0].values)
            for run in (list(run) for _, run in groupby(parents, key=id))
            if run[0] is not None
        ]
        rows = [
            [*prefix[start:], *[self._pad_id] * (new - length)]
            for prefix, start, length in zip(prefixes, starts, lengths, strict=True)
        ]
        images = _image_tokens(rows, features, device, self._image_blocks) if features else None
        if images is not None:
            rows = [[self._pad_id if token < 0 else token for token in row] for row in rows]
        return NewTokens(
            tokens=_on(device, rows),  # (B, N)
            positions=_on(device, [list(range(start, start + new)) for start in starts]),
            parents=parts,
            images=images,
        )

    def _entries(
        self, parents: list[PrefixKV | None], layers: list[tuple[torch.Tensor, torch.Tensor]], lengths: list[int]
    ) -> list[PrefixKV]:
        """Each encoder row's whole-prefix KV: its parent's then its first ``lengths[row]`` new tokens'
        ``layers`` (per layer (B, kvh, N, d)), as much as each layer keeps, joined when first read
        (``PrefixKV.joined``, once for each run of rows with one parent and one length)."""
        held = self._config.sliding_window - 1  # the prompt tokens a sliding layer keeps
        keep = tuple(held if kind == "sliding_attention" else self.max_tokens for kind in self._config.layer_types)
        entries: list[PrefixKV] = []
        rows = list(zip(parents, lengths, strict=True))
        for (_, length), run in groupby(rows, key=lambda row: (id(row[0]), row[1])):
            first = len(entries)
            count = len(list(run))
            keys = tuple(k[first : first + count, :, :length] for k, _ in layers)
            values = tuple(v[first : first + count, :, :length] for _, v in layers)
            entries.extend(PrefixKV.joined(parents[first], keys, values, keep))
        return entries

    def _joint_chunks(
        self,
        indices: list[int],
        requests: list[ReadRequest],
        deferred: dict[Ids, int],
        boundaries: dict[Ids, dict[int, PrefixKV]],
    ) -> Iterable[list[int]]:
        """The requests whose last prompt segment is encoded with their canvases, in forwards of
        segments of similar lengths: taken shortest first, a forward holds at most ``max_canvases``
        canvases and ``max_encode_tokens`` new tokens, counted padded to its longest segment's
        ``length_bucket``, of which at most ``PAD_SHARE`` padding (or one prompt). In a forward a
        prompt's requests are together and prompts continuing one parent adjacent (one shared part)."""
        # each prompt as the index of its first request (comparing and hashing the 1,600-id tuples over
        # and over cost milliseconds per call), with its requests and segment length
        reads: dict[int, list[int]] = {}
        first: dict[Ids, int] = {}
        for index in indices:
            reads.setdefault(first.setdefault(requests[index].prompt_ids, index), []).append(index)

        def new(prompt: int) -> int:
            ids = requests[prompt].prompt_ids
            return len(ids) - deferred[ids]

        def parent(prompt: int) -> int:
            return id(_parent(requests[prompt], deferred, boundaries))

        chunk: list[int] = []  # prompts
        canvases = tokens = 0
        for prompt in sorted(reads, key=new):
            rows, width = len(chunk) + 1, length_bucket(new(prompt))  # the longest so far
            padded = rows * width
            too_many = (
                canvases + len(reads[prompt]) > self.max_canvases
                or padded > self.max_encode_tokens
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

    def _graphable(
        self,
        chunk: list[int],
        requests: list[ReadRequest],
        deferred: dict[Ids, int],
        boundaries: dict[Ids, dict[int, PrefixKV]],
    ) -> list[list[int]]:
        """A joint chunk (prompts continuing one parent adjacent) as one forward per parent where CUDA graphs
        run: a graph replays forwards of one parent only, and eager forwards over a few canvases are
        bound by their ~1,500 launches (165 ms for 3 parents on an H200 host, where one graph replay of
        a parent takes ~20 ms)."""
        if self._graphs is None:
            return [chunk]
        return [list(run) for _, run in groupby(chunk, key=lambda i: id(_parent(requests[i], deferred, boundaries)))]

    def _joint_slot_logits(
        self, batch: list[ReadRequest], deferred: dict[Ids, int], boundaries: dict[Ids, dict[int, PrefixKV]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``_slot_logits`` for requests whose last prompt segment is encoded in the same forward
        (``encode_decode``); the segments' KV are stored in the prefix cache as ``_encode_all`` would.

        A canvas reads its parent's whole held KV and its state's new tokens, with biases hiding what
        its layer's window does not reach (instead of slicing), so a bucketed CUDA graph can serve it.
        """
        prompts = list(dict.fromkeys(request.prompt_ids for request in batch))  # one encoder row each
        starts = [deferred[ids] for ids in prompts]
        parents: list[PrefixKV | None] = [boundaries[ids][start] for ids, start in zip(prompts, starts, strict=True)]
        new = self._new_tokens(prompts, starts, parents)
        row = {ids: k for k, ids in enumerate(prompts)}
        sources = [(_parent(r, deferred, boundaries), 0) for r in batch]
        canvases = self._canvases(batch, [len(request.prompt_ids) for request in batch], self._shared_parts(sources))
        own = [row[request.prompt_ids] for request in batch]
        own_rows = _on(self._model.device, own)
        masks = self._joint_masks(batch, deferred, sources, own, new.tokens.shape[1])
        tokens = (
            bucket(len(prompts)) * length_bucket(new.tokens.shape[1]) + bucket(len(batch)) * canvases.tokens.shape[1]
        )
        joint = None
        if self._graphs is not None and len(new.parents) == 1 and tokens <= GRAPH_TOKENS:
            joint = self._graphs.encode_decode(new, canvases, own_rows, masks)
        if joint is None:
            joint = encode_decode(
                self._decoder, self._config.layer_types, self._config.sliding_window, new, canvases, own_rows, masks
            )
        layers, hidden = joint
        lengths = [len(ids) - start for ids, start in zip(prompts, starts, strict=True)]
        for ids, kv in zip(prompts, self._entries(parents, layers, lengths), strict=True):
            self.prefix_cache.put(ids, kv)
            boundaries[ids][len(ids)] = kv
        return self._head_at_slots(batch, hidden)

    def _joint_masks(
        self,
        batch: list[ReadRequest],
        deferred: dict[Ids, int],
        sources: list[tuple[PrefixKV, int]],
        own_rows: list[int],
        width: int,
    ) -> JointMasks:
        """What each canvas of a joint forward sees: of its state's new tokens (row ``own_rows``, n of the
        row's ``width`` columns before its padding), all n in a full layer and the last ``window - 1`` in
        a sliding one; of its parent's held sliding KV, the keys from ``_skip`` on (the rest of its window)."""
        kinds, device = self._config.layer_types, self._model.device
        # on the device: built on the host (about 600 KB for 96 canvases) and copied, these took 15-19 ms in
        # some processes on an H200 host, which delayed the joint forward's launch (1 ms now)
        lengths = _on(device, [len(r.prompt_ids) - deferred[r.prompt_ids] for r in batch])[:, None]  # (B_c, 1)
        steps = torch.arange(width, device=device)[None, :]
        visible = {"full_attention": torch.where(steps < lengths, 0.0, MASKED)}
        shared = {}
        if "sliding_attention" in kinds:
            index, window = kinds.index("sliding_attention"), self._config.sliding_window - 1
            seen = (steps >= lengths - window) & (steps < lengths)
            visible["sliding_attention"] = torch.where(seen, 0.0, MASKED)
            held = max(kv.keys[index].shape[-2] for kv, _ in sources)
            skips = _on(device, [self._skip(len(r.prompt_ids), deferred[r.prompt_ids]) for r in batch])
            keys = torch.arange(held, device=device)
            shared["sliding_attention"] = torch.where(keys[None, :] >= skips[:, None], 0.0, MASKED)
        # a state's canvases in one run, states in row order (``_joint_chunks`` keeps a prompt's reads together)
        in_order = all(a <= b for a, b in pairwise(own_rows))
        counts = Counter(own_rows)
        states = [0, *accumulate(counts[row] for row in range(len(counts)))]
        return JointMasks(
            {kind: visible[kind] for kind in set(kinds)}, shared, _on(device, states, torch.int32) if in_order else None
        )

    def _skip(self, length: int, split: int) -> int:
        """Where a sliding layer's read of a prompt of ``length`` tokens split at ``split`` starts in
        the shared part's KV: the layer reads prompt positions [length - window, length) and the
        shared KV holds positions [split - held, split)."""
        window = self._config.sliding_window - 1  # prompt tokens a sliding layer holds and reads
        return max(0, (length - window) - (split - min(split, window)))

    def _plan(self, request: ReadRequest, boundaries: dict[int, PrefixKV]) -> _Read:
        """Split the request's prompt into the shared part (the shortest available boundary of at
        least ``shared_min`` tokens, so a schema cached once is read in place by every state after
        it) and its own tokens after that boundary."""
        length = len(request.prompt_ids)
        split = min((end for end in boundaries if end >= min(length, self.shared_min)), default=length)
        shared, full = boundaries[split], boundaries[length]
        skip = self._skip(length, split)
        return _Read(shared, full, split, length, skip, (id(shared), skip, length - split, id(full)))

    def _slot_logits(self, batch: list[ReadRequest], reads: list[_Read]) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 logits (S, V) at every slot of ``batch``, in request then slot order, and the decoder's
        final hidden states (S, H) they come from (after the final norm, on the eager and graph paths alike)."""
        canvases = self._canvases(
            batch, [read.length for read in reads], self._shared_parts([(read.shared, read.skip) for read in reads])
        )
        own = self._own_prompts(reads)
        hidden = None  # (B, C, H)
        if batch[0].steps > 1:
            layer_types = self._config.layer_types
            steps = batch[0].steps
            hidden = denoised_hidden(
                self._decoder, layer_types, self._head, self._schedule, batch, canvases, own, steps
            )
        elif self._graphs is not None and own is None and len(canvases.shared) == 1:
            hidden = self._graphs.decode(canvases)
        if hidden is None:
            hidden = decode(self._decoder, self._config.layer_types, canvases, own)
        return self._head_at_slots(batch, hidden)

    def _canvases(self, batch: list[ReadRequest], lengths: list[int], shared: list[SharedPart]) -> Canvases:
        """The requests' noised canvases, right-padded to one width, after prompts of ``lengths``."""
        device = self._model.device
        columns = max(len(request.canvas) for request in batch)  # C: the padded canvas width
        self._canvas_tokens += sum(len(request.canvas) for request in batch)
        canvases, positions, canvas_bias = [], [], []
        for request, length in zip(batch, lengths, strict=True):
            noised = (
                request.canvas
                if request.seed is None
                else noise_canvas(request.canvas, [slot.position for slot in request.slots], request.seed, self._vocab)
            )
            fill = columns - len(noised)
            canvases.append([*noised, *[self._pad_id] * fill])
            positions.append(list(range(length, length + columns)))
            canvas_bias.append([0.0] * len(noised) + [MASKED] * fill)
        return Canvases(
            tokens=_on(device, canvases),  # (B, C)
            positions=_on(device, positions),  # (B, C)
            bias=_on(device, canvas_bias),  # (B, C)
            shared=shared,
        )

    def _head_at_slots(self, batch: list[ReadRequest], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``lm_head`` and the final softcap at each slot of ``hidden`` (B, C, H): float32 vocabulary logits
        (S, V) and the slots' hidden states (S, H)."""
        device = self._model.device
        rows = [r for r, request in enumerate(batch) for _ in request.slots]
        cols = [slot.position for request in batch for slot in request.slots]
        at_slots = hidden[_on(device, rows), _on(device, cols)]  # (S, H)
        return self._head.vocabulary(at_slots), at_slots

    def _shared_parts(self, sources: list[tuple[PrefixKV, int]]) -> list[SharedPart]:
        """One part per run of rows reading the same shared KV from the same place: each row's
        (shared KV, sliding ``skip``)."""
        parts = []
        sliding = [kind == "sliding_attention" for kind in self._config.layer_types]
        for (_, skip), run in groupby(sources, key=lambda source: (id(source[0]), source[1])):
            group = list(run)
            kv, rows = group[0][0], len(group)
            parts.append(
                SharedPart(
                    rows=rows,
                    keys=tuple(k[..., skip if s else 0 :, :] for k, s in zip(kv.keys, sliding, strict=True)),
                    values=tuple(v[..., skip if s else 0 :, :] for v, s in zip(kv.values, sliding, strict=True)),
                )
            )
        return parts

    def _own_prompts(self, reads: list[_Read]) -> OwnPrompt | None:
        """Each row's prompt tokens after its shared part, left-padded across the batch (None when
        every row reads its whole prompt from a shared part)."""
        if all(read.split == read.length for read in reads):
            return None
        keys, values, biases = [], [], []
        for index in range(len(self._config.layer_types)):
            # a row's own tokens are the last (length - split) columns of its prompt KV, or all that
            # a sliding layer holds
            own = [min(read.length - read.split, read.full.keys[index].shape[-2]) for read in reads]
            width = max(own)
            keys.append(
                _left_padded(
                    [
                        read.full.keys[index][..., -o:, :] if o else read.full.keys[index][..., :0, :]
                        for read, o in zip(reads, own, strict=True)
                    ],
                    width,
                )
            )
            values.append(
                _left_padded(
                    [
                        read.full.values[index][..., -o:, :] if o else read.full.values[index][..., :0, :]
                        for read, o in zip(reads, own, strict=True)
                    ],
                    width,
                )
            )
            biases.append(_on(self._model.device, [[MASKED] * (width - o) + [0.0] * o for o in own]))
        return OwnPrompt(tuple(keys), tuple(values), tuple(biases))

    def _check(self, index: int, request: ReadRequest) -> None:
        """Refuse a request the engine cannot read (a caller's bug, except for its length)."""
        if not request.prompt_ids:
            raise ValueError(f"request {index}: empty prompt (the decoder reads the prompt's KV)")
        if not request.slots:
            raise ValueError(f"request {index}: no slots")
        if not 1 <= request.steps <= MAX_STEPS:
            raise ValueError(f"request {index}: steps must be 1..{MAX_STEPS}, got {request.steps}")
        for slot in request.slots:
            if not 0 <= slot.position < len(request.canvas):
                raise ValueError(f"request {index}: slot position {slot.position} outside the canvas")
            if not slot.label_ids or not all(0 <= i < self._vocab for i in slot.label_ids):
                raise ValueError(f"request {index}: label ids must be 1+ ids below {self._vocab}")
        tokens = len(request.prompt_ids) + len(request.canvas)
        if tokens > self.max_tokens:
            raise PromptTooLong(tokens, self.max_tokens)


def _parent(request: ReadRequest, deferred: dict[Ids, int], boundaries: dict[Ids, dict[int, PrefixKV]]) -> PrefixKV:
    """The KV that a request's deferred last segment continues (its canvases' shared part)."""
    ids = request.prompt_ids
    return boundaries[ids][deferred[ids]]


def _image_tokens(
    rows: list[list[int]], features: dict[int, torch.Tensor], device: torch.device, bidirectional: bool
) -> ImageTokens | None:
    """Where the images' handles sit in encoder ``rows`` (B, N), each run of one handle an image whose
    soft tokens are ``features[handle]`` in order (``bidirectional``: attending to each other both
    ways); None when no row holds one."""
    where: list[int] = []
    parts: list[torch.Tensor] = []
    blocks = [[-1] * len(row) for row in rows]
    for r, row in enumerate(rows):
        image = -1
        for handle, run in groupby(enumerate(row), key=lambda item: item[1]):
            columns = [column for column, _ in run]
            if handle >= 0:
                continue
            image += 1
            if len(columns) != features[handle].shape[0]:
                raise ValueError(
                    f"an image has {len(columns)} placeholders for {features[handle].shape[0]} soft tokens"
                )
            where += [r * len(row) + column for column in columns]
            parts.append(features[handle])
            for column in columns:
                blocks[r][column] = image
    if not where:
        return None
    return ImageTokens(_on(device, where), torch.cat(parts).to(device), _on(device, blocks) if bidirectional else None)


def _tied(model: DiffusionGemmaForBlockDiffusion) -> bool:
    """Whether the encoder's layers, embedding and rotary tables are the decoder's (tied parameters,
    equal buffers), so a joint forward may run new prompt tokens through the decoder's modules."""
    encoder, decoder = model.model.encoder.language_model, model.model.decoder
    pairs = [(getattr(encoder, name), getattr(decoder, name)) for name in ("layers", "embed_tokens", "rotary_emb")]
    tied = all(
        all(a is b for a, b in zip(mine.parameters(), theirs.parameters(), strict=True))
        and all(torch.equal(a, b) for a, b in zip(mine.buffers(), theirs.buffers(), strict=True))
        for mine, theirs in pairs
    )
    if not tied:
        logger.warning("the encoder's layers are not tied to the decoder's: no joint encoding")
    return tied


def _on(device: torch.device, data: object, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(data)`` on ``device`` without a stream sync: a blocking host-to-device copy waits
    for every queued kernel, so the host could not launch a forward (the decoder's) while the GPU
    still runs the last (the encoder's). The data goes through pinned memory (the caching host
    allocator's): from pageable memory the driver may wait for the stream before staging a copy."""
    host = torch.from_numpy(np.array(data))  # 5x faster than torch.tensor from nested lists
    host = host.to(dtype or (torch.float32 if host.is_floating_point() else host.dtype))
    return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)


def _left_padded(tensors: list[torch.Tensor], width: int) -> torch.Tensor:
    """Stack (1, kvh, L_r, hd) tensors into (B, kvh, width, hd), each row left-padded with zeros.

    One tensor shared by every row and already ``width`` long becomes an ``expand`` view (no copy).
    """
    first = tensors[0]
    if first.shape[-2] == width and all(t is first for t in tensors):
        return first.expand(len(tensors), -1, -1, -1)
    return torch.cat([F.pad(t, (0, 0, width - t.shape[-2], 0)) for t in tensors])
