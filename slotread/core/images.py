"""Images in the state: where they sit in the state text, and how they enter a read's prompt.

The api layer decodes and checks each image (``api/images.py``) and places it at a character
``offset`` of the state text. Before rendering, ``place_images`` asks the engine's image reader to
prepare every image (``engines.base.ImageReader``) and writes one *marker* into the state at each
offset: the text of the image's begin-of-image token, which the tokenizer turns into that one id.
After rendering, ``PlacedImages.splice`` replaces each marker id, in order, by the image's whole id
run (begin, its soft-token handles, end), so the text either side of an image is tokenised apart, as
a model's processor does around its image token, and the prompt's segments and canvas stay as
rendered.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from slotread.engines.base import ImageInput, ImageReader
from slotread.errors import InvalidRequest
from slotread.prompt.render import Rendered, Renderer


@dataclass(frozen=True)
class Image:
    """A decoded image of the state: ``name`` says which one in errors (``images[0]``, an asset's
    reference), ``digest`` is the sha256 of its file, ``pixels`` RGB (H, W, 3) uint8, ``offset`` the
    character of the state text it sits before."""

    name: str
    digest: bytes
    pixels: np.ndarray = field(compare=False, repr=False)
    offset: int = 0


@dataclass(frozen=True)
class PlacedImages:
    """The state text with a marker per image, the marker's id, and the prepared images in order."""

    state: str
    marker: int
    inputs: tuple[ImageInput, ...]

    def splice(self, rendered: Rendered) -> Rendered:
        """``rendered`` with each marker id replaced by its image's ids, and the images attached."""
        if sum(segment.count(self.marker) for segment in rendered.prompt) != len(self.inputs):
            # instructions or earlier answers spell the marker too
            raise InvalidRequest.at(["body"], "the prompt's text holds the model's begin-of-image token; remove it")
        queue = iter(self.inputs)
        segments = []
        for segment in rendered.prompt:
            ids: list[int] = []
            for token in segment:
                ids.extend(next(queue).ids if token == self.marker else (token,))
            segments.append(tuple(ids))
        return replace(rendered, prompt=tuple(segments), images=self.inputs)


def place_images(state: str, images: tuple[Image, ...], vision: ImageReader, renderer: Renderer) -> PlacedImages:
    """Prepare ``images`` for the model and mark their places in ``state`` (see the module docstring)."""
    inputs = tuple(vision.prepare(image.pixels, image.digest) for image in images)
    marker = inputs[0].ids[0]
    text = renderer.tokenizer.convert_ids_to_tokens(marker)
    if not isinstance(text, str) or renderer.tokenizer.encode(text, add_special_tokens=False) != [marker]:
        raise ValueError(f"the tokenizer does not spell the begin-of-image token {marker} as one token")
    if text in state:
        msg = f"the state holds the text {text!r}, the model's begin-of-image token: it cannot be told from an image"
        raise InvalidRequest.at(["body", "state"], msg)
    pieces, start = [], 0
    for image in sorted(images, key=lambda image: image.offset):
        pieces += [state[start : image.offset], text]
        start = image.offset
    order = sorted(range(len(images)), key=lambda i: images[i].offset)
    return PlacedImages("".join([*pieces, state[start:]]), marker, tuple(inputs[i] for i in order))
