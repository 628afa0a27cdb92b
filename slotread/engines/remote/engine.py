"""``RemoteEngine``: the engine contract over remote replicas that speak vLLM's completions API.

A replica is a ``slotread engine`` server or vLLM serving the same model. A read becomes one or more
completions bodies (``wire.completion_bodies``: one per 128 label ids, vLLM's cap, with a
DiffusionGemma canvas noised here from the read's seed), every body of one ``read`` call (all reads
of a decision stage) goes out at once through the ``ReplicaPool``, and the answers are assembled
back into ``SlotScores`` (``wire.slot_scores``). To vLLM each body is its own request. When every
replica is a slotread engine, the bodies of one call go in one request (``wire.batch_body``, up to
``BATCH`` bodies each), which the replica reads as one engine batch: one HTTP round trip and one
JSON body per decision stage instead of one per read. Over all callers at most ``max_in_flight``
requests are in flight. A call waits until its decision's deadline (``engines.deadline``), else
``timeout_s``; the pool says what happens to a replica that is slow, and to one that is gone.
Bodies are written and answers parsed in the calling thread: the pool's loop only moves bytes.

At construction every replica is asked for ``GET /v1/models``: one serving another model stops
start-up with ModelLoadError, and ``max_tokens`` is the smallest ``max_model_len`` among those that
answered. A replica that joins later (or comes back after a restart) is admitted only if it serves
the model with at least that length, and, where the gateway batches, is a slotread engine.

vLLM's API returns no hidden states: a request's ``hidden`` flag is ignored and ``SlotScores.hidden``
stays None (learned readouts on hidden states are refused above the engine, see ``quality.readouts``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import httpx

from slotread.engines.base import Family, ReadRequest, SlotScores
from slotread.engines.deadline import answer_by
from slotread.engines.remote.pool import ReplicaPool
from slotread.engines.remote.wire import batch_body, batch_responses, completion_bodies, slot_scores
from slotread.errors import ModelLoadError, SlotreadError, UpstreamError, WireError

logger = logging.getLogger(__name__)

COMPLETIONS = "/v1/completions"
#: requests in flight at once over all decisions: enough to keep a few GPU replicas' batches full
MAX_IN_FLIGHT = 64
#: bodies of one call sent to a slotread replica in one request; a larger call is spread over several
BATCH = 64
#: how long a replica may take to list its model when the gateway starts
LISTING_TIMEOUT_S = 5.0


def served_length(listing: Any, model: str) -> int:
    """The ``max_model_len`` of ``model`` in a ``GET /v1/models`` answer; ValueError says what is wrong."""
    entries = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(entries, list):
        raise ValueError("answered GET /v1/models without a data list")
    for entry in entries:
        if isinstance(entry, dict) and entry.get("id") == model:
            length = entry.get("max_model_len")
            if type(length) is not int or length < 1:
                raise ValueError(f"lists {model!r} without a max_model_len")
            return length
    served = [repr(entry.get("id")) for entry in entries if isinstance(entry, dict)]
    raise ValueError(f"serves {', '.join(served) or 'no model'}, not {model!r}")


def upstream_model(urls: Sequence[str]) -> str:
    """The model the first replica that answers ``GET /v1/models`` serves (a gateway given no model
    serves that one); SlotreadError when none answers with exactly one model."""
    problems = []
    for url in urls:
        try:
            response = httpx.get(f"{url}/v1/models", timeout=LISTING_TIMEOUT_S)
            response.raise_for_status()
            entries = response.json().get("data")
            ids = [entry.get("id") for entry in entries if isinstance(entry, dict)]
        except (httpx.HTTPError, ValueError, AttributeError, TypeError) as exc:
            problems.append(f"{url}: {exc or type(exc).__name__}")
            continue
        if len(ids) == 1 and isinstance(ids[0], str):
            return ids[0]
        problems.append(f"{url} lists {len(ids)} models")
    raise SlotreadError(f"no upstream said which one model it serves ({'; '.join(problems)}); name it with --model")


def _owned_by_slotread(listing: Any, model: str) -> bool:
    """Whether a ``GET /v1/models`` answer lists ``model`` as a slotread engine's (``owned_by: "slotread"``)."""
    entries = listing.get("data") if isinstance(listing, dict) else None
    return any(
        isinstance(entry, dict) and entry.get("id") == model and entry.get("owned_by") == "slotread"
        for entry in entries or ()
    )


