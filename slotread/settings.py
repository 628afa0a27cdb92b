"""The server's configuration: one ``Settings`` object, built once at the entry point and passed down.

Every field can come from the environment with the ``SLOTREAD_`` prefix (``SLOTREAD_PORT=9000``);
explicit values (the CLI's flags) win over the environment. The defaults run on a 2-core laptop; on a
GPU (``device`` "cuda...") the limits that only cost memory there are raised (``GPU_DEFAULTS``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from slotread.api.images import ImageLimits
from slotread.models.registry import DEFAULT_MODEL

#: decisions a gateway (``upstreams`` set) runs at once unless told otherwise
GATEWAY_CONCURRENCY = 16
#: On a GPU a forward of 100 canvases costs little more than one of 10 (the weights are read once
#: either way), so many decisions run at once and a queue that deep still answers in time; these
#: replace the CPU defaults of the fields not set explicitly.
GPU_DEFAULTS: dict[str, Any] = {"max_concurrency": 32, "queue_size": 256}


class Settings(BaseSettings):
    """What ``slotread serve`` serves, where, and within which limits."""

    model_config = SettingsConfigDict(env_prefix="SLOTREAD_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    #: registry name, checkpoint directory or .gguf file
    model: str = DEFAULT_MODEL
    cache_dir: Path | None = None
    #: torch device of the weights: "cpu", "cuda", "cuda:1"
    device: str = "cpu"
    #: dtype of the weights
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    #: bytes of prompt KV the engine keeps (a 1,600-token prompt of DiffusionGemma 26B-A4B holds
    #: ~240 MB); None: the engine's own on the CPU (512 MiB causal, 1 GiB DiffusionGemma), half the
    #: device memory free after loading on a GPU
    prefix_cache_bytes: int | None = Field(None, ge=0)
    #: canvases (rows) of one forward; None: the engine's default on the CPU (causal 1, so an answer is
    #: bit-identical in any batch; masked 16; DiffusionGemma 32), 128 on a GPU
    max_batch: int | None = Field(None, ge=1, le=4096)
    #: answers bit-identical whatever else the server is doing and whatever its cache holds
    #: (``Engine.deterministic``; DiffusionGemma on a GPU: batch-invariant kernels, bench/RESULTS.md
    #: measures the cost; causal and masked models: one row per forward)
    deterministic: bool = False
    #: a file of API keys (one key, or ``sha256:<hex>`` of a key, per line); None turns auth off
    api_keys: Path | None = None
    #: base URLs of remote engines (``slotread engine`` or vLLM servers of ``model``); when set, the
    #: server loads only the tokenizer and sends its reads to them. ``SLOTREAD_UPSTREAMS``: comma-separated
    upstreams: Annotated[list[str], NoDecode] = Field(default_factory=list)
    #: seconds one read may take on the upstreams, retries on other replicas included
    upstream_timeout_s: float = Field(5.0, gt=0)
    #: seconds between health checks of each upstream replica; a 503 for want of replicas says to
    #: retry after this long
    health_interval_s: float = Field(2.0, gt=0)
    #: decisions running at once; their reads are merged into one engine batch at a time. On a 2-core
    #: CPU two at once gave the same throughput as one at twice the latency (bench/load.py, the
    #: default model), so 1; on a GPU, where batches are cheap, 32 (``GPU_DEFAULTS``). With upstreams the default is
    #: GATEWAY_CONCURRENCY: a gateway's decisions wait on the network, and the replicas batch them
    max_concurrency: int = Field(1, ge=1, le=256)
    #: decisions waiting for a slot; one more is answered 529 at once
    queue_size: int = Field(16, ge=0, le=100_000)
    #: seconds within which a decision should be answered: a request that could not get its slot in
    #: time to finish by then (judged from recent decision times) is answered 529 instead; under the
    #: official SDK's 10 s timeout
    request_deadline_s: float = Field(8.0, gt=0)
    #: what a 529 tells the client to wait before retrying
    retry_after_s: float = Field(1.0, gt=0)
    #: request body limit in bytes, checked on the wire and again after decompression
    max_body_bytes: int = Field(1_048_576, ge=1024)
    #: images one request may carry (System One ``images`` and ``assets``, OpenAI ``input_image`` parts)
    max_images: int = Field(8, ge=0, le=64)
    #: bytes of one image file (PNG, JPEG or WebP) as sent
    max_image_bytes: int = Field(5 * 2**20, ge=1024)
    #: pixels of one decoded image; below it the model's image processor resizes it to its own budget
    max_image_pixels: int = Field(4096 * 4096, ge=64)
    max_questions: int = Field(64, ge=1)
    max_samples: int = Field(32, ge=1)
    #: largest x_permutations (option→label assignments per question; each is a read)
    max_permutations: int = Field(16, ge=1, le=255)
    #: options per choice question (the System One contract allows up to 255)
    max_options: int = Field(255, ge=2, le=255)
    #: prompt + canvas tokens of one read; None: the model's own limit
    max_prompt_tokens: int | None = Field(None, ge=16)
    #: a directory of calibration artifacts (``slotread calibrate``); content-free reads are saved there
    calibration_dir: Path | None = None
    #: a directory of learned readouts (``slotread fit``) that requests with ``x_readout`` answer with
    readout_dir: Path | None = None
    #: serve the browser playground at ``/playground`` (and redirect ``/`` to it); it only calls the
    #: public routes, with the key the person types in the page
    playground: bool = True
    #: example bank files (``slotread.api.bank_file``), one per question schema, serving x_examples,
    #: x_shortlist and readouts fitted with a vote or a lexical partner
    example_banks: list[Path] = Field(default_factory=list)
    #: a registry sentence encoder serving x_shortlist from meaning where no bank serves a question
    encoder: str | None = None

    @property
    def image_limits(self) -> ImageLimits:
        """The limits on a request's images, as the Decider takes them."""
        return ImageLimits(self.max_images, self.max_image_bytes, self.max_image_pixels)

    @field_validator("upstreams", mode="before")
    @classmethod
    def _split_upstreams(cls, value: Any) -> Any:
        return [url.strip() for url in value.split(",") if url.strip()] if isinstance(value, str) else value

    @field_validator("upstreams")
    @classmethod
    def _upstreams_are_http(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"upstream {url!r} is not an http:// or https:// URL")
        return [url.rstrip("/") for url in urls]

    @model_validator(mode="after")
    def _gateway_concurrency(self) -> Settings:
        if self.upstreams and "max_concurrency" not in self.model_fields_set:
            self.max_concurrency = GATEWAY_CONCURRENCY
        return self

    @model_validator(mode="after")
    def _gpu_defaults(self) -> Settings:
        if self.device.startswith("cuda") and not self.upstreams:
            for name, value in GPU_DEFAULTS.items():
                if name not in self.model_fields_set:
                    setattr(self, name, value)
        return self

    @model_validator(mode="after")
    def _paths_exist(self) -> Settings:
        # Refuse at start-up rather than serve without the auth the operator asked for.
        if self.api_keys is not None and not self.api_keys.is_file():
            raise ValueError(f"api_keys: {self.api_keys} is not a file")
        if self.calibration_dir is not None and not self.calibration_dir.is_dir():
            raise ValueError(f"calibration_dir: {self.calibration_dir} is not a directory")
        if self.readout_dir is not None and not self.readout_dir.is_dir():
            raise ValueError(f"readout_dir: {self.readout_dir} is not a directory")
        for bank in self.example_banks:
            if not bank.is_file():
                raise ValueError(f"example_banks: {bank} is not a file")
        return self
