"""Canvas noise for uniform-noise diffusion reads, shared by the in-process and remote engines.

The noise must be the same wherever a canvas is noised (in process, in a gateway before it sends a
seed canvas to a remote engine, on any device), so it is drawn on the CPU from the seed alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Ids = tuple[int, ...]


def noise_canvas(canvas: Ids, positions: Sequence[int], seed: int, vocab_size: int) -> Ids:
    """``canvas`` with the token at each of ``positions`` replaced by noise.

    The noise at canvas position p is draw p of a CPU ``torch.Generator`` seeded with ``seed``,
    uniform over the vocabulary: it depends on the seed and the position only, never on the other
    slots, the batch or the device.
    """
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randint(vocab_size, (len(canvas),), generator=generator).tolist()
    noised = list(canvas)
    for position in positions:
        noised[position] = draws[position]
    return tuple(noised)
