"""Label scores from slot logits, shared by every in-process engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from slotread.engines.base import Slot, SlotScores


def score_slots(logits: torch.Tensor, slots: Sequence[tuple[Slot, ...]]) -> list[SlotScores]:
    """Per row of ``logits`` (R, V), the scores of that row's slots: label logits, label mass (the
    full-vocabulary softmax summed over the distinct label ids), the argmax
    (id, logit, and whether it is a label) and the log normalizer."""
    rows = [r for r, row_slots in enumerate(slots) for _ in row_slots]
    return _grouped(_per_slot(logits, rows, [slot for row_slots in slots for slot in row_slots]), slots)


def score_slot_rows(logits: torch.Tensor, slots: Sequence[tuple[Slot, ...]]) -> list[SlotScores]:
    """Per request, the scores of its slots, where ``logits`` (S, V) holds one row per slot: every slot
    of every request, in request then slot order (engines that read each slot at its own position)."""
    flat = [slot for request_slots in slots for slot in request_slots]
    return _grouped(_per_slot(logits, list(range(len(flat))), flat), slots)


_Scored = tuple[np.ndarray, float, bool, int, float, float]  # one slot's fields of ``SlotScores``, in order


def _per_slot(logits: torch.Tensor, rows: list[int], slots: list[Slot]) -> list[_Scored]:
    """Each slot's scores, slot i read at row ``rows[i]`` of ``logits`` (R, V). Vectorised: on a GPU
    this runs after the forward, on the critical path (a loop of numpy calls per slot took ~5 ms at
    96 slots). Every slot has a label id (the engines refuse one without)."""
    if not slots:
        return []
    counts = [len(slot.label_ids) for slot in slots]
    label_rows = [row for row, count in zip(rows, counts, strict=True) for _ in range(count)]
    cols = [i for slot in slots for i in slot.label_ids]
    index = torch.tensor(label_rows, device=logits.device), torch.tensor(cols, device=logits.device)
    picked = logits[index].cpu().numpy()  # all label logits of all slots, in order
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
