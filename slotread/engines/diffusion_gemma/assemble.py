"""A forward's tensors from read requests and prompt KV: the noised canvases, the shared parts, each
row's own prompt KV, encoder rows with their images' soft tokens, the joint forward's masks, and the KV
each encoded prefix keeps.

Host lists reach the device through pinned memory without a stream sync (``on_device``), so the host
can launch the next forward while the GPU still runs the last.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import accumulate, groupby, pairwise

import torch
import torch.nn.functional as F
from transformers import DiffusionGemmaForBlockDiffusion

from slotread.engines.base import ReadRequest
from slotread.engines.diffusion_gemma.attention import MASKED
from slotread.engines.diffusion_gemma.inputs import (
    Canvases,
    ImageTokens,
    JointMasks,
    NewTokens,
    OwnPrompt,
    SharedPart,
    on_device,
)
from slotread.engines.diffusion_gemma.noise import noise_canvas
from slotread.engines.diffusion_gemma.read_plan import SplitRead, sliding_skip
from slotread.engines.prefix_cache import PrefixKV

Ids = tuple[int, ...]


@dataclass(frozen=True)
class Shape:
    """What building a forward's inputs needs of the model: its layer kinds, the sliding window, the
    vocabulary, the pad id, whether an image's soft tokens see each other both ways, the device, and
    the longest prompt KV a full layer keeps (the engine's ``max_tokens``)."""

    layer_types: tuple[str, ...]
    window: int
    vocab: int
    pad_id: int
    image_blocks: bool
    device: torch.device
    max_tokens: int

    @classmethod
    def of(cls, model: DiffusionGemmaForBlockDiffusion, max_tokens: int) -> Shape:
        config = model.config.get_text_config()
        return cls(
            layer_types=tuple(config.layer_types),
            window=int(config.sliding_window),
            vocab=int(config.vocab_size),
            pad_id=int(config.pad_token_id or 0),
            image_blocks=config.use_bidirectional_attention == "vision",
            device=model.device,
            max_tokens=max_tokens,
        )


def canvases(batch: list[ReadRequest], lengths: list[int], shared: list[SharedPart], shape: Shape) -> Canvases:
    """The requests' canvases, noised from their seeds (``noise_canvas``; a request without a seed is read
    as given), right-padded to one width, after prompts of ``lengths``."""
    columns = max(len(request.canvas) for request in batch)  # C: the padded canvas width
    rows, positions, canvas_bias = [], [], []
    for request, length in zip(batch, lengths, strict=True):
        noised = (
            request.canvas
            if request.seed is None
            else noise_canvas(request.canvas, [slot.position for slot in request.slots], request.seed, shape.vocab)
        )
        fill = columns - len(noised)
        rows.append([*noised, *[shape.pad_id] * fill])
        positions.append(list(range(length, length + columns)))
        canvas_bias.append([0.0] * len(noised) + [MASKED] * fill)
    return Canvases(
        tokens=on_device(shape.device, rows),  # (B, C)
        positions=on_device(shape.device, positions),  # (B, C)
        bias=on_device(shape.device, canvas_bias),  # (B, C)
        shared=shared,
    )


def shared_parts(sources: list[tuple[PrefixKV, int]], shape: Shape) -> list[SharedPart]:
    """One part per run of rows reading the same shared KV from the same place: each row's
    (shared KV, sliding ``skip``)."""
    parts = []
    sliding = [kind == "sliding_attention" for kind in shape.layer_types]
    for (_, skip), run in groupby(sources, key=lambda source: (id(source[0]), source[1])):
        group = list(run)
        kv, rows = group[0][0], len(group)
        parts.append(
            SharedPart(
                rows=rows,
                keys=tuple(k[..., skip if s else 0 :, :] for k, s in zip(kv.keys, sliding, strict=True)),
                values=tuple(v[..., skip if s else 0 :, :] for v, s in zip(kv.values, sliding, strict=True)),
            )
        )
    return parts


def own_prompts(reads: list[SplitRead], shape: Shape) -> OwnPrompt | None:
    """Each row's prompt tokens after its shared part, left-padded across the batch (None when
    every row reads its whole prompt from a shared part)."""
    if all(read.split == read.length for read in reads):
        return None
    keys, values, biases = [], [], []
    for index in range(len(shape.layer_types)):
        # a row's own tokens are the last (length - split) columns of its prompt KV, or all that
        # a sliding layer holds
        own = [min(read.length - read.split, read.full.keys[index].shape[-2]) for read in reads]
        width = max(own)
        keys.append(left_padded([_last(read.full.keys[index], o) for read, o in zip(reads, own, strict=True)], width))
        values.append(
            left_padded([_last(read.full.values[index], o) for read, o in zip(reads, own, strict=True)], width)
        )
        biases.append(on_device(shape.device, [[MASKED] * (width - o) + [0.0] * o for o in own]))
    return OwnPrompt(tuple(keys), tuple(values), tuple(biases))


def new_tokens(
    prefixes: list[Ids],
    starts: list[int],
    parents: list[PrefixKV | None],
    shape: Shape,
    features: dict[int, torch.Tensor] | None = None,
) -> NewTokens:
    """Encoder rows for ``prefix[start:]`` of each prefix, right-padded to the longest, continuing
    the parents (rows sharing one adjacent; all rows have one or none); an image's handles become
    pad tokens whose embeddings its ``features`` replace."""
    lengths = [len(prefix) - start for prefix, start in zip(prefixes, starts, strict=True)]
    new = max(lengths)  # N
    parts = [
        SharedPart(rows=len(run), keys=run[0].keys, values=run[0].values)
        for run in (list(run) for _, run in groupby(parents, key=id))
        if run[0] is not None
    ]
    rows = [
        [*prefix[start:], *[shape.pad_id] * (new - length)]
        for prefix, start, length in zip(prefixes, starts, lengths, strict=True)
    ]
    images = image_tokens(rows, features, shape.device, shape.image_blocks) if features else None
    if images is not None:
        rows = [[shape.pad_id if token < 0 else token for token in row] for row in rows]
    return NewTokens(
        tokens=on_device(shape.device, rows),  # (B, N)
        positions=on_device(shape.device, [list(range(start, start + new)) for start in starts]),
        parents=parts,
        images=images,
    )


def kv_entries(
    parents: list[PrefixKV | None], layers: list[tuple[torch.Tensor, torch.Tensor]], lengths: list[int], shape: Shape
) -> list[PrefixKV]:
    """Each encoder row's whole-prefix KV: its parent's then its first ``lengths[row]`` new tokens'
    ``layers`` (per layer (B, kvh, N, d)), as much as each layer keeps, joined when first read
    (``PrefixKV.joined``, once for each run of rows with one parent and one length)."""
    held = shape.window - 1  # the prompt tokens a sliding layer keeps
    keep = tuple(held if kind == "sliding_attention" else shape.max_tokens for kind in shape.layer_types)
    entries: list[PrefixKV] = []
    rows = list(zip(parents, lengths, strict=True))
    for (_, length), run in groupby(rows, key=lambda row: (id(row[0]), row[1])):
        first = len(entries)
        count = len(list(run))
        keys = tuple(k[first : first + count, :, :length] for k, _ in layers)
        values = tuple(v[first : first + count, :, :length] for _, v in layers)
        entries.extend(PrefixKV.joined(parents[first], keys, values, keep))
    return entries


def joint_masks(
    batch: list[ReadRequest],
    deferred: dict[Ids, int],
    sources: list[tuple[PrefixKV, int]],
    own_rows: list[int],
    width: int,
    shape: Shape,
) -> JointMasks:
    """What each canvas of a joint forward sees: of its state's new tokens (row ``own_rows``, n of the
    row's ``width`` columns before its padding), all n in a full layer and the last ``window - 1`` in
    a sliding one; of its parent's held sliding KV, the keys from ``sliding_skip`` on (the rest of its
    window)."""
    kinds, device = shape.layer_types, shape.device
    # on the device: built on the host (about 600 KB for 96 canvases) and copied, these took 15-19 ms in
    # some processes on an H200 host, which delayed the joint forward's launch (1 ms now)
    lengths = on_device(device, [len(r.prompt_ids) - deferred[r.prompt_ids] for r in batch])[:, None]  # (B_c, 1)
    steps = torch.arange(width, device=device)[None, :]
    visible = {"full_attention": torch.where(steps < lengths, 0.0, MASKED)}
    shared = {}
    if "sliding_attention" in kinds:
        index, window = kinds.index("sliding_attention"), shape.window - 1
        seen = (steps >= lengths - window) & (steps < lengths)
        visible["sliding_attention"] = torch.where(seen, 0.0, MASKED)
        held = max(kv.keys[index].shape[-2] for kv, _ in sources)
        skips = on_device(
            device, [sliding_skip(len(r.prompt_ids), deferred[r.prompt_ids], shape.window) for r in batch]
        )
        keys = torch.arange(held, device=device)
        shared["sliding_attention"] = torch.where(keys[None, :] >= skips[:, None], 0.0, MASKED)
    # a state's canvases in one run, states in row order (``read_plan.joint_chunks`` keeps a prompt's reads together)
    in_order = all(a <= b for a, b in pairwise(own_rows))
    counts = Counter(own_rows)
    states = [0, *accumulate(counts[row] for row in range(len(counts)))]
    return JointMasks(
        {kind: visible[kind] for kind in set(kinds)},
        shared,
        on_device(device, states, torch.int32) if in_order else None,
    )


def image_tokens(
    rows: list[list[int]], features: dict[int, torch.Tensor], device: torch.device, bidirectional: bool
) -> ImageTokens | None:
    """Where the images' handles sit in encoder ``rows`` (B, N), each run of one handle an image whose
    soft tokens are ``features[handle]`` in order (``bidirectional``: attending to each other both
    ways); None when no row holds one."""
    where: list[int] = []
    parts: list[torch.Tensor] = []
    blocks = [[-1] * len(row) for row in rows]
    for r, row in enumerate(rows):
        image = -1
        for handle, run in groupby(enumerate(row), key=lambda item: item[1]):
            columns = [column for column, _ in run]
            if handle >= 0:
                continue
            image += 1
            if len(columns) != features[handle].shape[0]:
                raise ValueError(
                    f"an image has {len(columns)} placeholders for {features[handle].shape[0]} soft tokens"
                )
            where += [r * len(row) + column for column in columns]
            parts.append(features[handle])
            for column in columns:
                blocks[r][column] = image
    if not where:
        return None
    return ImageTokens(
        on_device(device, where), torch.cat(parts).to(device), on_device(device, blocks) if bidirectional else None
    )


def left_padded(tensors: list[torch.Tensor], width: int) -> torch.Tensor:
    """Stack (1, kvh, L_r, hd) tensors into (B, kvh, width, hd), each row left-padded with zeros.

    One tensor shared by every row and already ``width`` long becomes an ``expand`` view (no copy).
    """
    first = tensors[0]
    if first.shape[-2] == width and all(t is first for t in tensors):
        return first.expand(len(tensors), -1, -1, -1)
    return torch.cat([F.pad(t, (0, 0, width - t.shape[-2], 0)) for t in tensors])


def _last(kv: torch.Tensor, count: int) -> torch.Tensor:
    """The last ``count`` tokens of a (1, kvh, L, d) KV (none for 0: ``[..., -0:, :]`` would be all)."""
    return kv[..., -count:, :] if count else kv[..., :0, :]
