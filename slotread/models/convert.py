"""A GGUF file → a Hugging Face checkpoint directory (float32 safetensors + tokenizer), once.

transformers dequantizes a GGUF on every load, which takes 15 s to minutes; we do it once and save
the result, so later loads take about a second. The directory appears by atomic rename, and a
``slotread.json`` marker in it records the source's sha256: a directory whose marker does not match
the source is converted again.

Gemma GGUFs (architectures gemma3 and gemma4) get the BPE tokenizer from ``gemma_tokenizer``;
every other GGUF gets transformers' GGUF tokenizer (which carries the GGUF's chat template), with
its bos/eos/pad/unk tokens set from the ids the GGUF declares.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, PreTrainedTokenizerBase

from slotread.errors import ModelLoadError
from slotread.models.fetch import publish
from slotread.models.gemma_tokenizer import Variant, gemma_tokenizer_from_gguf, read_gguf_metadata

logger = logging.getLogger(__name__)

MARKER = "slotread.json"

_GEMMA_VARIANTS: dict[str, Variant] = {"gemma3": "gemma3", "gemma4": "gemma4"}
_SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
}


def is_converted(directory: Path, source_sha256: str) -> bool:
    """Whether ``directory`` holds a finished conversion of the GGUF with this sha256."""
    try:
        marker = json.loads((directory / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("source_sha256") == source_sha256


def convert_gguf(gguf: Path, directory: Path, *, model: str, source_sha256: str) -> Path:
    """Convert ``gguf`` (whose sha256 the caller has checked) into ``directory``, unless done already.

    Returns ``directory``. Raises ModelLoadError naming ``model`` when transformers cannot read it.
    """
    if is_converted(directory, source_sha256):
        return directory
    logger.info("%s: converting %s to a checkpoint in %s (once)", model, gguf.name, directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory.parent, prefix=f".{directory.name}-") as staging:
        checkpoint = Path(staging) / "checkpoint"
        _write_checkpoint(gguf, checkpoint, model)
        marker = {"source": gguf.name, "source_sha256": source_sha256}
        (checkpoint / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        if directory.exists() and not is_converted(directory, source_sha256):
            shutil.rmtree(directory)  # an unfinished or outdated conversion
        publish(checkpoint, directory)
    return directory


def _write_checkpoint(gguf: Path, checkpoint: Path, model: str) -> None:
    """Dequantize the GGUF to float32 and save model and tokenizer into ``checkpoint``."""
    try:
        # dequantize=True keeps transformers from looking for a packed-GGUF kernel on the Hub, and
        # leaves a plain dense model that save_pretrained accepts.
        weights = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
            local_files_only=True,
        )
    except (OSError, ValueError, KeyError, RuntimeError, struct.error) as exc:
        raise ModelLoadError(model, f"cannot convert {gguf.name}: {exc}") from exc
    weights.save_pretrained(checkpoint)
    tokenizer_from_gguf(gguf, model).save_pretrained(checkpoint)


def tokenizer_from_gguf(gguf: Path, model: str) -> PreTrainedTokenizerBase:
    """The tokenizer a conversion of ``gguf`` saves: Gemma's BPE for Gemma GGUFs, else transformers' own."""
    try:
        metadata = read_gguf_metadata(gguf)
        variant = _GEMMA_VARIANTS.get(metadata["general.architecture"])
        return gemma_tokenizer_from_gguf(gguf, variant) if variant is not None else _gguf_tokenizer(gguf, metadata)
    except (OSError, ValueError, KeyError, RuntimeError, struct.error) as exc:
        raise ModelLoadError(model, f"cannot read the tokenizer of {gguf.name}: {exc}") from exc


def _gguf_tokenizer(gguf: Path, metadata: dict[str, Any]) -> PreTrainedTokenizerBase:
    """transformers' tokenizer for a (non-Gemma) GGUF, special tokens as the GGUF declares them."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    # transformers turns this on for GGUF tokenizers, then warns on every decode that it corrupts BPE text.
    tokenizer.clean_up_tokenization_spaces = False
    pieces = metadata["tokenizer.ggml.tokens"]
    for attribute, key in _SPECIAL_TOKEN_KEYS.items():
        if key in metadata:
            setattr(tokenizer, attribute, pieces[metadata[key]])
    return tokenizer
