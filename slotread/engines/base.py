"""The engine contract: token ids in, per-slot label logits out.

An engine knows token ids, positions and noise seeds; it knows nothing of wire formats, questions
or prompt text. Every model family implements the one method ``Engine.read``.

A read is one forward over ``prompt + canvas``:

* causal models read slot ``i`` from the logits at position ``i - 1`` (next-token prediction);
  the canvas is the reply prefix followed by the slot, and nothing after the first slot is fed.
* DiffusionGemma encodes the prompt into a KV cache, replaces each slot of the canvas by a noise
  token drawn from ``seed``, and reads every slot at its own position in one decoder step.
* masked models (BERT family, ModernBERT, LLaDA, Dream) put the mask token at each slot and read
  every slot in one bidirectional forward over the whole sequence, at the slot's position (Dream:
  one before it).

``prompt`` is split into segments: an engine may cache the KV of every prefix that ends on a
segment boundary (for example the system text, then the state), so reads sharing those segments
share that work. Splitting changes the result by float rounding only; the engines encode a prompt
segment by segment, so the same segments give the same KV whether or not they were cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain
from typing import Literal, Protocol, runtime_checkable

import numpy as np

Family = Literal["causal", "diffusion", "masked"]


@dataclass(frozen=True)
class Slot:
    """One answer slot: its index in the canvas and the token ids of its labels, in option order."""

    position: int
    label_ids: tuple[int, ...]


@dataclass(frozen=True)
class ImageInput:
    """An image in a prompt, prepared by the model's image processor (``ImageReader.prepare``).

    In the prompt ids the image is ``ids``: the begin-of-image token, ``tokens`` copies of ``handle``,
    the end-of-image token. ``handle`` is a negative id drawn from the image bytes' hash: it stands for
    the image's soft tokens, so every key an engine builds from prompt ids (its prefix cache, its
    batches) tells two images apart, and the engine swaps the vision tower's features in for it.
    ``pixel_values`` (patches, patch_size² x 3) and ``position_ids`` (patches, 2; (-1, -1) for padding)
    are the processor's output for the vision tower.
    """

    handle: int
    tokens: int
    ids: tuple[int, ...]
    pixel_values: np.ndarray = field(compare=False, repr=False)
    position_ids: np.ndarray = field(compare=False, repr=False)


@runtime_checkable
class ImageReader(Protocol):
    """What an engine that reads images exposes as its ``vision`` attribute."""

    def prepare(self, pixels: np.ndarray, digest: bytes) -> ImageInput:
        """The image (RGB (H, W, 3) uint8, ``digest`` the sha256 of its file) as the model takes it."""
        ...


def vision_of(engine: object) -> ImageReader | None:
    """The engine's image reader, or None when it reads text only."""
    vision = getattr(engine, "vision", None)
    return vision if isinstance(vision, ImageReader) else None


@dataclass(frozen=True)
class ReadRequest:
    """One read: prompt segments, the canvas, its slots, and the noise seed (diffusion only).

    ``seed=None`` reads the canvas exactly as given: a caller that noised it already (the engine
    server, receiving a vLLM seed canvas) must not have it noised twice. ``hidden=True`` asks for each
    slot's final hidden state too (``SlotScores.hidden``; in-process engines only, a remote engine
    returns none). ``images``: the images whose handles the prompt holds (engines with a ``vision``).
    ``steps`` > 1 (DiffusionGemma only) denoises the canvas that many decoder steps,
    the ``pinned`` positions held at their given tokens (None: every position but the slots), and reads
    the last step (``engines/diffusion_gemma/denoise.py``).
    """

    prompt: tuple[tuple[int, ...], ...]
    canvas: tuple[int, ...]
    slots: tuple[Slot, ...]
    seed: int | None = 0
    hidden: bool = False
    images: tuple[ImageInput, ...] = ()
    steps: int = 1
    pinned: tuple[int, ...] | None = None

    @cached_property
    def prompt_ids(self) -> tuple[int, ...]:
        """The whole prompt as one id sequence (built once: engines look it up many times per read,
        and building it costs ~80 µs at 1,600 tokens), hashed once too (``HashedIds``)."""
        return HashedIds(chain.from_iterable(self.prompt))


class HashedIds(tuple[int, ...]):
    """A tuple of ids that computes its hash once: an engine looks a read's prompt up in dicts about a
    dozen times per read, and hashing 1,600 ids takes 3-8 µs each time (a plain tuple never caches
    it). Equal to, and hashed as, the plain tuple of the same ids."""

    _hash: int

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:
            self._hash = tuple.__hash__(self)
            return self._hash


