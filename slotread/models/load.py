"""Load a model by registry name, checkpoint directory or ``.gguf`` file, ready to read.

* A registry name is fetched (``fetch``) and converted (``convert``) on first use into
  ``<cache>/models/<name>`` (float32 weights) or ``<cache>/models/<name>-bfloat16`` (for a model
  loaded in bfloat16), then loaded from there.
* A ``.gguf`` file is converted once into ``<cache>/models/<stem>-<sha256 prefix>`` (``-bfloat16``
  likewise); the file is hashed on every load (about a second per GB) so an edited file is converted
  again.
* ``random:DIR`` loads DIR's config and tokenizer and draws random weights on the device
  (``slotread.models.shapes``: a real shape benchmarked without its checkpoint; answers are noise).
* A directory is loaded as it is. Its ``config.json`` decides the class: model type
  ``diffusion_gemma`` loads as ``DiffusionGemmaForBlockDiffusion`` (family "diffusion"); a masked LM
  (a ``*ForMaskedLM`` architecture, or remote code whose config names a ``mask_token_id``, see
  ``slotread.models.masked_adapter``) as ``AutoModelForMaskedLM`` or, for remote code that registers
  only ``AutoModel``, as ``AutoModel`` (family "masked"); anything else as ``AutoModelForCausalLM``
  (family "causal"). A directory whose config has an ``auto_map`` runs the modeling code it holds
  (``trust_remote_code``): only local directories get here.

``load_tokenizer`` loads the same tokenizer without any weights (what a gateway needs to render
prompts for remote engines): from a directory as above, and for a registry model or ``.gguf`` file
straight from the GGUF, which is fetched but not converted.

Nothing here reaches a model hub: every transformers call passes ``local_files_only=True``. Every
failure raises ModelLoadError naming the model and the reason; causal and diffusion reads go through
the chat template, so their checkpoints need a tokenizer with one (masked LMs fall back to plain text).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoTokenizer,
    DiffusionGemmaForBlockDiffusion,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from slotread.errors import ModelLoadError
from slotread.models.convert import convert_gguf, is_converted, stored_dtype, tokenizer_from_gguf
from slotread.models.fetch import default_cache_dir, fetch_artifact, sha256_file
from slotread.models.masked_adapter import has_remote_code, is_masked
from slotread.models.registry import REGISTRY, Family
from slotread.models.shapes import RANDOM_PREFIX, random_weights

logger = logging.getLogger(__name__)

# What transformers raises on missing, malformed or mismatched checkpoint files.
_LOAD_ERRORS = (OSError, ValueError, KeyError, RuntimeError, SafetensorError)
# Without one of these, AutoTokenizer quietly builds an empty tokenizer from the model type.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


@dataclass(frozen=True)
class LoadedModel:
    """A model in eval mode on its device, its tokenizer, and the engine family that reads it."""

    name: str
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    family: Family


@dataclass(frozen=True)
class LoadedTokenizer:
    """A model's tokenizer and family without its weights: enough to render reads for remote engines."""

    name: str
    tokenizer: PreTrainedTokenizerBase
    family: Family
    #: the size of the model's output vocabulary, which DiffusionGemma draws canvas noise from
    vocab_size: int


@dataclass(frozen=True)
class ModelListing:
    """One registry model as ``slotread models list`` shows it."""

    name: str
    description: str
    #: whether the converted checkpoint is in the cache (else it is fetched on first use)
    cached: bool
    path: Path


