"""Option→label assignments: the cyclic shifts a question is read under, and the way back to option order.

An assignment is a cyclic shift ``s`` of the options over the label alphabet: the prompt lists
option ``(p + s) mod n`` at position ``p``, read through label ``p`` (A, B, ... in listing order).
A read's label logits therefore come in listing order; ``to_option_order`` puts them back.

Why cyclic shifts rather than seeded shuffles: ``k`` shifts spaced ``n/k`` apart move every option
through ``k`` evenly spaced positions and labels, a balanced design (with ``k = n`` each option takes
every position and every label exactly once, so an additive position or label bias cancels in the
mean); a shuffle gives no such guarantee and would need a seed. Shifts keep neighbouring options
together, so a list grouped by topic stays grouped. For a yes/no question the one non-trivial shift
swaps the labels' meanings.
"""

from __future__ import annotations

import numpy as np


def shifts(n: int, k: int) -> tuple[int, ...]:
    """The shifts of ``k`` assignments of ``n`` options: s_j = floor(j·n/m) for j < m = min(k, n).

    At most ``n`` assignments are distinct, so ``k`` above ``n`` gives ``n``; shift 0 (the caller's
    order) always comes first.
    """
    m = min(k, n)
    return tuple(j * n // m for j in range(m))


def listing_order(n: int, shift: int) -> tuple[int, ...]:
    """The option index listed at each position (read through the label at that position)."""
    return tuple((p + shift) % n for p in range(n))


def to_option_order(values: np.ndarray, shift: int) -> np.ndarray:
    """Per-label values of a read under ``shift`` (listing order) rearranged into option order."""
    out = np.empty_like(values)
    out[list(listing_order(values.size, shift))] = values
    return out