class RemoteEngine:
    """Reads label logits on remote replicas of ``model``; ``close`` stops its health checks."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        model: str,
        family: Family,
        vocab_size: int,
        timeout_s: float,
        health_interval_s: float,
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        self.family: Family = family
        self.noisy = family == "diffusion"
        self.deterministic = False  # the replicas' batching is theirs
        self.model = model
        self._vocab_size = vocab_size
        self.pool = ReplicaPool(
            urls, timeout_s=timeout_s, health_interval_s=health_interval_s, max_in_flight=max_in_flight
        )
        #: every replica that answered is a slotread engine: send each read's segment ends
        #: (``wire.completion_bodies``), and the reads of one call together (``wire.batch_body``)
        self.slotread = False
        try:
            self.max_tokens = self._served_length()
            self.pool.start(self._refusal)
        except BaseException:
            self.pool.close()
            raise
        logger.info(
            "remote engine: %s (%s) on %d replicas, max_tokens=%d, reads without a deadline wait %g s, "
            "health every %g s",
            model,
            family,
            len(urls),
            self.max_tokens,
            timeout_s,
            health_interval_s,
        )

    def read(self, requests: list[ReadRequest]) -> list[SlotScores]:
        """One ``SlotScores`` per request, in order; raises UpstreamTimeout, UpstreamUnavailable or UpstreamError."""
        bodies = [
            completion_bodies(request, self.family, self.model, self._vocab_size, self.slotread) for request in requests
        ]
        flat = [body for request_bodies in bodies for body in request_bodies]
        try:
            if self.slotread:
                batches = [flat[start : start + BATCH] for start in range(0, len(flat), BATCH)]
                answers = self._post_all([batch_body(batch) for batch in batches])
                flat_answers = [
                    one
                    for batch, answer in zip(batches, answers, strict=True)
                    for one in batch_responses(answer, len(batch))
                ]
            else:
                flat_answers = self._post_all(flat)
            scores, start = [], 0
            for request, request_bodies in zip(requests, bodies, strict=True):
                end = start + len(request_bodies)
                scores.append(slot_scores(request, request_bodies, flat_answers[start:end]))
                start = end
            return scores
        except WireError as exc:
            raise UpstreamError(f"an upstream answered a read without what it asked for: {exc}") from exc

    def _post_all(self, bodies: list[Any]) -> list[Any]:
        """POST every body to the pool at once; their answers in order. One failure cancels the rest."""
        encoded = [json.dumps(body, separators=(",", ":")).encode() for body in bodies]
        answers = self.pool.post_all(COMPLETIONS, encoded, answer_by())
        try:
            return [json.loads(answer) for answer in answers]
        except ValueError as exc:
            raise UpstreamError("an upstream answered 200 with a body that is not JSON") from exc

    def close(self) -> None:
        """Stop sending reads and checking replicas."""
        self.pool.close()

    def _served_length(self) -> int:
        """The smallest ``max_model_len`` among the replicas that answer; refuse one serving another model.
        Notes whether they are all slotread engines (``slotread``)."""
        lengths, unreachable, owners = [], [], set()
        for replica in self.pool.replicas:
            try:
                response = self.pool.get(replica.url, "/v1/models")
                listing = response.json() if response.status_code == 200 else None
            except (httpx.HTTPError, ValueError) as exc:
                unreachable.append(f"{replica.url}: {type(exc).__name__}")
                continue
            if listing is None:
                unreachable.append(f"{replica.url}: GET /v1/models answered {response.status_code}")
                continue
            try:
                lengths.append(served_length(listing, self.model))
            except ValueError as exc:
                raise ModelLoadError(self.model, f"upstream {replica.url} {exc}") from None
            owners.add(_owned_by_slotread(listing, self.model))
        if not lengths:
            raise ModelLoadError(self.model, "no upstream answered GET /v1/models (" + "; ".join(unreachable) + ")")
        for problem in unreachable:
            logger.warning("upstream %s; it joins once it answers", problem)
        self.slotread = owners == {True}
        return min(lengths)

    def _refusal(self, listing: Any) -> str | None:
        """Why a replica (re)joining with this model listing may not take reads, or None."""
        try:
            length = served_length(listing, self.model)
        except ValueError as exc:
            return str(exc)
        if length < self.max_tokens:
            return f"its max_model_len {length} is below the {self.max_tokens} the gateway renders for"
        if self.slotread and not _owned_by_slotread(listing, self.model):
            return "it is not a slotread engine, and the gateway sends its reads in slotread's batches"
        return None
