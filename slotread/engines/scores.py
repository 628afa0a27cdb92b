"""Label scores from slot logits, shared by every in-process engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace

import numpy as np
import torch

from slotread.engines.base import Slot, SlotScores


def score_slots(logits: torch.Tensor, slots: Sequence[tuple[Slot, ...]]) -> list[SlotScores]:
    """Per row of ``logits`` (R, V), the scores of that row's slots: label logits, label mass (the
    full-vocabulary softmax summed over the distinct label ids), the argmax
    (id, logit, and whether it is a label) and the log normalizer."""
    rows = [r for r, row_slots in enumerate(slots) for slot in row_slots for _ in slot.label_ids]
    cols = [i for row_slots in slots for slot in row_slots for i in slot.label_ids]
    index = torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)
    picked = logits[index].cpu().numpy()  # all label logits of all slots, in order
    log_total = torch.logsumexp(logits, dim=-1).double().cpu().numpy()  # (R,)
    top_logit, top = (t.cpu().numpy() for t in logits.max(dim=-1))  # (R,) each
    results, offset = [], 0
    for r, row_slots in enumerate(slots):
        label_logits, masses, hits = [], [], []
        for slot in row_slots:
            values = picked[offset : offset + len(slot.label_ids)]
            offset += len(slot.label_ids)
            distinct = values[np.unique(slot.label_ids, return_index=True)[1]].astype(np.float64)
            peak = distinct.max()
            masses.append(float(np.exp(peak + np.log(np.exp(distinct - peak).sum()) - log_total[r])))
            label_logits.append(values.copy())
            hits.append(int(top[r]) in slot.label_ids)
        n = len(row_slots)
        results.append(
            SlotScores(
                logits=tuple(label_logits),
                label_mass=tuple(masses),
                argmax_is_label=tuple(hits),
                argmax_id=(int(top[r]),) * n,
                argmax_logit=(float(top_logit[r]),) * n,
                log_normalizer=(float(log_total[r]),) * n,
            )
        )
    return results


def score_slot_rows(logits: torch.Tensor, slots: Sequence[tuple[Slot, ...]]) -> list[SlotScores]:
    """Per request, the scores of its slots, where ``logits`` (S, V) holds one row per slot: every slot
    of every request, in request then slot order (engines that read each slot at its own position)."""
    per_slot = iter(score_slots(logits, [(slot,) for request_slots in slots for slot in request_slots]))
    results = []
    for request_slots in slots:
        parts = [next(per_slot) for _ in request_slots]
        values = {
            field.name: tuple(getattr(part, field.name)[0] for part in parts)
            for field in fields(SlotScores)
            if field.name != "hidden"
        }
        results.append(SlotScores(**values))
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