def load_model(
    spec: str, *, cache_dir: Path | None = None, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> LoadedModel:
    """Load a registry model, a checkpoint directory or a ``.gguf`` file; ``spec`` becomes its name.

    ``cache_dir`` defaults to ``$SLOTREAD_CACHE``, else ``~/.cache/slotread``.
    """
    if spec.startswith(RANDOM_PREFIX):
        return _load_random(_local_source(spec.removeprefix(RANDOM_PREFIX)), spec, device, dtype)
    cache = cache_dir if cache_dir is not None else default_cache_dir()
    return _load_checkpoint(checkpoint_dir(spec, cache, dtype), spec, device, dtype)


def load_tokenizer(spec: str, *, cache_dir: Path | None = None) -> LoadedTokenizer:
    """The tokenizer ``load_model(spec)`` would load, without loading or converting weights.

    A registry model converted already is read from its checkpoint; otherwise its GGUF is fetched (not
    converted) and the tokenizer built from it as a conversion would save it (about 10 s against 0.5 s
    for the saved one). A ``.gguf`` file's is built likewise.
    """
    if spec in REGISTRY:
        entry = REGISTRY[spec]
        cache = cache_dir if cache_dir is not None else default_cache_dir()
        for dtype in (torch.bfloat16, torch.float32):
            directory = converted_dir(cache / "models" / entry.name, dtype)
            if is_converted(directory, entry.gguf.sha256, dtype):
                return _directory_tokenizer(directory, spec)
        return _gguf_tokenizer(fetch_artifact(entry.gguf, cache, model=spec), spec, entry.family)
    source = _local_source(spec.removeprefix(RANDOM_PREFIX))
    return _gguf_tokenizer(source, spec, "causal") if source.is_file() else _directory_tokenizer(source, spec)


def list_models(cache_dir: Path | None = None) -> list[ModelListing]:
    """Every registry model, and whether a converted checkpoint is already cached (the bfloat16 one
    first: the one the server and the commands load by default)."""
    cache = cache_dir if cache_dir is not None else default_cache_dir()
    listings = []
    for model in REGISTRY.values():
        converted = [
            directory
            for dtype in (torch.bfloat16, torch.float32)
            if is_converted(directory := converted_dir(cache / "models" / model.name, dtype), model.gguf.sha256, dtype)
        ]
        path = converted[0] if converted else converted_dir(cache / "models" / model.name, torch.bfloat16)
        listings.append(ModelListing(model.name, model.description, bool(converted), path))
    return listings


def converted_dir(base: Path, dtype: torch.dtype) -> Path:
    """Where the conversion stored for ``dtype`` lives: ``base`` for float32, ``base-bfloat16`` for bfloat16."""
    return base if stored_dtype(dtype) == torch.float32 else base.with_name(f"{base.name}-bfloat16")


def check_source(spec: str) -> None:
    """Raise ModelLoadError now, before any slow work, when ``spec`` names no registry model, checkpoint
    directory or ``.gguf`` file."""
    if spec not in REGISTRY:
        _local_source(spec.removeprefix(RANDOM_PREFIX))


def checkpoint_dir(spec: str, cache: Path, dtype: torch.dtype = torch.float32) -> Path:
    """The checkpoint directory ``spec`` names for loading in ``dtype``, fetching and converting first
    where needed (a directory is loaded as it is, whatever its dtype)."""
    stored = stored_dtype(dtype)
    if spec in REGISTRY:
        entry = REGISTRY[spec]
        directory = converted_dir(cache / "models" / entry.name, stored)
        if not is_converted(directory, entry.gguf.sha256, stored):
            gguf = fetch_artifact(entry.gguf, cache, model=spec)
            convert_gguf(gguf, directory, model=spec, source_sha256=entry.gguf.sha256, dtype=stored)
        return directory
    path = _local_source(spec)
    if path.is_dir():
        return path
    digest = sha256_file(path)
    directory = converted_dir(cache / "models" / f"{path.stem}-{digest[:12]}", stored)
    return convert_gguf(path, directory, model=spec, source_sha256=digest, dtype=stored)


def _local_source(spec: str) -> Path:
    """The checkpoint directory or ``.gguf`` file ``spec`` names (it is no registry name)."""
    path = Path(spec).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if path.exists():
        raise ModelLoadError(spec, "not a checkpoint directory or a .gguf file")
    raise ModelLoadError(
        spec, f"no registry model, directory or file has this name; registry models: {', '.join(REGISTRY)}"
    )


def _read_tokenizer(directory: Path, name: str) -> tuple[PretrainedConfig, PreTrainedTokenizerBase, Family, bool]:
    """A checkpoint directory's config, tokenizer (with a chat template unless masked), family, and
    whether it runs the directory's own modeling code."""
    remote = _declares_remote_code(directory)
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True, trust_remote_code=remote)
    except _LOAD_ERRORS as exc:
        raise ModelLoadError(name, f"{directory} has no readable config.json: {exc}") from exc
    if not any((directory / file).is_file() for file in _TOKENIZER_FILES):
        raise ModelLoadError(name, f"{directory} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)})")
    try:
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            directory, local_files_only=True, trust_remote_code=remote
        )
    except _LOAD_ERRORS as exc:
        raise ModelLoadError(name, f"{directory} has no loadable tokenizer: {exc}") from exc
    family = _family(config)
    if family != "masked":
        _require_chat_template(tokenizer, name, str(directory))
    return config, tokenizer, family, remote


