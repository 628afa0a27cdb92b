"""What the DiffusionGemma forwards take: canvases, new prompt tokens, and the prompt KV they read.

Each is a batch of rows already on the device; ``assemble.py`` builds them from read requests and
cached KV, ``forward.py`` runs them, ``graphs.py`` pads them to a CUDA graph's bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SharedPart:
    """A prompt KV read by ``rows`` consecutive rows: per layer (1, kvh, S_l, d)."""

    rows: int
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class OwnPrompt:
    """Per row, prompt KV after its shared part: per layer (B, kvh, O_l, d), left-padded, and a
    (B, O_l) additive bias hiding the padding."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    bias: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Canvases:
    """Decoder rows: canvases (B, C) at ``positions`` (B, C); ``bias`` (B, C) hides right-padded
    columns as keys; ``shared`` covers the rows in order."""

    tokens: torch.Tensor
    positions: torch.Tensor
    bias: torch.Tensor
    shared: list[SharedPart]


@dataclass(frozen=True)
class ImageTokens:
    """Soft tokens of images among encoder rows: ``where`` (K,) their places in the flat (B * N) new
    tokens, ``features`` (K, hidden) their embeddings from the vision tower, and ``blocks`` (B, N) each
    new token's image in its row (-1: text). The tokens of one image attend to each other in both
    directions, as the library's ``use_bidirectional_attention="vision"`` masks do; ``blocks`` None:
    a model without it reads them causally, as text."""

    where: torch.Tensor
    features: torch.Tensor
    blocks: torch.Tensor | None


@dataclass(frozen=True)
class NewTokens:
    """Encoder rows: tokens (B, N) at ``positions`` (B, N), each row continuing its parent's KV
    (``parents`` covers the rows in order; empty: no parents), with the soft tokens of any images."""

    tokens: torch.Tensor
    positions: torch.Tensor
    parents: list[SharedPart]
    images: ImageTokens | None = None


@dataclass(frozen=True)
class JointMasks:
    """What the canvases of ``encode_decode`` see, per layer kind, as additive biases: ``own``
    (B_c, N) over their row's new tokens (one visible run per row: the window's, before padding),
    ``shared`` (B_c, S) over the first S keys of their shared part (a kind without an entry sees the
    whole part). ``states`` (B + 1,) int32, where each new-token row's canvases are consecutive and
    in row order: row r's canvases are ``states[r]`` to ``states[r + 1]`` (on a GPU they then read
    their row's new tokens in place, ``attention.attend_runs``); None where they are not."""

    own: dict[str, torch.Tensor]
    shared: dict[str, torch.Tensor]
    states: torch.Tensor | None = None


def on_device(device: torch.device, data: object, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(data)`` on ``device`` without a stream sync: a blocking host-to-device copy waits
    for every queued kernel, so the host could not launch a forward (the decoder's) while the GPU
    still runs the last (the encoder's). The data goes through pinned memory (the caching host
    allocator's): from pageable memory the driver may wait for the stream before staging a copy."""
    host = torch.from_numpy(np.array(data))  # 5x faster than torch.tensor from nested lists
    host = host.to(dtype or (torch.float32 if host.is_floating_point() else host.dtype))
    return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
