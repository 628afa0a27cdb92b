"""The engine wire: a slot read as a vLLM ``POST /v1/completions`` body, and vLLM's response as scores.

Both ends use this module and nothing else of the wire: a remote engine builds bodies
(``completion_bodies``, joined by ``batch_body`` for a slotread replica) and reads responses
(``batch_responses``, ``slot_scores``); ``slotread engine`` checks a body (``parse_completions``),
reads it (``read_request``) and answers (``completion_response``). It knows token ids only, and
imports no server package.

Request, one per at most 128 distinct label ids (a read that needs more is split over several)::

    {"model": str,
     "prompt": [int, ...],              token ids; causal: the prompt and the reply prefix up to the slot
     "max_tokens": int,                 causal 1; diffusion: the canvas length
     "temperature": 0,
     "logprobs": 1,                     alternatives per position; the engine server takes 0 or 1
     "logprob_token_ids": [int, ...],   at most 128 distinct ids whose logprobs come back at every position
     "return_tokens_as_token_ids": true,
     "vllm_xargs": {                    diffusion models only
        "diffusion_seed_canvas": [int, ...], "diffusion_canvas_length": int,
        "diffusion_max_steps": 1, "diffusion_read_only": true,
        "diffusion_pinned": [int, ...]},   only with a seed canvas; a read of k > 1 steps
                                           (diffusion_max_steps: k, up to 8) pins every position
                                           but its slots
     "x_segment_ends": [int, ...],      slotread replicas only: where the prompt's segments end inside it
     "x_positions": [int, ...]}         slotread replicas only, diffusion: the canvas positions to read and
                                        report (the read's slots), increasing; absent: every position

A slotread replica also takes several reads in one body: vLLM's batch form, ``prompt`` a list of
prompts, with what each read asks for on its own in ``x_reads`` (``PER_READ``: an entry's fields
replace the top level's for its prompt)::

    {"model": str, "prompt": [[int, ...], ...], "temperature": 0, "logprobs": 1,
     "return_tokens_as_token_ids": true,
     "x_reads": [{"max_tokens": int, "logprob_token_ids": [...], "vllm_xargs": {...},
                  "x_segment_ends": [...]}, ...]}        one per prompt, at most 256

or, as a gateway sends it (``batch_body``), each distinct prompt segment once in ``x_segments`` and
each read's prompt as the indices of its segments, in order, in its entry's ``x_prompt`` (its segment
ends follow from them; no ``prompt``, no ``x_segment_ends``)::

    {"model": str, "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": true,
     "x_segments": [[int, ...], ...],
     "x_reads": [{"x_prompt": [int, ...], "max_tokens": int, ...}, ...]}

The reads of one body share most of their prompts (a W1 decision's three reads: the same 1,236-token
head and instructions, ~85% of each prompt), each written, parsed and checked token by token where it
is sent whole. Either way the replica answers with one choice per read, ``index`` its place, in the
response below; ``usage`` sums them. The replica reads them in one engine call.

Response, one entry per read position: causal, the next token; diffusion, canvas positions 0..C-1,
or those ``x_positions`` lists, in its order (the decoder's clean-token prediction at each after one
read-only step)::

    {"id": "cmpl-...", "object": "text_completion", "created": int, "model": str,
     "choices": [{"index": 0, "text": "", "finish_reason": "length",
                  "logprobs": {"tokens": ["token_id:N", ...], "token_logprobs": [float, ...],
                               "text_offset": [0, ...], "top_logprobs": [{"token_id:N": float, ...}, ...]}}],
     "usage": {"prompt_tokens": int, "completion_tokens": int, "total_tokens": int}}

``tokens[p]`` is the argmax at position p (greedy: temperature 0), ``token_logprobs[p]`` its
log-probability, ``top_logprobs[p]`` holds the argmax and every requested id. Log-probabilities are a
log-softmax over the whole vocabulary (after the model's softcap), clamped at -9999.0 as vLLM clamps
``-inf``. Softmax over a slot's label log-probabilities equals softmax over its label logits, so a
remote read answers what the in-process read answers.

``x_positions`` spares a slotread replica the positions no slot reads: a W1 read's canvas has 16
positions and one slot, and scoring and answering all 16 (each a softmax over the 262,144-token
vocabulary, then a JSON entry with every requested id) was 16 times the work of the read's one slot
in process. ``x_segment_ends`` carries what a flat token list loses: where the rendered prompt's
pieces (instructions, state, question) end, which a slotread engine's prefix cache is keyed by.
Without it ``slotread engine`` read every prompt as one segment and re-encoded the 1,500-token
instructions shared by every read (bench/RESULTS.md: the gateway at 0.14x of the in-process server).
A gateway sends it, ``x_positions`` and batches only when every replica lists itself ``owned_by:
"slotread"``; vLLM caches prefixes by blocks, and takes one set of sampling fields per request where
the reads of a stage differ.

What is vLLM's documented OpenAI-compatible API: token-id prompts, ``max_tokens``, ``logprobs``,
``return_tokens_as_token_ids`` and its ``token_id:N`` spelling, ``vllm_xargs``, the response shape,
the ``{"error": {...}}`` error shape. What is our reading of vLLM ≥0.30's structured-diffusion
extension, not checked against a running vLLM here: ``logprob_token_ids`` and its cap of 128, the
``diffusion_*`` argument names, ``max_tokens`` equal to the canvas length, and a read-only step
answering at every canvas position.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import accumulate, chain, pairwise
from typing import Any

import numpy as np

from slotread.engines.base import Family, ReadRequest, Slot, SlotScores
from slotread.engines.diffusion_gemma.denoise import MAX_STEPS
from slotread.engines.diffusion_gemma.noise import noise_canvas
from slotread.errors import UnknownModel, WireError

#: vLLM's cap on ``logprob_token_ids`` per request
MAX_LOGPROB_TOKEN_IDS = 128
#: vLLM's floor for a log-probability in a response (it sends this instead of ``-inf``)
LOGPROB_FLOOR = -9999.0
#: how ``return_tokens_as_token_ids`` spells a token
TOKEN_PREFIX = "token_id:"
#: the fields in which the reads of one batched body (``batch_body``) differ; the rest they share
PER_READ = ("max_tokens", "logprob_token_ids", "vllm_xargs", "x_segment_ends", "x_positions")
#: the same in a body that sends its segments apart (``x_segments``): each read's prompt is its ``x_prompt``
PER_SEGMENTED_READ = ("max_tokens", "logprob_token_ids", "vllm_xargs", "x_positions", "x_prompt")
#: prompts one batched body may carry
MAX_BATCH = 256

#: the ``vllm_xargs`` this wire knows
XARGS = (
    "diffusion_seed_canvas",
    "diffusion_canvas_length",
    "diffusion_max_steps",
    "diffusion_read_only",
    "diffusion_pinned",
)

Body = dict[str, Any]
Ids = tuple[int, ...]


# -- client side: ReadRequest -> bodies, responses -> SlotScores ---------------------------------


def completion_bodies(
    request: ReadRequest, family: Family, model: str, vocab_size: int, slotread: bool = False
) -> list[Body]:
    """The completion bodies that read ``request`` on ``model``: one per 128 distinct label ids; for a
    ``slotread`` replica, each carries its prompt's segment ends (``x_segment_ends``) and a diffusion
    read its slots' positions (``x_positions``).

    A diffusion read's canvas is noised here from the request's seed (``noise_canvas``, as the
    in-process engine noises it) and sent as the seed canvas, which the server reads as given; a
    request without a seed is sent as it is. Raises ValueError for a request no engine can read.
    """
    if not request.slots or not all(slot.label_ids for slot in request.slots):
        raise ValueError("a read needs at least one slot, and every slot at least one label id")
    labels = list(dict.fromkeys(i for slot in request.slots for i in slot.label_ids))
    if not all(0 <= i < vocab_size for i in labels):
        raise ValueError(f"label ids must lie below the vocabulary size {vocab_size}")
    positions = sorted({slot.position for slot in request.slots})
    canvas: Ids | None = None  # the seed canvas of a diffusion read
    if family == "causal":
        if len(positions) > 1 or not 0 <= positions[0] <= len(request.canvas):
            raise ValueError(f"a causal read has all its slots at one position within the canvas, not at {positions}")
        prompt = [*request.prompt_ids, *request.canvas[: positions[0]]]
        max_tokens = 1
    elif family == "diffusion":
        if not 0 <= positions[0] <= positions[-1] < len(request.canvas):
            raise ValueError(f"slot positions {positions} are not all within the canvas of {len(request.canvas)}")
        canvas = request.canvas
        if request.seed is not None:
            canvas = noise_canvas(canvas, positions, request.seed, vocab_size)
        prompt, max_tokens = list(request.prompt_ids), len(canvas)
    else:  # vLLM's API has no mask-token read; masked models are read in process
        raise ValueError(f"remote reads support causal and diffusion models, not {family}")
    bodies = []
    for start in range(0, len(labels), MAX_LOGPROB_TOKEN_IDS):
        body: Body = {
            "model": model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 1,
            "logprob_token_ids": labels[start : start + MAX_LOGPROB_TOKEN_IDS],
            "return_tokens_as_token_ids": True,
        }
        if slotread:
            ends = [*accumulate(len(segment) for segment in request.prompt)]
            body["x_segment_ends"] = [end for end in dict.fromkeys(ends) if 0 < end < len(prompt)]
            if canvas is not None:
                body["x_positions"] = positions
        if canvas is not None:
            body["vllm_xargs"] = {
                "diffusion_seed_canvas": list(canvas),
                "diffusion_canvas_length": len(canvas),
                "diffusion_max_steps": request.steps,
                "diffusion_read_only": True,
            }
            if request.steps > 1:
                free = set(positions)
                pinned = (
                    request.pinned if request.pinned is not None else [p for p in range(len(canvas)) if p not in free]
                )
                body["vllm_xargs"]["diffusion_pinned"] = list(pinned)
        bodies.append(body)
    return bodies


def batch_body(bodies: Sequence[Body]) -> Body:
    """One body that reads all of ``bodies`` (``completion_bodies`` of one model) on a slotread replica:
    their prompts' distinct segments (cut at ``x_segment_ends``) once in ``x_segments``, and per body
    an ``x_reads`` entry with its segments' indices (``x_prompt``) and the other fields it does not
    share with the first body. The answer's choice ``i`` is body ``i``'s (``batch_responses``)."""
    if not bodies or len(bodies) > MAX_BATCH:
        raise ValueError(f"a batch holds 1 to {MAX_BATCH} bodies, not {len(bodies)}")
    shared = {key: value for key, value in bodies[0].items() if key != "prompt" and key not in PER_READ}
    segments: dict[Ids, int] = {}
    reads = []
    for body in bodies:
        prompt = body["prompt"]
        cuts = (0, *body.get("x_segment_ends", ()), len(prompt))
        read = {key: body[key] for key in PER_SEGMENTED_READ if key in body}
        read["x_prompt"] = [segments.setdefault(tuple(prompt[a:b]), len(segments)) for a, b in pairwise(cuts)]
        reads.append(read)
    return {**shared, "x_segments": [list(segment) for segment in segments], "x_reads": reads}


def batch_responses(response: Any, count: int) -> list[Body]:
    """The answer to each of the ``count`` bodies of a ``batch_body``, in order, each shaped as the
    answer to that body alone (for ``slot_scores``); WireError when a choice is missing."""
    choices = response.get("choices") if isinstance(response, dict) else None
    if not isinstance(choices, list) or len(choices) != count:
        raise WireError(f"the response must hold {count} choices, one per prompt", "choices")
    by_index = {choice.get("index"): choice for choice in choices if isinstance(choice, dict)}
    missing = next((index for index in range(count) if index not in by_index), None)
    if missing is not None:
        raise WireError(f"the response has no choice of index {missing}", "choices")
    return [{"choices": [by_index[index]]} for index in range(count)]


@dataclass(frozen=True)
class _Position:
    """One position of a response: the argmax, its log-probability, and every logprob sent there."""

    argmax: int
    argmax_logprob: float
    logprobs: dict[int, float]


def slot_scores(request: ReadRequest, bodies: Sequence[Body], responses: Sequence[Any]) -> SlotScores:
    """The scores of ``request`` from the responses to its ``completion_bodies``, in the same order.

    Label logits are the label log-probabilities (softmax over them is softmax over the logits), so
    ``log_normalizer`` is 0 and ``argmax_logit`` the argmax's log-probability; ``label_mass`` sums
    the probabilities of a slot's distinct labels. Raises WireError for a response that lacks
    what its body asked for.
    """
    if not bodies or len(bodies) != len(responses):
        raise ValueError(f"{len(bodies)} bodies and {len(responses)} responses: one response per body")
    diffusion = "vllm_xargs" in bodies[0]
    # the positions each response reports, in order: the slots' (``x_positions``), else the whole canvas
    reported = bodies[0].get("x_positions", range(len(request.canvas))) if diffusion else [0]
    place = {position: index for index, position in enumerate(reported)}
    parsed = [_response_positions(response, len(reported)) for response in responses]
    argmax = parsed[0]  # every body reads the same positions; they differ in the ids asked for
    merged: list[dict[int, float]] = [{} for _ in reported]
    for positions in parsed:
        for into, position in zip(merged, positions, strict=True):
            into.update(position.logprobs)

    logits, masses, hits, top, top_logprob = [], [], [], [], []
    for slot in request.slots:
        p = place[slot.position if diffusion else 0]
        missing = [i for i in slot.label_ids if i not in merged[p]]
        if missing:
            param = f"choices[0].logprobs.top_logprobs[{p}]"
            raise WireError(f"{param} lacks the logprob of requested token {missing[0]}", param)
        logits.append(np.array([merged[p][i] for i in slot.label_ids], dtype=np.float32))
        masses.append(math.fsum(math.exp(merged[p][i]) for i in dict.fromkeys(slot.label_ids)))
        hits.append(argmax[p].argmax in slot.label_ids)
        top.append(argmax[p].argmax)
        top_logprob.append(argmax[p].argmax_logprob)
    return SlotScores(
        logits=tuple(logits),
        label_mass=tuple(masses),
        argmax_is_label=tuple(hits),
        argmax_id=tuple(top),
        argmax_logit=tuple(top_logprob),
        log_normalizer=(0.0,) * len(request.slots),
    )


def _response_positions(response: Any, count: int) -> list[_Position]:
    """The ``count`` positions of a completion response's logprobs."""
    choices = response.get("choices") if isinstance(response, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise WireError("the response has no choices[0]", "choices")
    logprobs = choices[0].get("logprobs")
    if not isinstance(logprobs, dict):
        raise WireError("the response has no choices[0].logprobs", "choices[0].logprobs")
    fields = {}
    for name in ("tokens", "token_logprobs", "top_logprobs"):
        value = logprobs.get(name)
        if not isinstance(value, list) or len(value) != count:
            param = f"choices[0].logprobs.{name}"
            raise WireError(f"{param} must be a list of {count} entries, one per read position", param)
        fields[name] = value
    positions = []
    for p, (token, logprob, top) in enumerate(zip(*fields.values(), strict=True)):
        param = f"choices[0].logprobs.top_logprobs[{p}]"
        if not isinstance(top, dict):
            raise WireError(f"{param} must be an object of token -> logprob", param)
        values = {_token_id(key, param): _logprob(value, param) for key, value in top.items()}
        param = f"choices[0].logprobs.token_logprobs[{p}]"
        positions.append(
            _Position(_token_id(token, f"choices[0].logprobs.tokens[{p}]"), _logprob(logprob, param), values)
        )
    return positions


def _token_id(text: Any, param: str) -> int:
    digits = text.removeprefix(TOKEN_PREFIX) if isinstance(text, str) and text.startswith(TOKEN_PREFIX) else ""
    if not digits.isdigit():
        raise WireError(f"{param}: {text!r} is not a token id ('token_id:N'; send return_tokens_as_token_ids)", param)
    return int(digits)


def _logprob(value: Any, param: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise WireError(f"{param}: {value!r} is not a log-probability", param)
    return float(value)


# -- server side: body -> CompletionRead -> ReadRequest, SlotScores -> response ------------------


@dataclass(frozen=True)
class CompletionRead:
    """What one completions body asks the engine server to read, checked."""

    prompt: Ids
    #: a diffusion read's seed canvas, read at every position; None for a causal read (the next token)
    canvas: Ids | None
    #: the distinct ``logprob_token_ids``, in request order
    token_ids: Ids
    #: a diffusion read's denoise steps (``diffusion_max_steps``) and the positions they hold
    steps: int = 1
    pinned: Ids = ()
    #: where the prompt's segments end inside it (``x_segment_ends``), increasing
    segment_ends: Ids = ()
    #: a diffusion read's canvas positions to read and report (``x_positions``); () every position
    reported: Ids = ()

    @property
    def at(self) -> Ids:
        """The positions the response reports, in order: a causal read's next token (0), else the
        canvas positions asked for."""
        if self.canvas is None:
            return (0,)
        return self.reported or tuple(range(len(self.canvas)))

    @property
    def positions(self) -> int:
        """How many positions the response reports."""
        return len(self.at)


def parse_completions(
    body: Any, *, model: str, family: Family, vocab_size: int, max_model_len: int
) -> list[CompletionRead]:
    """The reads of a completions body, each checked as ``parse_completion`` checks one: a body whose
    ``prompt`` is a list of prompts (vLLM's batch form) reads each, with its own ``PER_READ`` fields
    from ``x_reads`` (the top level's where an entry leaves one out); a body with ``x_segments``
    (``batch_body``) reads one prompt per ``x_reads`` entry, joined from the segments its ``x_prompt``
    lists. An error in one read names it (``prompt[i]``, ``x_reads[i].FIELD``)."""

    def one(read: Any) -> CompletionRead:
        return parse_completion(read, model=model, family=family, vocab_size=vocab_size, max_model_len=max_model_len)

    if isinstance(body, dict) and "x_segments" in body:
        return _segmented_reads(body, model=model, family=family, vocab_size=vocab_size, max_model_len=max_model_len)
    prompts = body.get("prompt") if isinstance(body, dict) else None
    if not (isinstance(prompts, list) and prompts and all(isinstance(prompt, list) for prompt in prompts)):
        if isinstance(body, dict) and "x_reads" in body:
            raise WireError("x_reads needs prompt to be a list of prompts, one per entry, or x_segments", "x_reads")
        return [one(body)]
    assert isinstance(body, dict)
    if len(prompts) > MAX_BATCH:
        raise WireError(f"prompt holds {len(prompts)} prompts; at most {MAX_BATCH} per request", "prompt")
    overrides = body.get("x_reads", [{}] * len(prompts))
    if not isinstance(overrides, list) or len(overrides) != len(prompts):
        raise WireError(f"x_reads must be a list of {len(prompts)} objects, one per prompt", "x_reads")
    shared = {key: value for key, value in body.items() if key not in ("prompt", "x_reads")}
    reads = []
    for index, (prompt, override) in enumerate(zip(prompts, overrides, strict=True)):
        _check_entry(override, index, PER_READ)
        with _naming_read(index, override, f"prompt[{index}]"):
            reads.append(one({**shared, "prompt": prompt, **override}))
    return reads


def _segmented_reads(
    body: dict[str, Any], *, model: str, family: Family, vocab_size: int, max_model_len: int
) -> list[CompletionRead]:
    """``parse_completions`` of a body with ``x_segments``: each segment is checked once, each read's
    prompt is the join of the segments its ``x_prompt`` lists, and its segment ends fall between them."""
    _check_model(body, model)
    if "prompt" in body:
        raise WireError("prompt: a body with x_segments gives each read's prompt in x_reads[i].x_prompt", "prompt")
    listed = body["x_segments"]
    if not isinstance(listed, list) or not listed:
        raise WireError("x_segments must be a non-empty list of token id lists", "x_segments")
    segments = [_ids(segment, f"x_segments[{k}]", vocab_size) for k, segment in enumerate(listed)]
    empty = next((k for k, segment in enumerate(segments) if not segment), None)
    if empty is not None:
        raise WireError(f"x_segments[{empty}]: empty; a segment holds at least one token", f"x_segments[{empty}]")
    entries = body.get("x_reads")
    if not isinstance(entries, list) or not 0 < len(entries) <= MAX_BATCH:
        raise WireError(f"x_reads must be a list of 1 to {MAX_BATCH} objects, one per read", "x_reads")
    shared = {key: value for key, value in body.items() if key not in ("x_segments", "x_reads")}
    reads = []
    for index, entry in enumerate(entries):
        _check_entry(entry, index, PER_SEGMENTED_READ)
        param = f"x_reads[{index}].x_prompt"
        picked = entry.get("x_prompt")
        if not (isinstance(picked, list) and picked and all(type(k) is int and 0 <= k < len(segments) for k in picked)):
            raise WireError(
                f"{param} must be a non-empty list of indices into x_segments (0 to {len(segments) - 1})", param
            )
        fields = {key: value for key, value in entry.items() if key != "x_prompt"}
        prompt = tuple(chain.from_iterable(segments[k] for k in picked))
        ends = tuple(accumulate(len(segments[k]) for k in picked[:-1]))
        with _naming_read(index, entry, param):
            reads.append(
                _checked(
                    {**shared, **fields},
                    prompt,
                    ends,
                    model=model,
                    family=family,
                    max_model_len=max_model_len,
                    vocab_size=vocab_size,
                )
            )
    return reads


def _check_entry(entry: Any, index: int, fields: tuple[str, ...]) -> None:
    """An ``x_reads`` entry: an object holding only ``fields``."""
    if not isinstance(entry, dict):
        raise WireError(f"x_reads[{index}] must be an object", f"x_reads[{index}]")
    unknown = next((key for key in entry if key not in fields), None)
    if unknown is not None:
        raise WireError(
            f"x_reads[{index}].{unknown}: an entry holds only {', '.join(fields)}", f"x_reads[{index}].{unknown}"
        )


@contextmanager
def _naming_read(index: int, entry: dict[str, Any], prompt_param: str) -> Iterator[None]:
    """A WireError of read ``index`` of a batch, said of that read: its message prefixed ``prompt
    INDEX:``, its field named within the batch (``prompt_param`` for the prompt, ``x_reads[INDEX].FIELD``
    for a field of its entry, the field itself for one shared by the batch)."""
    try:
        yield
    except WireError as exc:
        root = (exc.param or "").split(".")[0]
        param = prompt_param if root == "prompt" else f"x_reads[{index}].{exc.param}" if root in entry else exc.param
        raise WireError(f"prompt {index}: {exc.message}", param) from None


def parse_completion(body: Any, *, model: str, family: Family, vocab_size: int, max_model_len: int) -> CompletionRead:
    """Check a completions body against the served model the way vLLM does; raises WireError (400) or
    UnknownModel (404). Fields that change nothing in a read (``top_p``, ``seed``, ...) are ignored."""
    if not isinstance(body, dict):
        raise WireError("the body must be a JSON object", None)
    _check_model(body, model)
    prompt = _ids(body.get("prompt"), "prompt", vocab_size)
    read = _checked(body, prompt, (), model=model, family=family, vocab_size=vocab_size, max_model_len=max_model_len)
    return replace(read, segment_ends=_segment_ends(body.get("x_segment_ends"), len(prompt)))


def _checked(
    body: dict[str, Any],
    prompt: Ids,
    segment_ends: Ids,
    *,
    model: str,
    family: Family,
    vocab_size: int,
    max_model_len: int,
) -> CompletionRead:
    """``parse_completion``'s checks after the model and the prompt's ids: the rest of ``body``, and
    the prompt's length; the read has ``segment_ends``."""
    if not prompt:
        raise WireError("prompt: empty; send the prompt's token ids", "prompt")
    max_tokens = body.get("max_tokens")
    if type(max_tokens) is not int or max_tokens < 1:
        raise WireError("max_tokens must be a positive integer", "max_tokens")
    if body.get("temperature") not in (None, 0):
        raise WireError("temperature must be 0: this server reads, it does not sample", "temperature")
    logprobs = body.get("logprobs")
    if type(logprobs) is not int or logprobs not in (0, 1):
        raise WireError(
            f"logprobs must be 0 or 1, not {logprobs!r}: this server reports the top token at each position; "
            "ask for other tokens with logprob_token_ids",
            "logprobs",
        )
    token_ids = tuple(dict.fromkeys(_ids(body.get("logprob_token_ids", []), "logprob_token_ids", vocab_size)))
    if len(token_ids) > MAX_LOGPROB_TOKEN_IDS:
        raise WireError(
            f"logprob_token_ids has {len(token_ids)} distinct ids; at most {MAX_LOGPROB_TOKEN_IDS} per request "
            "(split the read)",
            "logprob_token_ids",
        )
    for field, expected, why in (
        ("return_tokens_as_token_ids", True, "tokens are always sent as 'token_id:N'"),
        ("stream", False, "this server does not stream"),
        ("echo", False, "this server does not echo the prompt"),
        ("n", 1, "a read has one answer"),
    ):
        value = body.get(field)
        if value is not None and (type(value) is not type(expected) or value != expected):
            raise WireError(f"{field} must be {json.dumps(expected)} or absent: {why}", field)
    if body.get("prompt_logprobs") is not None:
        raise WireError(
            "prompt_logprobs must be null or absent: this server reports the read positions only", "prompt_logprobs"
        )
    xargs = body.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        raise WireError("vllm_xargs must be an object", "vllm_xargs")
    for key in xargs or {}:
        if key not in XARGS:
            raise WireError(f"vllm_xargs.{key}: unknown; this server takes {', '.join(XARGS)}", f"vllm_xargs.{key}")
    if family == "causal":
        if xargs:
            key = next(iter(xargs))
            raise WireError(
                f"vllm_xargs.{key}: {model} is a causal model; diffusion arguments are for diffusion models",
                f"vllm_xargs.{key}",
            )
        if max_tokens != 1:
            raise WireError("max_tokens must be 1: a causal read reports the next token", "max_tokens")
        if body.get("x_positions") is not None:
            raise WireError(
                "x_positions: a causal read reports the next token; positions are a canvas's", "x_positions"
            )
        canvas = None
    else:
        canvas = _seed_canvas(xargs, max_tokens, vocab_size)
    total = len(prompt) + max_tokens
    if total > max_model_len:
        raise WireError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested {total} "
            f"tokens ({len(prompt)} in the prompt, {max_tokens} in the completion).",
            "prompt",
        )
    if canvas is None:
        return CompletionRead(prompt, None, token_ids, segment_ends=segment_ends)
    assert xargs is not None
    steps, pinned = xargs["diffusion_max_steps"], tuple(xargs.get("diffusion_pinned") or ())
    reported = _positions(body.get("x_positions"), len(canvas))
    return CompletionRead(prompt, canvas, token_ids, steps, pinned, segment_ends, reported)


def _positions(value: Any, length: int) -> Ids:
    """``x_positions``: absent, or increasing positions of a canvas of ``length`` tokens."""
    if value is None:
        return ()
    if (
        not isinstance(value, list)
        or not value
        or not all(type(p) is int and 0 <= p < length for p in value)
        or any(a >= b for a, b in pairwise(value))
    ):
        raise WireError(
            f"x_positions must be a non-empty list of canvas positions (0 to {length - 1}), increasing strictly",
            "x_positions",
        )
    return tuple(value)


def _check_model(body: dict[str, Any], model: str) -> None:
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise WireError("model must be a string", "model")
    if name is not None and name != model:
        raise UnknownModel(name, [model])


def _segment_ends(value: Any, length: int) -> Ids:
    """``x_segment_ends``: absent, or increasing ends strictly inside a prompt of ``length`` tokens."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(type(end) is int for end in value):
        raise WireError("x_segment_ends must be a list of integers", "x_segment_ends")
    if any(not 0 < end < length for end in value) or any(a >= b for a, b in pairwise(value)):
        raise WireError(
            f"x_segment_ends must increase strictly, each inside the {length}-token prompt (1..{length - 1})",
            "x_segment_ends",
        )
    return tuple(value)


def _seed_canvas(xargs: dict[str, Any] | None, max_tokens: int, vocab_size: int) -> Ids:
    """The seed canvas of a diffusion body, after checking every ``diffusion_*`` argument."""
    if xargs is None:
        raise WireError(
            "vllm_xargs: a diffusion read needs diffusion_seed_canvas, diffusion_canvas_length, "
            f"diffusion_max_steps (1 to {MAX_STEPS}) and diffusion_read_only true",
            "vllm_xargs",
        )
    seed, pinned = xargs.get("diffusion_seed_canvas"), xargs.get("diffusion_pinned")
    if pinned is not None and seed is None:
        raise WireError(
            "vllm_xargs.diffusion_pinned needs diffusion_seed_canvas: pins hold tokens of a given canvas",
            "vllm_xargs.diffusion_pinned",
        )
    if seed is None:
        raise WireError(
            "vllm_xargs.diffusion_seed_canvas: required; this server reads a given canvas",
            "vllm_xargs.diffusion_seed_canvas",
        )
    canvas = _ids(seed, "vllm_xargs.diffusion_seed_canvas", vocab_size)
    length = xargs.get("diffusion_canvas_length")
    if type(length) is not int or length < 1:
        raise WireError(
            "vllm_xargs.diffusion_canvas_length must be a positive integer", "vllm_xargs.diffusion_canvas_length"
        )
    if len(canvas) != length:
        raise WireError(
            f"vllm_xargs.diffusion_seed_canvas has {len(canvas)} tokens; diffusion_canvas_length is {length}",
            "vllm_xargs.diffusion_seed_canvas",
        )
    if max_tokens != length:
        raise WireError(
            f"max_tokens is {max_tokens}; a diffusion read's completion is its canvas of {length} tokens",
            "max_tokens",
        )
    # vLLM passes xargs through pydantic's lax mode, where JSON true arrives as 1: accept both.
    steps = xargs.get("diffusion_max_steps")
    if type(steps) is not int or not 1 <= steps <= MAX_STEPS:
        raise WireError(
            f"vllm_xargs.diffusion_max_steps must be 1 to {MAX_STEPS}: this server reads after at most "
            f"{MAX_STEPS} denoise steps",
            "vllm_xargs.diffusion_max_steps",
        )
    if xargs.get("diffusion_read_only") not in (True, 1):
        raise WireError(
            "vllm_xargs.diffusion_read_only must be true: this server only reads, it does not generate",
            "vllm_xargs.diffusion_read_only",
        )
    if pinned is not None:
        # A pin holds its token through later steps: in a one-step read it changes nothing.
        param = "vllm_xargs.diffusion_pinned"
        if not isinstance(pinned, list) or not all(type(p) is int and 0 <= p < length for p in pinned):
            raise WireError(f"{param} must be a list of canvas positions, each from 0 to {length - 1}", param)
        if len(set(pinned)) != len(pinned):
            raise WireError(f"{param} lists a position twice", param)
    return canvas


def _ids(value: Any, param: str, vocab_size: int) -> Ids:
    """A list of token ids, each in the vocabulary."""
    if not isinstance(value, list) or not all(type(i) is int for i in value):
        raise WireError(f"{param} must be a list of integer token ids", param)
    outside = next((i for i in value if not 0 <= i < vocab_size), None)
    if outside is not None:
        raise WireError(f"{param}: token id {outside} is out of vocabulary (0 to {vocab_size - 1})", param)
    return tuple(value)


def read_request(read: CompletionRead) -> ReadRequest:
    """The engine read of a checked body: the next token (causal) or the canvas positions it asks for
    (diffusion: ``x_positions``, else all), each scoring the requested ids; the canvas is read as given
    (``seed=None``)."""
    # Engines score at least one label per slot: id 0 stands in when none was asked for, unreported.
    labels = read.token_ids or (0,)
    cuts = (0, *read.segment_ends, len(read.prompt))
    prompt = tuple(read.prompt[start:end] for start, end in pairwise(cuts))
    if read.canvas is None:
        return ReadRequest(prompt=prompt, canvas=(), slots=(Slot(0, labels),), seed=None)
    slots = tuple(Slot(position, labels) for position in read.at)
    return ReadRequest(prompt=prompt, canvas=read.canvas, slots=slots, seed=None, steps=read.steps, pinned=read.pinned)


def completion_response(reads: Sequence[CompletionRead], scores: Sequence[SlotScores], model: str) -> Body:
    """The vLLM response body for ``scores``, the results of ``read_request`` on each of ``reads``: one
    choice per read, ``index`` its place in the body's prompts."""
    choices = [
        _choice(index, read, read_scores) for index, (read, read_scores) in enumerate(zip(reads, scores, strict=True))
    ]
    prompt_tokens = sum(len(read.prompt) for read in reads)
    completion_tokens = sum(read.positions for read in reads)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _choice(index: int, read: CompletionRead, scores: SlotScores) -> Body:
    """One choice of a response: the argmax and the requested ids' log-probabilities at each position."""
    tokens, token_logprobs, top_logprobs = [], [], []
    for p in range(read.positions):
        shift = scores.log_normalizer[p]
        argmax = _floored(scores.argmax_logit[p] - shift)
        top = {f"{TOKEN_PREFIX}{scores.argmax_id[p]}": argmax}
        if read.token_ids:  # else the slot scored only the stand-in label
            for token, logit in zip(read.token_ids, scores.logits[p], strict=True):
                top[f"{TOKEN_PREFIX}{token}"] = _floored(float(logit) - shift)
        tokens.append(f"{TOKEN_PREFIX}{scores.argmax_id[p]}")
        token_logprobs.append(argmax)
        top_logprobs.append(top)
    logprobs = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "text_offset": [0] * read.positions,  # the text is empty: tokens go as ids
        "top_logprobs": top_logprobs,
    }
    return {"index": index, "text": "", "finish_reason": "length", "logprobs": logprobs}


def _floored(logprob: float) -> float:
    # JSON has no -inf (nor NaN); vLLM sends -9999.0 for a token the model rules out.
    return max(logprob, LOGPROB_FLOOR) if math.isfinite(logprob) else LOGPROB_FLOOR
