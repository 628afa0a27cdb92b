"""The masked engine: slot reads for masked LMs (BERT family, ModernBERT) and masked-diffusion LMs
(LLaDA, Dream) by putting the mask token at each slot and reading one bidirectional forward.

A read:

1. writes the adapter's mask id at every slot of the canvas (nothing is random: the seed is unused);
2. runs the model's own forward over ``prompt + canvas``, right-padded in batches of at most
   ``max_batch_rows`` sequences, with an attention mask that hides the padding (right padding leaves
   every real token at its own position);
3. reads the slot at overall position ``p`` from the logits at ``p + read_offset``: 0 for masked LMs
   and LLaDA, -1 for Dream (trained from a causal model, it kept the shift: position p - 1 predicts p).

There is no prefix cache: attention is bidirectional, so a prefix's hidden states depend on every
token after it and cannot be reused by a read that continues it differently.

Only the read rows reach the vocabulary: while the model runs, a forward pre-hook on its output
embedding (the ``lm_head`` or decoder ``Linear``) keeps the hidden states at the read positions and
drops the rest, so the model's own head transform runs, and the (B, T, V) logits are never built (a
512-token BERT batch of 16 would need 1 GB for them). At construction a probe checks that these
logits equal the model's full ones; a model whose logits do not come from its output embedding row
by row is refused. What the hook kept is the slot's hidden state: the label logits are computed from it
exactly, in float32 (``scores.OutputHead``: the output embedding's rows of the label ids and their
bias), the model's own (S, V) logits serve the vocabulary diagnostics, and a request with
``hidden=True`` gets it back (for BERT, after its prediction head's transform and norm).

What differs between checkpoints (mask id, read offset, the attention mask's form) comes in a
``MaskedAdapter`` built from the checkpoint's config (``slotread.models.masked_adapter``); the reader
never looks at a model's name.

Tolerance: a read's result does not depend on the other requests of the call beyond float rounding,
which CPU kernels do differently for batches of different shapes: within 1e-5 in float32 on the CPU
(tests measure it on tiny BERT, ModernBERT and Dream-style models), more in bfloat16, where every
layer's output is rounded to 8 bits. ``max_batch_rows=1`` reads every request alone: its result is
then bit-identical whatever else the call holds (there is no cache to differ by).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import PreTrainedModel

from slotread.engines.base import Family, ReadRequest, SlotScores, check_slots
from slotread.engines.scores import OutputHead, score_slot_rows, with_hidden
from slotread.errors import ModelLoadError, PromptTooLong

logger = logging.getLogger(__name__)

Ids = tuple[int, ...]


@dataclass(frozen=True)
class MaskedAdapter:
    """What reading one masked checkpoint needs beyond its weights.

    ``read_offset``: the slot at position p is read from the logits at p + read_offset. ``attention_mask``:
    how the padding mask reaches the model: "2d" is the (B, T) 0/1 mask transformers models take; "4d"
    is a boolean (B, 1, 1, T) mask over the keys, which Dream's remote code passes to
    ``scaled_dot_product_attention`` unchanged (a 2D mask there would broadcast against the wrong axes).
    """

    mask_id: int
    read_offset: int = 0
    attention_mask: Literal["2d", "4d"] = "2d"


@dataclass(frozen=True)
class _Row:
    """One sequence of a batched forward: its ids (slots masked) and the positions read, in slot order."""

    ids: Ids
    reads: tuple[int, ...]


class MaskedEngine:
    """Reads label logits at the masked slots of a masked or masked-diffusion LM.

    ``max_batch_rows`` bounds the sequences of one forward; ``max_tokens`` (prompt + canvas of one
    read) defaults to the config's ``max_position_embeddings``. One ``read`` at a time: the read-row
    hook sits on the shared model while it runs (the server's batcher serialises engine calls).
    """

    family: Family = "masked"
    noisy = False

    def __init__(
        self,
        model: PreTrainedModel,
        adapter: MaskedAdapter,
        *,
        max_tokens: int | None = None,
        max_batch_rows: int = 16,
    ) -> None:
        name = type(model).__name__
        limit = max_tokens if max_tokens is not None else getattr(model.config, "max_position_embeddings", None)
        if limit is None:
            raise ModelLoadError(name, "its config has no max_position_embeddings; give the engine max_tokens")
        self.max_tokens = int(limit)
        self.max_batch_rows = max_batch_rows
        self.deterministic = max_batch_rows == 1
        self.adapter = adapter
        self._model = model.eval()
        head = model.get_output_embeddings()
        if not isinstance(head, torch.nn.Linear):
            raise ModelLoadError(name, "it has no linear output embedding (lm_head) to read the slots with")
        self._head = head
        self._label_head = OutputHead(head.weight, head.bias)
        self._vocab = head.out_features
        if not 0 <= adapter.mask_id < self._vocab:
            raise ModelLoadError(name, f"mask id {adapter.mask_id} is outside its vocabulary of {self._vocab}")
        self._check_slot_head(name)
        logger.info(
            "masked engine: %s, mask id %d, read offset %d, max_tokens=%d, max_batch_rows=%d",
            name,
            adapter.mask_id,
            adapter.read_offset,
            self.max_tokens,
            max_batch_rows,
        )

    def read(self, requests: list[ReadRequest]) -> list[SlotScores]:
        """One ``SlotScores`` per request, in order (the recipe is in the module docstring)."""
        rows = [self._row(index, request) for index, request in enumerate(requests)]
        order = sorted(range(len(requests)), key=lambda i: len(rows[i].ids))  # similar lengths: less padding
        scores: dict[int, SlotScores] = {}
        with torch.inference_mode():
            for start in range(0, len(order), self.max_batch_rows):
                chunk = order[start : start + self.max_batch_rows]
                logits, hidden = self._read_logits([rows[i] for i in chunk])  # (S, V), (S, H)
                results = score_slot_rows(logits, hidden, [requests[i].slots for i in chunk], self._label_head)
                wanted = [requests[i].hidden for i in chunk]
                if any(wanted):
                    results = with_hidden(results, hidden, wanted)
                scores.update(zip(chunk, results, strict=True))
        return [scores[index] for index in range(len(requests))]

    def _read_logits(self, rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 logits (S, V) at every read position of ``rows``, in row then slot order, and the
        hidden states (S, H) the output embedding saw there."""
        device = self._model.device
        width = max(len(row.ids) for row in rows)  # T
        # Any id can fill the padding (the attention mask hides it); the mask id is always in range.
        input_ids = torch.tensor([[*row.ids, *[self.adapter.mask_id] * (width - len(row.ids))] for row in rows])
        padding = torch.tensor([[1] * len(row.ids) + [0] * (width - len(row.ids)) for row in rows])  # (B, T)
        mask = padding if self.adapter.attention_mask == "2d" else padding.bool()[:, None, None, :]  # (B, 1, 1, T)
        batch = torch.tensor([r for r, row in enumerate(rows) for _ in row.reads], device=device)
        positions = torch.tensor([p for row in rows for p in row.reads], device=device)
        seen: list[torch.Tensor] = []
        with self._head_reads(batch, positions, seen):
            logits = self._model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits  # (S, V)
        return logits.float(), seen[0]

    @contextmanager
    def _head_reads(
        self, batch: torch.Tensor, positions: torch.Tensor, seen: list[torch.Tensor] | None = None
    ) -> Iterator[None]:
        """While open, the output embedding sees only the hidden states at (batch[i], positions[i]):
        its input (B, T, H) becomes (S, H), so the model returns logits (S, V); ``seen`` receives that input."""

        def keep_reads(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            kept = args[0][batch, positions]
            if seen is not None:
                seen.append(kept)
            return (kept, *args[1:])

        handle = self._head.register_forward_pre_hook(keep_reads)
        try:
            yield
        finally:
            handle.remove()

    def _check_slot_head(self, name: str) -> None:
        """Refuse a model whose logits at the read rows differ from its full forward's, or whose logits
        are not its output embedding's (no transform after it), checked at a few ids and its top ones."""
        probe = torch.arange(1, min(7, self._vocab), device=self._model.device).unsqueeze(0)  # (1, T)
        reads = [0, probe.shape[1] - 1]
        seen: list[torch.Tensor] = []
        try:
            with torch.inference_mode():
                expected = self._model(input_ids=probe).logits[0, reads].float()  # (2, V)
                with self._head_reads(torch.zeros_like(probe[0, :2]), torch.tensor(reads, device=probe.device), seen):
                    got = self._model(input_ids=probe).logits.float()
                ids = torch.cat(
                    [torch.arange(0, self._vocab, max(1, self._vocab // 64)), expected[1].topk(8).indices.cpu()]
                )
                ids = ids.to(probe.device)
                exact = self._label_head.at(seen[0][1:].expand(len(ids), -1), ids)
        except (RuntimeError, IndexError) as exc:
            raise ModelLoadError(name, f"its forward fails when lm_head sees the slot rows only: {exc}") from exc
        tolerance = 1e-4 if self._model.dtype == torch.float32 else 3e-2
        scale = float(expected.abs().max()) + 1.0
        if got.shape != expected.shape or float((got - expected).abs().max()) > tolerance * scale:
            raise ModelLoadError(
                name, "its logits do not come from its output embedding row by row, so the slots cannot be read alone"
            )
        if float((exact - expected[1, ids]).abs().max()) > tolerance * scale:
            raise ModelLoadError(name, "its logits are not its output embedding's: it transforms them after lm_head")

    def _row(self, index: int, request: ReadRequest) -> _Row:
        """The ids a read feeds (``prompt + canvas``, slots masked) and its read positions, after checks."""
        check_slots(index, request, self._vocab)
        start = len(request.prompt_ids)
        ids = [*request.prompt_ids, *request.canvas]
        reads = []
        for slot in request.slots:
            ids[start + slot.position] = self.adapter.mask_id
            read = start + slot.position + self.adapter.read_offset
            if not 0 <= read < len(ids):
                raise ValueError(
                    f"request {index}: the slot at {start + slot.position} is read at {read}, outside the sequence "
                    f"(read offset {self.adapter.read_offset})"
                )
            reads.append(read)
        if len(ids) > self.max_tokens:
            raise PromptTooLong(len(ids), self.max_tokens)
        return _Row(tuple(ids), tuple(reads))
