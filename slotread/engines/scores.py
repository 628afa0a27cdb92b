"""Label scores from the slot rows' hidden states, shared by every in-process engine.

A slot's label logits are computed apart from the vocabulary projection, exactly: the slot's hidden
state times the output embedding's rows of just its label ids, summed in float64 and returned in
float32 (``OutputHead.at``). In the model's bfloat16 the projection rounds logits near 20 to steps of
0.125, which made every yes/no answer sigmoid(k/8) and tied distinct reads; summing in float64 also
keeps the kernel's reduction order (which differs by batch shape and device) out of the float32
result. It touches a few rows of the embedding per slot, so its cost does not show next to a forward.

The vocabulary diagnostics (label mass, argmax, log normalizer) come from the full-vocabulary logits
as the model computes them (in its dtype, widened to float32), with the label columns replaced by the
exact values: the log normalizer and the argmax of a non-label token keep the model dtype's rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from slotread.engines.base import Slot, SlotScores
from slotread.engines.diffusion_gemma import invariant


@dataclass(frozen=True)
class OutputHead:
    """A model's output embedding as its logits come out of it: ``softcap(scale * (hidden @ weight.T + bias))``,
    where ``softcap(x) = cap * tanh(x / cap)`` when ``softcap`` is set (Gemma) and the identity otherwise."""

    weight: torch.Tensor  # (V, H), in the model's dtype
    bias: torch.Tensor | None = None  # (V,)
    scale: float = 1.0
    softcap: float | None = None

    def vocabulary(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits (R, V) of hidden states (R, H) over the whole vocabulary: the projection in the
        weights' dtype, as the model runs it, then the scale and softcap in float32."""
        return self._transformed(invariant.linear(hidden, self.weight, self.bias).float())

    def at(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Float32 logits (N,) of token ``ids[n]`` (N,) at hidden state ``hidden[n]`` (N, H), summed in float64."""
        logits = (hidden.double() * self.weight[ids].double()).sum(dim=-1)
        if self.bias is not None:
            logits = logits + self.bias[ids].double()
        return self._transformed(logits).float()

    def _transformed(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits


def score_slots(
    logits: torch.Tensor, hidden: torch.Tensor, slots: Sequence[tuple[Slot, ...]], head: OutputHead
) -> list[SlotScores]:
    """Per row of ``logits`` (R, V) and of the hidden states ``hidden`` (R, H) they come from, the scores
    of that row's slots: exact label logits (``head.at``), label mass (the full-vocabulary softmax
    summed over the distinct label ids), the argmax (id, logit, and whether it is a label) and the
    log normalizer."""
    rows = [r for r, row_slots in enumerate(slots) for _ in row_slots]
    flat = [slot for row_slots in slots for slot in row_slots]
    return _grouped(_per_slot(logits, hidden, rows, flat, head), slots)


def score_slot_rows(
    logits: torch.Tensor, hidden: torch.Tensor, slots: Sequence[tuple[Slot, ...]], head: OutputHead
) -> list[SlotScores]:
    """Per request, the scores of its slots, where ``logits`` (S, V) and ``hidden`` (S, H) hold one row per
    slot: every slot of every request, in request then slot order (engines that read each slot at its
    own position)."""
    flat = [slot for request_slots in slots for slot in request_slots]
    return _grouped(_per_slot(logits, hidden, list(range(len(flat))), flat, head), slots)


_Scored = tuple[np.ndarray, float, bool, int, float, float]  # one slot's fields of ``SlotScores``, in order


def _per_slot(
    logits: torch.Tensor, hidden: torch.Tensor, rows: list[int], slots: list[Slot], head: OutputHead
) -> list[_Scored]:
    """Each slot's scores, slot i read at row ``rows[i]`` of ``logits`` (R, V) and ``hidden`` (R, H).
    Vectorised: on a GPU this runs after the forward, on the critical path (a loop of numpy calls per
    slot took ~5 ms at 96 slots). Every slot has a label id (the engines refuse one without)."""
    if not slots:
        return []
    counts = [len(slot.label_ids) for slot in slots]
    label_rows = [row for row, count in zip(rows, counts, strict=True) for _ in range(count)]
    cols = [i for slot in slots for i in slot.label_ids]
    index = torch.tensor(label_rows, device=logits.device), torch.tensor(cols, device=logits.device)
    exact = head.at(hidden[index[0]], index[1])  # all label logits of all slots, in order
    logits = logits.index_put(index, exact)  # the diagnostics below see the exact label logits
    picked = exact.cpu().numpy()
    log_total = torch.logsumexp(logits, dim=-1).double().cpu().numpy()[rows]  # per slot
    top_logit, top = (t.cpu().numpy()[rows] for t in logits.max(dim=-1))
    # label mass: a logsumexp over each slot's distinct label ids (a repeated id counts once)
    first = [i not in slot.label_ids[:k] for slot in slots for k, i in enumerate(slot.label_ids)]
    values = np.where(first, picked.astype(np.float64), -np.inf)
    starts = np.cumsum([0, *counts[:-1]])
    peak = np.maximum.reduceat(values, starts)
    mass = np.exp(peak + np.log(np.add.reduceat(np.exp(values - np.repeat(peak, counts)), starts)) - log_total)
    return [
        (label_logits, float(m), int(t) in slot.label_ids, int(t), float(tl), float(lt))
        for slot, label_logits, m, t, tl, lt in zip(
            slots, np.split(picked, starts[1:]), mass, top, top_logit, log_total, strict=True
        )
    ]


def _grouped(scored: list[_Scored], slots: Sequence[tuple[Slot, ...]]) -> list[SlotScores]:
    """``scored`` (one entry per slot, in order) as one ``SlotScores`` per group of ``slots``."""
    results, offset = [], 0
    for group in slots:
        parts = scored[offset : offset + len(group)]
        offset += len(group)
        columns = [tuple(field) for field in zip(*parts, strict=True)] if parts else [()] * 6  # _Scored's six
        results.append(SlotScores(*columns))
    return results


def with_hidden(scores: list[SlotScores], hidden: torch.Tensor, wanted: Sequence[bool]) -> list[SlotScores]:
    """``scores`` with ``SlotScores.hidden`` set for the requests that want it, from ``hidden`` (S, H):
    the hidden state that reads each slot of each request, in request then slot order, float32."""
    rows = hidden.float().cpu().numpy()  # (S, H)
    results, offset = [], 0
    for result, wants in zip(scores, wanted, strict=True):
        count = len(result.logits)
        if wants:
            result = replace(result, hidden=tuple(row.copy() for row in rows[offset : offset + count]))
        results.append(result)
        offset += count
    return results
