"""A GGUF file → a Hugging Face checkpoint directory (safetensors + tokenizer), once per stored dtype.

transformers dequantizes a GGUF on every load, which takes 15 s to minutes; we do it once and save
the result, so later loads take seconds. The weights are stored in the dtype they are served in:
bfloat16 for a bfloat16 model (half the disk of float32, and a load that needs no second copy to
cast from), float32 for anything else (``stored_dtype``); a bfloat16 copy is bit for bit the float32
one rounded, as a float32 copy loaded in bfloat16 was. The directory appears by atomic rename, its
files readable by all (0644), and a ``slotread.json`` marker in it records the source's sha256 and
the dtype: a directory whose marker does not match is converted again.

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


def stored_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a conversion stores for a model served in ``dtype``: bfloat16 as it is, else float32
    (from which any other dtype loads without losing what the GGUF holds)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def is_converted(directory: Path, source_sha256: str, dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``directory`` holds a finished conversion of the GGUF with this sha256, stored in ``dtype``
    (a marker naming no dtype is float32's, as conversions were before they named it)."""
    try:
        marker = json.loads((directory / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("source_sha256") == source_sha256
        and marker.get("dtype", "float32") == _dtype_name(dtype)
    )


def convert_gguf(
    gguf: Path, directory: Path, *, model: str, source_sha256: str, dtype: torch.dtype = torch.float32
) -> Path:
    """Convert ``gguf`` (whose sha256 the caller has checked) into ``directory`` with its weights in
    ``dtype`` (float32 or bfloat16), unless done already.

    Returns ``directory``. Raises ModelLoadError naming ``model`` when transformers cannot read it.
    """
    if is_converted(directory, source_sha256, dtype):
        return directory
    logger.info("%s: converting %s to %s weights in %s (once)", model, gguf.name, _dtype_name(dtype), directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory.parent, prefix=f".{directory.name}-") as staging:
        checkpoint = Path(staging) / "checkpoint"
        _write_checkpoint(gguf, checkpoint, model, dtype)
        marker = {"source": gguf.name, "source_sha256": source_sha256, "dtype": _dtype_name(dtype)}
        (checkpoint / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        for path in checkpoint.iterdir():
            path.chmod(0o644)  # safetensors writes its file 0600; a shared cache is read by other users
        if directory.exists() and not is_converted(directory, source_sha256, dtype):
            shutil.rmtree(directory)  # an unfinished or outdated conversion
        publish(checkpoint, directory)
    return directory


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _write_checkpoint(gguf: Path, checkpoint: Path, model: str, dtype: torch.dtype) -> None:
    """Dequantize the GGUF to ``dtype`` and save model and tokenizer into ``checkpoint``.

    transformers dequantizes the GGUF tensor by tensor, casting each to ``dtype`` at once, so the memory
    peak is about the weights in ``dtype``, the mapped GGUF and one tensor in float32.
    """
    try:
        # dequantize=True keeps transformers from looking for a packed-GGUF kernel on the Hub, and
        # leaves a plain dense model that save_pretrained accepts.
        weights = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=dtype,
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
