"""The Python entry point: ``Decider(model=...).decide(request) -> response``.

Wires the parts: a model from ``slotread.models``, the engine for its family, the renderer for its
tokenizer, and the System One wire format on both ends. With ``upstreams`` the engine is remote: the
Decider loads only the tokenizer, renders the reads itself, and sends them to replicas of the model.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import DiffusionGemmaForBlockDiffusion, PreTrainedModel, PreTrainedTokenizerBase

import slotread.pipeline as pipeline
from slotread.api.bank_file import read_bank
from slotread.api.images import ImageLimits
from slotread.core.answers import DecisionResult
from slotread.engines.base import Engine, vision_of
from slotread.engines.causal import CausalEngine
from slotread.engines.diffusion_gemma.engine import DiffusionGemmaEngine
from slotread.engines.diffusion_gemma.fast_paths import FastPaths
from slotread.engines.masked import MaskedEngine
from slotread.engines.prefix_cache import PrefixCache
from slotread.engines.process import ProcessEngine
from slotread.engines.remote.engine import RemoteEngine
from slotread.errors import CalibrationError, ExampleBankError, ModelLoadError
from slotread.models.encoder import SentenceEncoder, load_encoder
from slotread.models.load import LoadedModel, load_model, load_tokenizer
from slotread.models.masked_adapter import masked_adapter
from slotread.prompt.render import Layout, Renderer
from slotread.quality.calibration.store import CalibrationStore
from slotread.quality.examples.bank import ExampleBank, ExampleBanks
from slotread.quality.examples.retrieval import Retrieval
from slotread.quality.readouts.store import ReadoutStore
from slotread.settings import GPU_BATCH, DeciderSettings

logger = logging.getLogger(__name__)

#: Model names a request may give besides the served model's own name (``pipeline.validate`` checks them).
MODEL_ALIASES = pipeline.MODEL_ALIASES

#: the defaults of the Decider's keyword arguments, written once in ``settings`` (without the environment)
DEFAULTS = DeciderSettings.model_construct()
DEFAULT_DTYPE: torch.dtype = getattr(torch, DEFAULTS.dtype)


#: the share of the device memory free after loading that the prefix cache may fill on a GPU (the rest
#: is for activations and CUDA graphs)
GPU_CACHE_SHARE = 0.5


def make_engine(
    loaded: LoadedModel,
    cache_bytes: int | None = None,
    max_batch: int | None = None,
    deterministic: bool = False,
    slow_paths: Sequence[str] = (),
) -> Engine:
    """The in-process engine for a loaded model's family, with ``cache_bytes`` of prefix cache and
    ``max_batch`` rows per forward; None keeps the engine's own (CPU) default, or on a GPU sizes them
    for it (``GPU_BATCH``, ``GPU_CACHE_SHARE`` of the memory free now). ``deterministic``: answers
    bit-identical in any batch and cache state (``Engine.deterministic``): DiffusionGemma's mode of
    that name; causal and masked models one row per forward, whatever ``max_batch`` says.
    ``slow_paths``: DiffusionGemma's fast paths to leave off (``FastPaths.without``)."""
    model = loaded.model
    device = next(model.parameters()).device
    if device.type == "cuda":
        cache_bytes = (
            cache_bytes if cache_bytes is not None else int(torch.cuda.mem_get_info(device)[0] * GPU_CACHE_SHARE)
        )
        max_batch = max_batch or GPU_BATCH
    cache: dict[str, Any] = {} if cache_bytes is None else {"prefix_cache": PrefixCache(cache_bytes)}
    if isinstance(model, DiffusionGemmaForBlockDiffusion):
        # an encoder forward takes as many new tokens as a full batch of 128-token states brings
        rows: dict[str, Any] = (
            {} if max_batch is None else {"max_canvases": max_batch, "max_encode_tokens": max_batch * 128}
        )
        engine = DiffusionGemmaEngine(
            model, **cache, **rows, deterministic=deterministic, fast=FastPaths.without(slow_paths)
        )
        engine.prepare()  # its CUDA graphs, which a forward under traffic would wait for
        return engine
    if slow_paths:
        logger.info("%s has no fast paths to leave off (%s): they are DiffusionGemma's", loaded.name, slow_paths)
    if deterministic and (max_batch or 1) > 1:
        logger.info("deterministic: %s reads one row per forward (max_batch %d not used)", loaded.name, max_batch)
    rows_per_forward = 1 if deterministic else max_batch
    batch: dict[str, Any] = {} if rows_per_forward is None else {"max_batch_rows": rows_per_forward}
    if loaded.family == "causal" and isinstance(model, PreTrainedModel):
        return CausalEngine(model, **cache, **batch)
    if loaded.family == "masked" and isinstance(model, PreTrainedModel):
        return MaskedEngine(model, masked_adapter(loaded.name, model.config, loaded.tokenizer), **batch)
    raise ModelLoadError(loaded.name, f"no in-process engine reads a {type(model).__name__}")