def _directory_tokenizer(directory: Path, name: str) -> LoadedTokenizer:
    config, tokenizer, family, _ = _read_tokenizer(directory, name)
    return LoadedTokenizer(name, tokenizer, family, int(config.get_text_config().vocab_size))


def _gguf_tokenizer(gguf: Path, name: str, family: Family) -> LoadedTokenizer:
    tokenizer = tokenizer_from_gguf(gguf, name)
    _require_chat_template(tokenizer, name, gguf.name)
    return LoadedTokenizer(name, tokenizer, family, len(tokenizer))


def _require_chat_template(tokenizer: PreTrainedTokenizerBase, name: str, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError(name, f"the tokenizer in {where} has no chat template")


def _family(config: PretrainedConfig) -> Family:
    return "diffusion" if config.model_type == "diffusion_gemma" else "masked" if is_masked(config) else "causal"


def _load_checkpoint(directory: Path, name: str, device: str, dtype: torch.dtype) -> LoadedModel:
    """Tokenizer first (cheap to refuse), then the weights in the class the config names."""
    config, tokenizer, family, remote = _read_tokenizer(directory, name)
    try:
        model = _model_class(config, family).from_pretrained(
            directory, dtype=dtype, device_map=device, local_files_only=True, trust_remote_code=remote
        )
    except _LOAD_ERRORS as exc:
        raise ModelLoadError(name, f"cannot load the weights in {directory}: {exc}") from exc
    model.eval().requires_grad_(False)
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, family=family)


def _load_random(directory: Path, name: str, device: str, dtype: torch.dtype) -> LoadedModel:
    """The checkpoint's config and tokenizer with random weights drawn on ``device``."""
    if not directory.is_dir():
        raise ModelLoadError(name, "random: takes a checkpoint directory (slotread models shape writes one)")
    config, tokenizer, family, remote = _read_tokenizer(directory, name)
    if remote:
        raise ModelLoadError(name, "random weights are drawn for transformers' own architectures only")
    try:
        model = random_weights(_model_class(config, family), config, device, dtype)
    except (RuntimeError, ValueError) as exc:  # out of memory, an unknown device
        raise ModelLoadError(name, f"cannot build random weights on {device}: {exc}") from exc
    logger.warning("%s has random weights: its answers are noise (for speed and memory measurements only)", name)
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, family=family)


def _model_class(config: PretrainedConfig, family: Family) -> type[Any]:
    """The class that loads the checkpoint's weights for its family."""
    if family == "diffusion":
        return DiffusionGemmaForBlockDiffusion
    if family == "causal":
        return AutoModelForCausalLM
    # remote masked-diffusion code (LLaDA, Dream) registers its LM under AutoModel
    registered = getattr(config, "auto_map", None) or {}
    return AutoModel if has_remote_code(config) and "AutoModelForMaskedLM" not in registered else AutoModelForMaskedLM


def _declares_remote_code(directory: Path) -> bool:
    """Whether the directory's config.json has an ``auto_map`` (modeling code in the directory).

    An unreadable config says no here; ``AutoConfig`` then reports it.
    """
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("auto_map"))