def check_slots(index: int, request: ReadRequest, vocab: int, *, end_ok: bool = False) -> None:
    """Refuse request ``index`` if an engine cannot read its slots: it has none, one lies outside the
    canvas (``end_ok``: the position just past its end is inside, as for a causal read, which feeds
    nothing from its slot on), or one's label ids are none or not all below ``vocab``. A caller's bug,
    so ``ValueError``."""
    if not request.slots:
        raise ValueError(f"request {index}: no slots")
    for slot in request.slots:
        if not 0 <= slot.position < len(request.canvas) + end_ok:
            raise ValueError(f"request {index}: slot position {slot.position} outside the canvas")
        if not slot.label_ids or not all(0 <= i < vocab for i in slot.label_ids):
            raise ValueError(f"request {index}: label ids must be 1+ ids below {vocab}")


@dataclass(frozen=True)
class SlotScores:
    """What a read returns, per slot in request order.

    ``logits[i]`` holds the float32 logits of slot i's label ids (same order as ``label_ids``), exact: the
    in-process engines compute them apart from the vocabulary projection, from the slot's hidden state
    and the output embedding's rows of those ids, summed in float64 (``engines/scores.py``), so a
    bfloat16 model's labels are not rounded to its 8-bit steps (a remote engine returns what its
    server computed). The vocabulary diagnostics come from the full-vocabulary logits in the model's
    dtype, with the label columns replaced by the exact values:
    ``label_mass[i]`` is the probability the full vocabulary softmax puts on those labels together;
    ``argmax_is_label[i]`` says whether the vocabulary argmax at the slot is one of the labels;
    ``argmax_id[i]`` and ``argmax_logit[i]`` are that argmax token and its logit, and
    ``log_normalizer[i]`` the logsumexp of the slot's full-vocabulary logits, so that
    ``logit - log_normalizer`` is a token's log-probability (what a vLLM-style engine server returns).
    ``hidden[i]``, when the request asked for it, is slot i's final hidden state in float32: the
    vector the output embedding (``lm_head``) sees at the row that reads the slot, after the final
    norm, so that the engine's head transform (``lm_head``, then any logit scale or softcap) of it
    gives the slot's logits. Learned readouts (``slotread.quality.readouts``) use it as features.
    """

    logits: tuple[np.ndarray, ...]
    label_mass: tuple[float, ...]
    argmax_is_label: tuple[bool, ...]
    argmax_id: tuple[int, ...]
    argmax_logit: tuple[float, ...]
    log_normalizer: tuple[float, ...]
    hidden: tuple[np.ndarray, ...] | None = None


class Engine(Protocol):
    """Reads label logits at answer slots.

    ``read`` returns one ``SlotScores`` per request, in order. Results are deterministic for a fixed
    seed and a fixed batch, and a request's result does not depend on the other requests in the call
    or on what the engine cached beyond float rounding, which matrix kernels do differently per batch
    shape. Each engine's docstring gives its tolerance; in short, on the CPU (same torch build and
    thread count): the causal engine is bit-identical in any batch and cache state at its default of
    one row per forward; batched rows (causal with ``max_batch_rows`` > 1, masked, DiffusionGemma) are
    within 1e-5 in float32 on the tiny test models and about 1e-6 of the logit size on real weights
    (1.2e-5 on SmolLM2's logits near 20), and move further in bfloat16; DiffusionGemma's cold and warm
    reads differ by float rounding too (a new last segment is encoded with its canvases).
    """

    family: Family
    #: True when reads depend on ``seed`` (noise at the slots), so repeated draws carry information.
    noisy: bool
    #: the most prompt + canvas tokens one read may have
    max_tokens: int
    #: True when a read's result is bit-identical whatever else is in its batch and whatever the
    #: prefix cache holds (causal and masked engines at one row per forward, DiffusionGemma's
    #: ``deterministic`` mode); False where batch composition may move it within the tolerance above
    deterministic: bool

    def read(self, requests: list[ReadRequest]) -> list[SlotScores]: ...


@runtime_checkable
class Counted(Protocol):
    """An engine that counts its work (the server exports the counts as metrics)."""

    def counters(self) -> dict[str, int]:
        """Running totals since the engine was built, by name (``prefix_cache_hits``, ...)."""
        ...