def engine_of(
    model: str,
    cache_dir: Path | None,
    device: str,
    dtype: torch.dtype,
    prefix_cache_bytes: int | None,
    max_batch: int | None,
    deterministic: bool,
    slow_paths: Sequence[str],
) -> tuple[str, PreTrainedTokenizerBase, Engine]:
    """``model`` loaded and its engine made (``make_engine``): an engine process's build
    (``ProcessEngine``, which runs it in that process); returns the model's name, tokenizer and engine."""
    loaded = load_model(model, cache_dir=cache_dir, device=device, dtype=dtype)
    return loaded.name, loaded.tokenizer, make_engine(loaded, prefix_cache_bytes, max_batch, deterministic, slow_paths)


def read_example_bank(path: Path) -> ExampleBank:
    """An example bank file (format: ``slotread.api.bank_file``) as a bank a Decider serves."""
    data = read_bank(path)
    return ExampleBank(data.question, data.instructions, data.examples, str(path))


class Decider:
    """Answers System One requests with one model, in process or through remote replicas (``upstreams``).

    The keyword arguments are ``DeciderSettings``' fields and are documented there (``from_settings``
    builds a Decider from them); here ``model`` may also be a ``LoadedModel`` built elsewhere (tests,
    custom models), ``dtype`` is a torch dtype, and ``example_banks`` and ``encoder`` may be loaded ones.
    Loading raises ModelLoadError naming the model and why (a tokenizer that cannot provide the
    single-token labels slotread reads included), CalibrationError for an unreadable calibration
    artifact, ExampleBankError when two banks serve one question schema. ``close`` stops a remote
    engine's health checks and an engine process (``engine_process``, which loads the model by name
    in a process of its own).
    """

    def __init__(
        self,
        model: str | LoadedModel = DEFAULTS.model,
        *,
        upstreams: Sequence[str] = (),
        upstream_timeout_s: float = DEFAULTS.upstream_timeout_s,
        health_interval_s: float = DEFAULTS.health_interval_s,
        cache_dir: Path | None = None,
        device: str = DEFAULTS.device,
        dtype: torch.dtype = DEFAULT_DTYPE,
        prefix_cache_bytes: int | None = None,
        max_batch: int | None = None,
        deterministic: bool = DEFAULTS.deterministic,
        slow_paths: Sequence[str] = (),
        engine_process: bool = DEFAULTS.engine_process,
        max_questions: int = DEFAULTS.max_questions,
        max_samples: int = DEFAULTS.max_samples,
        max_options: int = DEFAULTS.max_options,
        max_permutations: int = DEFAULTS.max_permutations,
        max_prompt_tokens: int | None = None,
        calibration_dir: Path | None = None,
        example_banks: Sequence[ExampleBank] = (),
        readout_dir: Path | None = None,
        image_limits: ImageLimits = DEFAULTS.image_limits,
        encoder: str | SentenceEncoder | None = None,
        retrieval: Retrieval = DEFAULTS.retrieval,
    ) -> None:
        #: the engine's own process (``engine_process``), which ``engine`` reads through
        self.engine_process: ProcessEngine | None = None
        if upstreams:
            if isinstance(model, LoadedModel):
                raise TypeError("a Decider with upstreams takes the model by name: it loads no weights")
            spec = load_tokenizer(model, cache_dir=cache_dir)
            if spec.family == "masked":  # vLLM's API has no mask-token read
                raise ModelLoadError(spec.name, "masked models are read in process, not through --upstream")
            self.name, tokenizer = spec.name, spec.tokenizer
            self.engine: Engine = RemoteEngine(
                upstreams,
                model=spec.name,
                family=spec.family,
                vocab_size=spec.vocab_size,
                timeout_s=upstream_timeout_s,
                health_interval_s=health_interval_s,
            )
        elif engine_process:
            if isinstance(model, LoadedModel):
                raise TypeError("a Decider with engine_process takes the model by name: its process loads it")
            built = functools.partial(
                engine_of, model, cache_dir, device, dtype, prefix_cache_bytes, max_batch, deterministic, slow_paths
            )
            self.engine_process = ProcessEngine(built)
            self.name, tokenizer = self.engine_process.name, self.engine_process.tokenizer
            self.engine = self.engine_process
        else:
            loaded = (
                model
                if isinstance(model, LoadedModel)
                else load_model(model, cache_dir=cache_dir, device=device, dtype=dtype)
            )
            self.name, tokenizer = loaded.name, loaded.tokenizer
            self.engine = make_engine(loaded, prefix_cache_bytes, max_batch, deterministic, slow_paths)
        try:
            self.renderer = Renderer(tokenizer, self.engine.family)
            self._renderers = {self.renderer.layout: self.renderer}
        except ValueError as exc:
            self.close()
            raise ModelLoadError(self.name, str(exc)) from exc
        self.max_questions = max_questions
        self.max_samples = max_samples
        self.max_options = max_options
        self.max_permutations = max_permutations
        self.max_prompt_tokens = max_prompt_tokens
        self.image_limits = image_limits
        if isinstance(encoder, str):
            encoder = load_encoder(encoder, cache_dir, device if not upstreams else "cpu")
        self.encoder = encoder
        try:
            self.calibrations = CalibrationStore(self.name, calibration_dir)
            self.banks = ExampleBanks(example_banks, retrieval, encoder.embed if encoder is not None else None)
            self.readouts = ReadoutStore(
                self.name,
                readout_dir,
                hidden_states=not upstreams,
                banks=self.banks,
                encoder=None if encoder is None else encoder.name,
                embed=None if encoder is None else encoder.embed,
            )
        except (CalibrationError, ExampleBankError):
            self.close()
            raise
        logger.info("serving %s with the %s engine", self.name, type(self.engine).__name__)

    @classmethod
    def from_settings(cls, settings: DeciderSettings) -> Decider:
        """The Decider ``settings`` describe (``slotread decide``, ``slotread serve``), its example banks read
        from their files."""
        converted = {"model", "dtype", "example_banks", "max_images", "max_image_bytes", "max_image_pixels"}
        same = {name: getattr(settings, name) for name in DeciderSettings.model_fields if name not in converted}
        return cls(
            settings.model,
            dtype=getattr(torch, settings.dtype),
            example_banks=[read_example_bank(path) for path in settings.example_banks],
            image_limits=settings.image_limits,
            **same,
        )

    def close(self) -> None:
        """Release what the engine holds beyond memory: a remote engine's health checks and connections,
        an engine process."""
        if isinstance(self.engine, RemoteEngine):
            self.engine.close()
        if self.engine_process is not None:
            self.engine_process.close()

    def renderer_for(self, layout: Layout) -> Renderer:
        """The renderer of this model in a prompt layout (learned readouts may be fitted in another one)."""
        if layout not in self._renderers:
            self._renderers[layout] = Renderer(self.renderer.tokenizer, self.engine.family, layout)
        return self._renderers[layout]

    @property
    def takes_images(self) -> bool:
        """Whether requests may carry images: the engine reads them (a vision tower, in process)."""
        return vision_of(self.engine) is not None

    def decide(self, request: dict[str, Any], parts: dict[str, bytes] | None = None) -> dict[str, Any]:
        """Answer a System One request body (``parts``: a multipart body's files by part name, which its
        ``assets`` name); returns the response body. The request's path, stage by stage, is
        ``slotread.pipeline``.

        Raises InvalidRequest (with FastAPI-style ``detail``), UnknownModel or PromptTooLong; with
        upstreams also UpstreamUnavailable or UpstreamError.
        """
        return pipeline.respond(self, request, parts)

    def answer(self, request: dict[str, Any]) -> DecisionResult:
        """Answer a System One request body with core values: each answer keeps its raw reads (label
        logits in option order, with the assignment each was read under), which fitting needs."""
        return pipeline.answer(self, request)[1]
