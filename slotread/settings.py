"""Every entry point's configuration: one Settings class each, built once at the entry point and passed down.

    ModelSettings         which model, where: what every entry point that loads one takes
    ├── ReadSettings      how an in-process engine reads (deterministic, prefix cache, rows, slow paths)
    │   ├── EngineSettings    ``slotread engine`` (environment prefix ``SLOTREAD_ENGINE_``)
    │   └── DeciderSettings   what a Decider serves with: ``slotread decide``, ``Decider.from_settings``
    │       └── Settings      ``slotread serve``: the server's address, auth, admission and body limits
    └── DataSettings      the labelled items a job reads
        ├── EvalSettings      ``slotread eval``
        └── FittingSettings   the data fitting must keep apart from the evaluation's
            ├── CalibrateSettings ``slotread calibrate``
            └── FitSettings       ``slotread fit``

Each default is written once, here: the CLI's help reads them from the fields, the Decider's keyword
defaults from ``DeciderSettings``. Every field can come from the environment with the ``SLOTREAD_``
prefix (``SLOTREAD_PORT=9000``); explicit values win. A value out of range, or values that cannot work
together, raise ``SettingsError`` naming them, so the command line and a Python caller are refused alike.
The defaults run on a 2-core laptop; on a GPU the server's limits that only cost memory there are
raised (``GPU_DEFAULTS``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from slotread.api.images import DEFAULT_IMAGE_LIMITS, ImageLimits
from slotread.api.systemone import DEFAULT_MAX_PERMUTATIONS, DEFAULT_MAX_QUESTIONS, DEFAULT_MAX_SAMPLES
from slotread.engines.diffusion_gemma.fast_paths import FastPaths
from slotread.errors import SettingsError
from slotread.models.registry import DEFAULT_MODEL
from slotread.prompt.labels import MAX_CHOICE_OPTIONS

Dtype = Literal["bfloat16", "float32"]
#: how example banks rank their examples: ``quality.examples.retrieval.Retrieval`` (settings imports no quality
#: module; tests/test_settings.py checks the two agree)
Retrieval = Literal["bm25", "dense", "hybrid"]
#: decisions a gateway (``upstreams`` set) runs at once per replica unless told otherwise: what one
#: ``slotread serve`` runs on a GPU (``GPU_DEFAULTS``), so a replica's batcher sees what the
#: in-process server's does (bench/RESULTS.md: 16 against a client's 32 left the replica half fed)
GATEWAY_CONCURRENCY = 32
#: On a GPU a forward of 100 canvases costs little more than one of 10 (the weights are read once
#: either way), so many decisions run at once and a queue that deep still answers in time; these
#: replace the CPU defaults of the fields not set explicitly.
GPU_DEFAULTS: dict[str, Any] = {"max_concurrency": 32, "queue_size": 256, "engine_process": True}
#: canvases (rows) of one forward on a GPU unless ``max_batch`` says otherwise (``decider.make_engine``)
GPU_BATCH = 128
#: the most decisions a server runs at once
MAX_CONCURRENCY = 256
#: the address the servers listen on unless told otherwise: this machine only
LOCALHOST = "127.0.0.1"


def _problems(exc: ValidationError) -> str:
    """pydantic's errors as one line: the missing fields named as the CLI's flags, then each other problem."""
    errors = exc.errors()
    missing = [f"--{error['loc'][0]}".replace("_", "-") for error in errors if error["type"] == "missing"]
    said = [f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required"] if missing else []
    said += [f"{'.'.join(map(str, error['loc']))}: {error['msg']}" for error in errors if error["type"] != "missing"]
    return "; ".join(said)


def _needs_encoder(retrieval: Retrieval, encoder: str | None) -> None:
    """SettingsError when dense or hybrid retrieval has no sentence encoder to embed with."""
    if retrieval != "bm25" and encoder is None:
        raise SettingsError(
            f"--retrieval {retrieval} ranks bank examples by their sentence embeddings: "
            "load a sentence encoder with --encoder all-minilm-l6-v2"
        )


def _comma_list(value: Any) -> Any:
    """A list variable from the environment, as ``a,b,c`` (the flags give lists)."""
    return [item.strip() for item in value.split(",") if item.strip()] if isinstance(value, str) else value


#: a list of names, ``a,b,c`` in the environment
CommaList = Annotated[list[str], NoDecode, BeforeValidator(_comma_list)]


class ModelSettings(BaseSettings):
    """Which model, where: every entry point that loads one takes these."""

    model_config = SettingsConfigDict(env_prefix="SLOTREAD_", extra="forbid")

    #: registry name, checkpoint directory or .gguf file
    model: str = DEFAULT_MODEL
    #: where fetched models are kept; None: ``$SLOTREAD_CACHE``, else ~/.cache/slotread
    cache_dir: Path | None = None
    #: torch device of the weights: "cpu", "cuda", "cuda:1"
    device: str = "cpu"
    #: dtype of the weights; bfloat16 runs 2-3x faster than float32 on these CPUs' AMX units (bench/cpu_decide.py)
    dtype: Dtype = "bfloat16"

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:  # a value out of range or of the wrong type: ours, naming it
            raise SettingsError(_problems(exc)) from None

    def decider(self) -> DeciderSettings:
        """A Decider of this model with every other setting at its default: the one a job reads with."""
        return DeciderSettings.model_construct(**{name: getattr(self, name) for name in ModelSettings.model_fields})


class ReadSettings(ModelSettings):
    """How an in-process engine reads."""

    #: answers bit-identical whatever else the server is doing and whatever its cache holds
    #: (``Engine.deterministic``; DiffusionGemma on a GPU: batch-invariant kernels, bench/RESULTS.md
    #: measures the cost; causal and masked models: one row per forward)
    deterministic: bool = False
    #: bytes of prompt KV the engine keeps (a 1,600-token prompt of DiffusionGemma 26B-A4B holds
    #: ~240 MB); None: the engine's own on the CPU (512 MiB causal, 1 GiB DiffusionGemma), half the
    #: device memory free after loading on a GPU
    prefix_cache_bytes: int | None = Field(None, ge=0)
    #: canvases (rows) of one forward; None: the engine's default on the CPU (causal 1, so an answer is
    #: bit-identical in any batch; masked 16; DiffusionGemma 32), ``GPU_BATCH`` on a GPU
    max_batch: int | None = Field(None, ge=1, le=4096)
    #: DiffusionGemma fast paths to leave off, each then reading by its reference road
    #: (``engines/diffusion_gemma/fast_paths.py`` says what each is); the start-up log lists those on
    slow_paths: CommaList = Field(default_factory=list)

    @field_validator("slow_paths")
    @classmethod
    def _known_slow_paths(cls, value: list[str]) -> list[str]:
        try:
            FastPaths.without(value)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        return value


class EngineSettings(ReadSettings):
    """What ``slotread engine`` serves and where. Its own environment prefix: an engine often shares a host
    with a gateway whose ``SLOTREAD_PORT`` is not its port."""

    model_config = SettingsConfigDict(env_prefix="SLOTREAD_ENGINE_", extra="forbid")

    host: str = LOCALHOST
    #: 0 picks a free port
    port: int = Field(8001, ge=0, le=65535)


class DeciderSettings(ReadSettings):
    """What a Decider answers with and within which limits (``Decider.from_settings``)."""

    #: base URLs of remote engines (``slotread engine`` or vLLM servers of ``model``, by that name); when set,
    #: the Decider loads only the tokenizer (``device`` and ``dtype`` are the replicas' business) and sends
    #: its reads to them (``RemoteEngine``). ``SLOTREAD_UPSTREAMS``: comma-separated
    upstreams: CommaList = Field(default_factory=list)
    #: seconds a read may wait on the upstreams, resends included, where no request deadline applies (a
    #: Decider used directly, the server's warm-up); the server's reads wait until their request's deadline
    #: (``request_deadline_s``). Waiting long never takes a replica out of rotation: only signs it is gone do
    upstream_timeout_s: float = Field(30.0, gt=0)
    #: seconds between health checks of each upstream replica; a 503 for want of replicas says to
    #: retry after this long
    health_interval_s: float = Field(2.0, gt=0)
    #: run the in-process engine in a process of its own (``engines/process.py``), so the server's
    #: Python (HTTP, decisions) never makes the engine's kernel launches wait for the GIL: on by
    #: default on a GPU (``GPU_DEFAULTS``), off on the CPU; not with ``upstreams`` (no engine here)
    engine_process: bool = False
    #: images one request may carry (System One ``images`` and ``assets``, OpenAI ``input_image`` parts); only
    #: a model with a vision tower read in process (DiffusionGemma) takes any, others answer a 422
    max_images: int = Field(DEFAULT_IMAGE_LIMITS.count, ge=0, le=64)
    #: bytes of one image file (PNG, JPEG or WebP) as sent
    max_image_bytes: int = Field(DEFAULT_IMAGE_LIMITS.bytes, ge=1024)
    #: pixels of one decoded image; below it the model's image processor resizes it to its own budget
    max_image_pixels: int = Field(DEFAULT_IMAGE_LIMITS.pixels, ge=64)
    max_questions: int = Field(DEFAULT_MAX_QUESTIONS, ge=1)
    max_samples: int = Field(DEFAULT_MAX_SAMPLES, ge=1)
    #: largest x_permutations (option→label assignments per question; each is a read)
    max_permutations: int = Field(DEFAULT_MAX_PERMUTATIONS, ge=1, le=255)
    #: options per choice question (the System One contract allows up to 255)
    max_options: int = Field(MAX_CHOICE_OPTIONS, ge=2, le=MAX_CHOICE_OPTIONS)
    #: prompt + canvas tokens of one read; None: the model's own limit
    max_prompt_tokens: int | None = Field(None, ge=16)
    #: a directory of calibration artifacts (``slotread calibrate``); those of the model are loaded, and the
    #: content-free reads of ``x_calibration: contextual`` are saved there
    calibration_dir: Path | None = None
    #: a directory of learned readouts (``slotread fit``) that requests with ``x_readout`` answer with; with
    #: upstreams only those fitted on label logits alone (a remote engine returns no hidden states). A
    #: readout with a lexical partner has its classifier fitted at load, on its schema's example bank
    readout_dir: Path | None = None
    #: example bank files (``slotread.api.bank_file``), one per question schema, serving x_examples,
    #: x_shortlist and readouts fitted with a vote or a lexical partner
    example_banks: list[Path] = Field(default_factory=list)
    #: a registry sentence encoder (fetched and loaded at start) serving x_shortlist from meaning
    #: (``quality.examples.meaning``, no labels needed) where no bank serves a question
    encoder: str | None = None
    #: how the example banks rank their examples for x_examples, x_shortlist and votes
    #: (``quality.examples.retrieval``): BM25 over words, the encoder's cosine (dense; needs ``encoder``) or
    #: both fused (hybrid); a readout fitted with a vote serves only under the retrieval it was fitted with
    retrieval: Retrieval = "bm25"

    @property
    def image_limits(self) -> ImageLimits:
        """The limits on a request's images, as the Decider takes them."""
        return ImageLimits(self.max_images, self.max_image_bytes, self.max_image_pixels)

    @model_validator(mode="after")
    def _engine_process_needs_an_engine(self) -> DeciderSettings:
        if self.engine_process and self.upstreams:
            raise SettingsError("engine_process: with upstreams the engines are the replicas; leave one of them out")
        return self

    @field_validator("upstreams")
    @classmethod
    def _upstreams_are_http(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise SettingsError(f"upstream {url!r} is not an http:// or https:// URL")
        return [url.rstrip("/") for url in urls]

    @model_validator(mode="after")
    def _paths_exist(self) -> DeciderSettings:
        # Refuse at start-up rather than serve without what the operator asked for.
        if self.calibration_dir is not None and not self.calibration_dir.is_dir():
            raise SettingsError(f"calibration_dir: {self.calibration_dir} is not a directory")
        if self.readout_dir is not None and not self.readout_dir.is_dir():
            raise SettingsError(f"readout_dir: {self.readout_dir} is not a directory")
        for bank in self.example_banks:
            if not bank.is_file():
                raise SettingsError(f"example_banks: {bank} is not a file")
        return self

    @model_validator(mode="after")
    def _retrieval_has_encoder(self) -> DeciderSettings:
        _needs_encoder(self.retrieval, self.encoder)
        return self


class Settings(DeciderSettings):
    """What ``slotread serve`` serves, where, and within which limits."""

    host: str = LOCALHOST
    port: int = Field(8000, ge=0, le=65535)
    #: a file of API keys (one key, or ``sha256:<hex>`` of a key, per line); None turns auth off
    api_keys: Path | None = None
    #: decisions running at once; their reads are merged into one engine batch at a time. On a 2-core
    #: CPU two at once gave the same throughput as one at twice the latency (bench/load.py, the
    #: default model), so 1; on a GPU, where batches are cheap, 32 (``GPU_DEFAULTS``). With upstreams the default is
    #: GATEWAY_CONCURRENCY per replica (at most 256): a gateway's decisions wait on the network, and the
    #: replicas batch them
    max_concurrency: int = Field(1, ge=1, le=MAX_CONCURRENCY)
    #: decisions waiting for a slot; one more is answered 529 at once
    queue_size: int = Field(16, ge=0, le=100_000)
    #: seconds within which a decision should be answered: a request that could not get its slot in
    #: time to finish by then (judged from recent decision times) is answered 529 instead; through
    #: upstreams its reads wait until then and no longer (529 too). Under the official SDK's 10 s timeout
    request_deadline_s: float = Field(8.0, gt=0)
    #: what a 529 tells the client to wait before retrying
    retry_after_s: float = Field(1.0, gt=0)
    #: request body limit in bytes, checked on the wire and again after decompression
    max_body_bytes: int = Field(1_048_576, ge=1024)
    #: serve the browser playground at ``/playground`` (and redirect ``/`` to it); it only calls the
    #: public routes, with the key the person types in the page
    playground: bool = True

    @model_validator(mode="after")
    def _gateway_concurrency(self) -> Settings:
        if self.upstreams and "max_concurrency" not in self.model_fields_set:
            self.max_concurrency = min(GATEWAY_CONCURRENCY * len(self.upstreams), MAX_CONCURRENCY)
        return self

    @model_validator(mode="after")
    def _gpu_defaults(self) -> Settings:
        if self.device.startswith("cuda") and not self.upstreams:
            for name, value in GPU_DEFAULTS.items():
                if name not in self.model_fields_set:
                    setattr(self, name, value)
        return self

    @model_validator(mode="after")
    def _api_keys_exist(self) -> Settings:
        # Refuse at start-up rather than serve without the auth the operator asked for.
        if self.api_keys is not None and not self.api_keys.is_file():
            raise SettingsError(f"api_keys: {self.api_keys} is not a file")
        return self


class DataSettings(ModelSettings):
    """The labelled items a job reads (``eval.datasets``), and how each is asked."""

    #: a built-in dataset (banking77, clinc150, sst5, boolq, ...) or a labelled .jsonl/.csv file
    dataset: str
    #: split of a built-in dataset; None: the job's own (eval: the evaluation split; fit: the fitting split)
    split: str | None = None
    #: question file (a System One question object) for a labelled file
    question: Path | None = None
    #: folder of the built-in datasets; None: ``$SLOTREAD_DATA``, else the copy shipped in the package
    data_dir: Path | None = None
    #: a seeded random sample of this many items; None: all
    limit: int | None = None
    #: seed of the ``limit`` sample (and of every other draw of items)
    sample_seed: int = 0
    #: x_seed of every request
    seed: int = 0
    #: extra request fields of every request (read options such as ``x_samples``)
    request_fields: dict[str, Any] = Field(default_factory=dict)
    #: draw a progress bar (eval and fit)
    progress: bool = True


class EvalSettings(DataSettings):
    """What ``slotread eval`` measures, on what, and where it writes the run."""

    #: run folder: run.json, predictions.csv, metrics.json, reliability.png
    out: Path
    #: run a baseline with no model instead: TF-IDF + logistic regression, or the BM25 neighbour vote
    baseline: Literal["tfidf", "knn"] | None = None
    #: training file for baselines and example banks on a labelled file (built-ins use their train split)
    train: str | None = None
    #: learn from at most this many training items per class (the few-label setting)
    per_class: int | None = None
    #: x_examples of every request; with the knn baseline, the neighbours that vote
    examples: int = 0
    #: x_shortlist of every request
    shortlist: int = 0
    #: the calibration artifacts and learned readouts the model's Decider serves (``DeciderSettings``)
    calibration_dir: Path | None = None
    readout_dir: Path | None = None
    #: ask a choice question with its options in this seeded random order
    shuffle_options: int | None = None
    #: an example bank file instead of one built from the training data
    example_bank: Path | None = None
    #: a sentence encoder: with shortlist and no examples, bank or dense/hybrid retrieval, shortlists come from
    #: meaning; with dense or hybrid retrieval, the bank's ranking
    encoder: str | None = None
    #: how the bank ranks its examples (``DeciderSettings.retrieval``): for x_examples, x_shortlist, the
    #: neighbour vote and readouts' votes
    retrieval: Retrieval = "bm25"
    #: decisions in flight at once, their reads and thoughts merged into shared engine calls as the
    #: server merges them
    concurrency: int = Field(1, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _dataset_and_out(cls, values: Any) -> Any:
        # one message for both: ``eval compare`` and ``eval table`` take neither, so argparse cannot require them
        if isinstance(values, dict) and not (values.get("dataset") and values.get("out")):
            raise SettingsError("--dataset and --out are required")
        return values

    @model_validator(mode="after")
    def _a_baseline_reads_no_options(self) -> EvalSettings:
        if self.baseline and self.shuffle_options is not None:
            raise SettingsError("--shuffle-options reorders a model's options; the baseline reads none")
        if self.baseline == "tfidf" and (self.examples or self.shortlist or self.example_bank):
            raise SettingsError("the TF-IDF baseline shows no examples; drop --examples/--shortlist")
        if self.baseline == "knn" and self.shortlist:
            raise SettingsError("the neighbour vote reads no shortlist; drop --shortlist")
        if self.baseline == "tfidf" and self.retrieval != "bm25":
            raise SettingsError("--retrieval ranks a bank's examples; the TF-IDF baseline reads no bank")
        _needs_encoder(self.retrieval, self.encoder)
        return self


class FittingSettings(DataSettings):
    """A job that fits on data the evaluation must not hold."""

    #: where the fitted artifact is written
    out: Path
    #: the evaluation data (dataset name or labelled file): refuse to fit on items it holds
    exclude: str | None = None
    #: split of ``exclude``; None: its evaluation split
    exclude_split: str | None = None
    #: leave out the items ``exclude`` holds instead of refusing the data
    drop_overlap: bool = False


class CalibrateSettings(FittingSettings):
    """What ``slotread calibrate`` fits on."""

    #: fit on the same number of items of every class (``eval.datasets.balance``)
    balance: bool = False


class FitSettings(FittingSettings):
    """What ``slotread fit`` fits (``fit.fit_readout``'s options)."""

    #: items kept per class, drawn with ``sample_seed``; 0: all
    per_class: int = 64
    #: share of items held out for the temperature
    holdout: float = 0.2
    #: what the head reads
    features: Literal["hidden+logits", "logits"] = "hidden+logits"
    #: prompt layout of the reads; None: the family's, as plain reads
    layout: Literal["schema_first", "state_first"] | None = None
    #: L2 strengths to try; the one with the lowest held-out NLL is kept
    l2: list[float] = Field(default_factory=lambda: [1e-3, 1e-2, 1e-1])
    #: the label vote of this many nearest example-bank examples joins the head; 0: no vote
    vote: int = 0
    #: a TF-IDF + logistic-regression classifier of the bank joins the head
    lexical: bool = False
    #: a logistic regression on this sentence encoder's embeddings of the bank joins the head
    encoder: str | None = None
    #: how the bank ranks the vote's neighbours (``DeciderSettings.retrieval``; dense and hybrid embed with
    #: ``encoder``); recorded in the readout, which then serves only under it
    retrieval: Retrieval = "bm25"
    #: see at most this many items per class of the data at all (the few-label setting)
    seen_per_class: int | None = None
    #: items per engine call while reading
    batch_size: int = 16

    @model_validator(mode="after")
    def _holdout_and_vote(self) -> FitSettings:
        if not 0 < self.holdout < 1 or self.vote < 0:
            raise SettingsError("--holdout must be between 0 and 1 and --vote must not be negative")
        if self.retrieval != "bm25" and not self.vote:
            raise SettingsError("--retrieval ranks the neighbours of a vote: give --vote K")
        _needs_encoder(self.retrieval, self.encoder)
        return self
