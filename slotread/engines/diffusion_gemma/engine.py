"""The DiffusionGemma engine: every slot of a canvas read in one decoder step.

DiffusionGemma (transformers ``DiffusionGemmaForBlockDiffusion``, 5.17) uses one set of weights twice:
a causal *encoder* writes the prompt into a KV cache, and a *decoder* attends bidirectionally over
that cache plus the canvas and predicts the clean token at every canvas position (no shift). There
is no mask token: the model was trained to denoise uniform random token ids. A read:

1. finds each distinct prompt's longest cached segment boundary in the ``PrefixCache`` and encodes
   the segments left, one per wave, each row continuing its parent's KV (``kv_schedule``,
   ``forward.encode``); the KV of every boundary is stored. A prompt whose new last segment can go
   with its canvases is left to step 3's joint forward (``FastPaths.joint_encode``);
2. noises the canvas: each slot's token becomes a noise token (``noise.noise_canvas``, from the
   request's seed; a request without a seed is read as given);
3. splits each prompt at its shortest available boundary of at least ``shared_min`` tokens: rows
   whose prompts share that boundary read its KV in place, in one attention for all of them, and
   each row attends separately to its own prompt tokens after it and to its canvas (``read_plan``,
   ``assemble``, ``forward.decode``: one step, no self-conditioning; a request with ``steps`` > 1 is
   denoised that many steps, its template pinned, by ``denoise.py``, and never joint-encoded);
4. applies ``lm_head`` to the hidden states at the slots only, then the final softcap
   ``cap * tanh(x / cap)`` in float32 (the vocabulary diagnostics), computes each slot's label logits
   exactly from the output embedding's rows of its labels (``scores.OutputHead``: float64 sums, the
   softcap, float32 out), and keeps them (and, for a request with ``hidden=True``, the slot's hidden
   state).

The library's own ``forward`` builds float32 logits over all 262,144 ids at every canvas position
and copies the prompt's KV into every row of a batch in every layer; steps 3 and 4 do neither. Its
static-cache path hides the last canvas token once the prompt fills the sliding window (DESIGN.md
section 1); this engine keeps no static cache.

Tolerance: a read's result does not depend on the other requests of the call, on chunking or on the
cache state beyond float rounding: within 1e-5 in float32 on the CPU (tests measure it). In bfloat16
batch composition moves logits far more (2.5 on random 26B-A4B weights through the library's own
path, bench/RESULTS.md); ``deterministic=True`` makes a read bit-identical in any batch and cache
state (on a GPU with batch-invariant kernels, ``invariant.py``; elsewhere one read at a time).
The cache state matters through ``joint_encode`` only: a prompt whose last segment is not cached has
it encoded in the canvases' forward, one that finds it cached reads its stored KV, and the two round
differently (float32: 1.3e-6 on the tiny model's logits near 3; bfloat16: up to 0.5 there, random
weights amplifying it). With ``joint_encode`` off a cold and a warm read are bit-identical on the CPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from transformers import DiffusionGemmaForBlockDiffusion

from slotread.engines.base import Family, ReadRequest, SlotScores, check_slots
from slotread.engines.diffusion_gemma import assemble, invariant, kv_schedule, read_plan
from slotread.engines.diffusion_gemma.denoise import MAX_STEPS, Schedule, denoised_hidden
from slotread.engines.diffusion_gemma.fast_paths import FastPaths, taking, tied
from slotread.engines.diffusion_gemma.forward import decode, encode, encode_decode
from slotread.engines.diffusion_gemma.graphs import ForwardGraphs
from slotread.engines.diffusion_gemma.inputs import Canvases, NewTokens, on_device
from slotread.engines.diffusion_gemma.layer_graphs import LayerGraphs
from slotread.engines.diffusion_gemma.read_plan import SHARED_MIN, SplitRead
from slotread.engines.diffusion_gemma.thought import diffusion_thoughts
from slotread.engines.diffusion_gemma.vision import GemmaVision
from slotread.engines.prefix_cache import PrefixCache, PrefixKV
from slotread.engines.scores import OutputHead, score_slot_rows, with_hidden
from slotread.engines.thought import ThoughtRequest
from slotread.errors import PromptTooLong

logger = logging.getLogger(__name__)

#: A prompt's KV is large: a 1,600-token prompt of the 26B-A4B shape holds roughly 240 MB in bfloat16
#: (25 sliding layers x 1,023 tokens x 8 kv heads x 256, plus 5 full layers), so the store is bounded.
DEFAULT_CACHE_BYTES = 2**30

#: A joint forward (new states with their canvases) of at most this many tokens, padded to its
#: bucket, replays a CUDA graph. On an H200 (26B-A4B shape) a 3-canvas decision with a new state
#: takes 38 ms (205 as two eager forwards); at 6,144 and 5,632 padded tokens graphs gained 7% and 3%
#: over the eager joint forward: larger forwards are bound by the GPU.
GRAPH_TOKENS = 8192
#: The most tokens of a forward whose layers replay graph pieces (``layer_graphs.py``; its static
#: buffers hold this many tokens: ~0.5 GB on the 26B-A4B shape). Larger forwards are bound by the GPU.
LAYER_GRAPH_TOKENS = 8192

Ids = tuple[int, ...]


class DiffusionGemmaEngine:
    """Reads label logits at the slots of DiffusionGemma canvases, caching prompt KV across reads.

    ``max_canvases`` bounds the canvases of one decoder forward and ``max_encode_tokens`` the new
    tokens of one encoder forward; ``max_tokens`` (prompt + canvas of one read) defaults to the
    model's ``max_position_embeddings``. ``shared_min`` is where a prompt is split (``SHARED_MIN``).
    ``fast``: the fast paths it may take (``fast_paths.py``; those in effect are logged at start-up).

    ``deterministic=True`` makes a read's result independent of the rest of the call and of the
    cache's state, bit for bit: every canvas reads its whole prompt's KV as one part (the same
    attention parts however much of the prompt was cached), prompts are encoded segment by segment
    (no joint forward), and on a GPU with Triton the forwards run batch-invariant kernels
    (``invariant.py``) and batch as usual; elsewhere every segment is encoded and every canvas
    decoded alone, so each read runs the same shapes whatever else is asked (the batching's cost;
    bench/gpu_reads.py measures both).

    CUDA graphs (``FastPaths.cuda_graphs``): decoder steps whose canvases all read one cached prompt
    replay captured graphs (``graphs.py``), and so do joint forwards of up to ``GRAPH_TOKENS`` tokens
    padded (``read_plan.graph_tokens``), whatever parents their new states continue (a decision's
    isolated questions: one per question); a larger joint forward is run as forwards of whole parents'
    runs, as many parents together as fit a graph (``read_plan.by_parent``), each of which may replay
    one. Every other forward (``FastPaths.layer_graphs``) replays graphs of its
    layers' work between attention calls, keyed by its token count alone (``layer_graphs.py``), up to
    ``LAYER_GRAPH_TOKENS`` tokens.
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
        fast: FastPaths = FastPaths(),  # noqa: B008 (frozen: one shared default is safe)
    ) -> None:
        config = model.config.get_text_config()
        self.max_tokens = int(max_tokens if max_tokens is not None else config.max_position_embeddings)
        self.deterministic = deterministic
        #: batch-invariant kernels: a deterministic read may share its forwards
        self.invariant = deterministic and invariant.available(model.device)
        alone = deterministic and not self.invariant  # one row per forward: fixed shapes for every read
        self.max_canvases = 1 if alone else max_canvases
        self.max_encode_tokens = 1 if alone else max_encode_tokens
        # the whole prompt as the shared part: a read's attention parts do not depend on the cache
        self.shared_min = self.max_tokens if deterministic else shared_min
        #: the fast paths in effect for this model on its device
        self.fast = fast.effective(model, deterministic, self.invariant)
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(DEFAULT_CACHE_BYTES)
        self._model = model.eval()
        self._layer_types = list(config.layer_types)
        self._shape = assemble.Shape.of(model, self.max_tokens)
        self._encoder = model.model.encoder.language_model
        self._decoder = model.model.decoder
        self._head = OutputHead(model.lm_head.weight, softcap=float(config.final_logit_softcapping))
        #: prepares images and runs the vision tower (``vision.py``); a prompt's image segment is
        #: encoded by ``encode`` with the tower's features in place of the image's handles
        self.vision = GemmaVision(model) if getattr(model.config, "vision_config", None) is not None else None
        self._schedule = Schedule.of(model)
        self._graphs = (
            ForwardGraphs(self._decoder, self._layer_types, self._shape.window, GRAPH_TOKENS)
            if self.fast.cuda_graphs
            else None
        )
        self._layer_graphs = LayerGraphs(LAYER_GRAPH_TOKENS) if self.fast.layer_graphs else None
        if self._layer_graphs is not None and tied(model):
            self._layer_graphs.share(self._encoder, self._decoder)
        self._prompt_tokens = 0  # prompt tokens encoded (``counters``)
        self._canvas_tokens = 0  # canvas tokens decoded
        self._forwards = {"encode": 0, "joint": 0, "decode": 0}  # forwards run, by kind (``counters``)
        logger.info(
            "diffusion_gemma engine: %s, max_tokens=%d, max_canvases=%d, prefix cache %d MiB, %s",
            model.dtype,
            self.max_tokens,
            self.max_canvases,
            self.prefix_cache.max_bytes // 2**20,
            self.mode,
        )
        logger.info("diffusion_gemma fast paths on: %s", ", ".join(self.fast.on()) or "none")

    @property
    def mode(self) -> str:
        """How reads are computed: ``batched``, ``batch-invariant`` or ``one at a time`` (deterministic)."""
        return "batch-invariant" if self.invariant else "one at a time" if self.deterministic else "batched"

    def read(self, requests: list[ReadRequest]) -> list[SlotScores]:
        """One ``SlotScores`` per request, in order (the recipe is in the module docstring)."""
        for index, request in enumerate(requests):
            self._check(index, request)
        if not requests:
            return []
        # every forward is queued before any slot is scored: scoring copies to the host, which waits
        # for the GPU, so scoring a forward before launching the next one left the GPU idle meanwhile
        order: list[int] = []
        slot_logits: list[torch.Tensor] = []  # (S, V) per forward
        slot_hidden: list[torch.Tensor] = []  # (S, H) per forward
        with torch.inference_mode(), invariant.batch_invariant(self.invariant), taking(self.fast):
            boundaries, deferred = self._encode_all(requests)
            joint = [index for index, request in enumerate(requests) if request.prompt_ids in deferred]
            chunks = read_plan.joint_chunks(
                joint, requests, deferred, boundaries, self.max_canvases, self.max_encode_tokens
            )
            for chunk in chunks:
                graphed = self._graphed(chunk, requests, deferred, boundaries)
                parts = (
                    [chunk]
                    if graphed or self._graphs is None
                    else read_plan.by_parent(chunk, requests, deferred, boundaries, GRAPH_TOKENS)
                )
                for part in parts:
                    batch = [requests[i] for i in part]
                    fits = graphed or self._graphed(part, requests, deferred, boundaries)
                    logits, hidden = self._joint_slot_logits(batch, deferred, boundaries, fits)
                    order += part
                    slot_logits.append(logits)
                    slot_hidden.append(hidden)
            rest = [index for index, request in enumerate(requests) if request.prompt_ids not in deferred]
            window = self._shape.window
            reads = {
                i: read_plan.split(requests[i], boundaries[requests[i].prompt_ids], self.shared_min, window)
                for i in rest
            }
            for chunk in read_plan.decoder_chunks(rest, requests, reads, self.max_canvases):
                batch = [requests[i] for i in chunk]
                logits, hidden = self._slot_logits(batch, [reads[i] for i in chunk])
                order += chunk
                slot_logits.append(logits)
                slot_hidden.append(hidden)
            batch = [requests[i] for i in order]
            scored = self._scored(batch, torch.cat(slot_logits), torch.cat(slot_hidden))
        scores = dict(zip(order, scored, strict=True))
        return [scores[index] for index in range(len(requests))]

    def prepare(self) -> None:
        """Capture now the CUDA graphs a forward would otherwise capture under traffic: every layer
        piece at every token bucket (``LayerGraphs.capture``; a server's start-up: ~1,800 pieces on
        the 26B-A4B shape). Nothing to do without layer graphs (off a GPU)."""
        if self._layer_graphs is None:
            return
        start = time.monotonic()
        with torch.inference_mode(), taking(self.fast):
            self._layer_graphs.capture(self._decoder, self._layer_types, True)
            self._layer_graphs.capture(self._encoder, self._layer_types, False)
        logger.info(
            "diffusion_gemma: %d layer pieces captured in %.1f s",
            self._layer_graphs.captures,
            time.monotonic() - start,
        )

    def think(self, requests: list[ThoughtRequest]) -> list[tuple[int, ...]]:
        """Each request's thought, generated by block diffusion as the library generates, the requests
        together (``thought.py``)."""
        return diffusion_thoughts(self._model, self._schedule, requests) if requests else []

    def counters(self) -> dict[str, int]:
        """Running totals: prefix cache hits and misses, prompt and canvas tokens computed (padding not
        counted), forwards run by kind (prompt segments encoded alone, joint encode-and-read, reads of
        cached prompts; a graph replay counts as a forward), CUDA graphs of whole forwards captured and
        replayed, and of layer pieces (``layer_graphs.py``)."""
        graphs, pieces = self._graphs, self._layer_graphs
        return {
            "prefix_cache_hits": self.prefix_cache.hits,
            "prefix_cache_misses": self.prefix_cache.misses,
            "prompt_tokens": self._prompt_tokens,
            "canvas_tokens": self._canvas_tokens,
            **{f"{kind}_forwards": count for kind, count in self._forwards.items()},
            "graph_captures": graphs.captures if graphs else 0,
            "graph_replays": graphs.replays if graphs else 0,
            "layer_graph_captures": pieces.captures if pieces else 0,
            "layer_graph_replays": pieces.replays if pieces else 0,
            "vision_runs": self.vision.runs if self.vision else 0,
            "vision_hits": self.vision.hits if self.vision else 0,
        }

    def _scored(self, batch: list[ReadRequest], logits: torch.Tensor, hidden: torch.Tensor) -> list[SlotScores]:
        """Each request's scores from its slots' rows of ``logits`` (S, V) and ``hidden`` (S, H)."""
        results = score_slot_rows(logits, hidden, [r.slots for r in batch], self._head)
        wanted = [r.hidden for r in batch]
        return with_hidden(results, hidden, wanted) if any(wanted) else results

    def _encode_all(self, requests: Sequence[ReadRequest]) -> tuple[kv_schedule.Found, dict[Ids, int]]:
        """For each distinct prompt, the KV at every boundary this call found cached or encoded; and
        the prompts whose last segment is left to ``encode_decode`` with their canvases, each with
        the end of its parent segment (``kv_schedule``)."""
        found, todo = kv_schedule.resume(requests, self.prefix_cache)
        deferred = kv_schedule.deferrable(requests, found, todo, self.max_canvases) if self.fast.joint_encode else {}
        for ends in (todo[ids] for ids in deferred):
            ends.pop()
        images = [image for request in requests for image in request.images]
        features = self.vision.features(images) if images and self.vision is not None else {}

        def encode_wave(rows: kv_schedule.Rows) -> dict[Ids, PrefixKV]:
            encoded: dict[Ids, PrefixKV] = {}
            for group in kv_schedule.encoder_batches(rows, self.max_encode_tokens):
                for prefix, kv in zip(group, self._encode_rows(group, rows, features), strict=True):
                    self.prefix_cache.put(prefix, kv)
                    encoded[prefix] = kv
            return encoded

        kv_schedule.encode_waves(found, todo, encode_wave)
        return found, deferred

    def _encode_rows(
        self, group: list[Ids], rows: kv_schedule.Rows, features: dict[int, torch.Tensor]
    ) -> list[PrefixKV]:
        """Encode each prefix of ``group`` after its parent's end, continuing the parent's KV (``rows``;
        rows sharing a parent adjacent, all with one or none), with ``features`` for the images'
        handles; returns each whole prefix's KV."""
        starts = [rows[prefix][0] for prefix in group]
        parents = [rows[prefix][1] for prefix in group]
        new = self._new_tokens(group, starts, parents, features)
        self._forwards["encode"] += 1
        layers = encode(self._encoder, self._layer_types, self._shape.window, new, self._layer_graphs)
        lengths = [len(p) - s for p, s in zip(group, starts, strict=True)]
        return assemble.kv_entries(parents, layers, lengths, self._shape)

    def _graphed(
        self, indices: list[int], requests: list[ReadRequest], deferred: dict[Ids, int], boundaries: kv_schedule.Found
    ) -> bool:
        """Whether the joint forward of ``requests[indices]`` replays a CUDA graph: graphs run here and
        its padded tokens (``read_plan.graph_tokens``) are at most ``GRAPH_TOKENS``."""
        batch = [requests[i] for i in indices]
        return self._graphs is not None and read_plan.graph_tokens(batch, deferred, boundaries) <= GRAPH_TOKENS

    def _joint_slot_logits(
        self, batch: list[ReadRequest], deferred: dict[Ids, int], boundaries: kv_schedule.Found, graphed: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``_slot_logits`` for requests whose last prompt segment is encoded in the same forward
        (``encode_decode``); the segments' KV are stored in the prefix cache as ``_encode_all`` would.

        A canvas reads its parent's whole held KV and its state's new tokens, with biases hiding what
        its layer's window does not reach (instead of slicing), so a bucketed CUDA graph can serve it;
        ``graphed`` (``_graphed``): one does.
        """
        prompts = list(dict.fromkeys(request.prompt_ids for request in batch))  # one encoder row each
        starts = [deferred[ids] for ids in prompts]
        parents: list[PrefixKV | None] = [boundaries[ids][start] for ids, start in zip(prompts, starts, strict=True)]
        new = self._new_tokens(prompts, starts, parents)
        row = {ids: k for k, ids in enumerate(prompts)}
        sources = [(read_plan.parent_of(r, deferred, boundaries), 0) for r in batch]
        canvases = self._canvases(batch, [len(request.prompt_ids) for request in batch], sources)
        own = [row[request.prompt_ids] for request in batch]
        own_rows = on_device(self._model.device, own)
        masks = assemble.joint_masks(batch, deferred, sources, own, new.tokens.shape[1], self._shape)
        joint = None
        self._forwards["joint"] += 1
        if graphed and self._graphs is not None:
            joint = self._graphs.encode_decode(new, canvases, own_rows, masks)
        if joint is None:
            joint = encode_decode(
                self._decoder, self._layer_types, self._shape.window, new, canvases, own_rows, masks, self._layer_graphs
            )
        layers, hidden = joint
        lengths = [len(ids) - start for ids, start in zip(prompts, starts, strict=True)]
        for ids, kv in zip(prompts, assemble.kv_entries(parents, layers, lengths, self._shape), strict=True):
            self.prefix_cache.put(ids, kv)
            boundaries[ids][len(ids)] = kv
        return self._head_at_slots(batch, hidden)

    def _slot_logits(self, batch: list[ReadRequest], reads: list[SplitRead]) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 logits (S, V) at every slot of ``batch``, in request then slot order, and the decoder's
        final hidden states (S, H) they come from (after the final norm, on the eager and graph paths alike)."""
        canvases = self._canvases(batch, [read.length for read in reads], [(read.shared, read.skip) for read in reads])
        own = assemble.own_prompts(reads, self._shape)
        self._forwards["decode"] += 1
        hidden = None  # (B, C, H)
        if batch[0].steps > 1:
            steps = batch[0].steps
            hidden = denoised_hidden(
                self._decoder, self._layer_types, self._head, self._schedule, batch, canvases, own, steps
            )
        elif self._graphs is not None and own is None and len(canvases.shared) == 1:
            hidden = self._graphs.decode(canvases)
        if hidden is None:
            hidden = decode(self._decoder, self._layer_types, canvases, own, layer_graphs=self._layer_graphs)
        return self._head_at_slots(batch, hidden)

    def _canvases(self, batch: list[ReadRequest], lengths: list[int], sources: list[tuple[PrefixKV, int]]) -> Canvases:
        """The requests' noised canvases after prompts of ``lengths``, each reading its source's shared KV."""
        self._canvas_tokens += sum(len(request.canvas) for request in batch)
        return assemble.canvases(batch, lengths, assemble.shared_parts(sources, self._shape), self._shape)

    def _new_tokens(
        self,
        prefixes: list[Ids],
        starts: list[int],
        parents: list[PrefixKV | None],
        features: dict[int, torch.Tensor] | None = None,
    ) -> NewTokens:
        """``assemble.new_tokens``, counted."""
        self._prompt_tokens += sum(len(prefix) - start for prefix, start in zip(prefixes, starts, strict=True))
        return assemble.new_tokens(prefixes, starts, parents, self._shape, features)

    def _head_at_slots(self, batch: list[ReadRequest], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``lm_head`` and the final softcap at each slot of ``hidden`` (B, C, H): float32 vocabulary logits
        (S, V) and the slots' hidden states (S, H)."""
        device = self._model.device
        rows = [r for r, request in enumerate(batch) for _ in request.slots]
        cols = [slot.position for request in batch for slot in request.slots]
        at_slots = hidden[on_device(device, rows), on_device(device, cols)]  # (S, H)
        return self._head.vocabulary(at_slots), at_slots

    def _check(self, index: int, request: ReadRequest) -> None:
        """Refuse a request the engine cannot read (a caller's bug, except for its length)."""
        if not request.prompt_ids:
            raise ValueError(f"request {index}: empty prompt (the decoder reads the prompt's KV)")
        check_slots(index, request, self._shape.vocab)
        if not 1 <= request.steps <= MAX_STEPS:
            raise ValueError(f"request {index}: steps must be 1..{MAX_STEPS}, got {request.steps}")
        tokens = len(request.prompt_ids) + len(request.canvas)
        if tokens > self.max_tokens:
            raise PromptTooLong(tokens, self.max_tokens)
