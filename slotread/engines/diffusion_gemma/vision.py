"""DiffusionGemma's eyes: Gemma-4's image processor and vision tower, run once per image.

``prepare`` (``ImagePreparer``) resizes an image as transformers' Gemma-4 image processor does (aspect ratio kept, as
many ``patch_size`` patches as ``max_soft_tokens`` pooled soft tokens allow, sides multiples of
``pooling_kernel_size * patch_size``), patchifies it and gives it a *handle*: a negative id drawn from
the image bytes' sha256 that stands for its soft tokens in the prompt ids (``engines.base.ImageInput``).
``features`` runs the vision tower and the multimodal embedder (the library's ``get_image_features``)
on the images whose features it does not hold yet and keeps them by handle, so a second question
about the same image does not run the tower again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from transformers import DiffusionGemmaForBlockDiffusion

from slotread.engines.base import ImageInput

#: Soft tokens per image: Gemma-4's processor default (280, the ``vision_soft_tokens_per_image`` of the
#: released configs); one of the processor's supported 70, 140, 280, 560, 1120.
SOFT_TOKENS = 280
#: Images whose features are kept: 280 soft tokens of the 26B-A4B shape hold 1.6 MB in bfloat16.
KEPT_IMAGES = 256
#: Prepared images kept (their patches: 2,520 x 768 float32, 7.7 MB each for the 26B-A4B processor), so
#: a question about a recent image skips the processor's resize too.
KEPT_PREPARED = 16


def image_handle(digest: bytes) -> int:
    """The negative id standing for an image's soft tokens: 56 bits of its bytes' sha256."""
    return -1 - int.from_bytes(digest[:7], "little")


class ImagePreparer:
    """Gemma-4's image processor for one model: resizes and patchifies an image and gives it its handle
    and prompt ids. It pickles (without its processor and kept images): a server whose engine runs in
    a process of its own prepares images where it parses requests (``engines/process.py``)."""

    def __init__(self, config: Any, max_soft_tokens: int = SOFT_TOKENS) -> None:
        from transformers.models.gemma4 import Gemma4VisionConfig

        vision = config.vision_config
        assert isinstance(vision, Gemma4VisionConfig), "a DiffusionGemma without a vision tower reads no image"
        self._processor_options = {
            "patch_size": vision.patch_size,
            "pooling_kernel_size": vision.pooling_kernel_size,
            "max_soft_tokens": max_soft_tokens,
        }
        self._processor: Any = None  # built with the first image: text reads need no pillow
        assert config.boi_token_id is not None and config.eoi_token_id is not None
        self.begin, self.end = int(config.boi_token_id), int(config.eoi_token_id)
        self._prepared: OrderedDict[bytes, ImageInput] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_processor": None, "_prepared": OrderedDict()}

    def prepare(self, pixels: np.ndarray, digest: bytes) -> ImageInput:
        """The image (RGB (H, W, 3) uint8) resized, patchified and padded as the processor does (a recent
        image's from ``KEPT_PREPARED``, by digest)."""
        if digest in self._prepared:
            self._prepared.move_to_end(digest)
            return self._prepared[digest]
        if self._processor is None:
            # the PIL backend: the same resize and patches as the torchvision one, without torchvision
            from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

            self._processor = Gemma4ImageProcessorPil(**self._processor_options)
        out = self._processor(images=[pixels], return_tensors="np")
        tokens = int(out["num_soft_tokens_per_image"][0])
        handle = image_handle(digest)
        prepared = self._prepared[digest] = ImageInput(
            handle=handle,
            tokens=tokens,
            ids=(self.begin, *[handle] * tokens, self.end),
            pixel_values=np.asarray(out["pixel_values"][0], dtype=np.float32),
            position_ids=np.asarray(out["image_position_ids"][0], dtype=np.int64),
        )
        if len(self._prepared) > KEPT_PREPARED:
            self._prepared.popitem(last=False)
        return prepared


class GemmaVision:
    """Prepares images for a DiffusionGemma model (``preparer``) and runs its vision tower, keeping the
    features."""

    def __init__(self, model: DiffusionGemmaForBlockDiffusion, max_soft_tokens: int = SOFT_TOKENS) -> None:
        self.preparer = ImagePreparer(model.config, max_soft_tokens)
        self._encoder = model.model.encoder
        self._dtype = model.dtype
        self._device = model.device
        self._features: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.runs = 0  # images the tower has read
        self.hits = 0  # images found among the kept features

    def prepare(self, pixels: np.ndarray, digest: bytes) -> ImageInput:
        """``ImagePreparer.prepare``."""
        return self.preparer.prepare(pixels, digest)

    def features(self, images: Iterable[ImageInput]) -> dict[int, torch.Tensor]:
        """Each image's soft-token embeddings (tokens, hidden) in the model's dtype, by handle; the tower
        runs only for images not kept from earlier reads."""
        found: dict[int, torch.Tensor] = {}
        for image in images:
            if image.handle in found:
                continue
            kept = self._features.get(image.handle)
            if kept is not None:
                self._features.move_to_end(image.handle)
                self.hits += 1
            else:
                kept = self._run(image)
                self._features[image.handle] = kept
                if len(self._features) > KEPT_IMAGES:
                    self._features.popitem(last=False)
            found[image.handle] = kept
        return found

    def _run(self, image: ImageInput) -> torch.Tensor:
        pixels = torch.from_numpy(image.pixel_values)[None].to(self._device, self._dtype)
        positions = torch.from_numpy(image.position_ids)[None].to(self._device)
        with torch.inference_mode():
            out = self._encoder.get_image_features(pixels, positions, return_dict=True).pooler_output
        self.runs += 1
        features = out.reshape(-1, out.shape[-1])
        if features.shape[0] != image.tokens:
            raise ValueError(f"the vision tower gave {features.shape[0]} soft tokens for {image.tokens} placeholders")
        return features
