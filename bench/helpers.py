"""What the benchmarks share: the 26B-A4B shape with random weights on a GPU, random ids, the library's
own read as a transformers user writes it (the baseline the GPU benchmark times, and the reference the
GPU tests, tests/gpu, compare the engine with), timing batches, one percentile, and ``slotread``
server processes (started, awaited, stopped).

The scripts import this module and no other script: ``python bench/NAME.py`` finds it beside them,
``PYTHONPATH=.`` finds it as ``bench.helpers`` (the GPU tests).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import torch
from transformers import DiffusionGemmaForBlockDiffusion, DiffusionGemmaTextConfig, DynamicCache

from slotread.engines.base import ReadRequest
from slotread.engines.diffusion_gemma.noise import noise_canvas
from slotread.models.shapes import DIFFUSION_GEMMA_26B_A4B, diffusion_gemma_config, random_weights

SHAPE = DIFFUSION_GEMMA_26B_A4B
VOCAB = SHAPE["vocab_size"]

#: support messages the load benchmarks' decisions are about
SUPPORT_MESSAGES = [
    "My card still hasn't arrived after two weeks and I need it to pay rent on Friday.",
    "I was charged twice for the same purchase yesterday, please refund one of them.",
    "Someone stole my wallet this morning, block my card now!",
    "How do I change the PIN of my debit card?",
    "The app keeps crashing whenever I try to look at my statements.",
    "Thanks for the quick help last week, everything works now.",
]
#: README's support-ticket questions, as the load benchmarks' clients ask them
TICKET_QUESTIONS: dict[str, Any] = {
    "urgent": {"type": "noul", "instructions": "Does the customer need this solved within a few days?"},
    "intent": {
        "type": "choice",
        "instructions": "What does the customer want?",
        "criteria": {
            "card_arrival": "a card they ordered has not arrived",
            "refund": "money back for a payment",
            "lost_or_stolen": "their card was lost or stolen",
            "other": None,
        },
    },
    "frustration": {
        "type": "score",
        "instructions": "How frustrated is the customer?",
        "criteria": ["calm", "mildly annoyed", "annoyed", "very frustrated", "furious"],
    },
}


def build(layers: int, dtype: torch.dtype) -> DiffusionGemmaForBlockDiffusion:
    """The shape with random weights, built directly on the GPU."""
    return random_weights(DiffusionGemmaForBlockDiffusion, diffusion_gemma_config(SHAPE, layers), "cuda", dtype)


def ids(generator: torch.Generator, n: int) -> tuple[int, ...]:
    """``n`` random ids above the special tokens."""
    return tuple(torch.randint(300, VOCAB, (n,), generator=generator).tolist())


class Naive:
    """The library's modules as a transformers user calls them."""

    def __init__(self, model: DiffusionGemmaForBlockDiffusion) -> None:
        self.model = model
        self.config = model.config.get_text_config()
        self.prefixes: dict[tuple[int, ...], DynamicCache] = {}

    def prefix(self, prompt: tuple[int, ...]) -> DynamicCache:
        if prompt not in self.prefixes:
            cache = DynamicCache(config=self.config)
            self.model.model.encoder(input_ids=torch.tensor([prompt], device="cuda"), past_key_values=cache)
            self.prefixes[prompt] = cache
        return self.prefixes[prompt]

    def read(self, requests: list[ReadRequest], cached: int) -> list[torch.Tensor]:
        """Label logits per request; ``cached`` leading segments come from the naive prefix store.

        Rows must share those segments and have equal lengths (the scenarios make them so).
        """
        with torch.inference_mode():
            return self._read(requests, cached)

    def _read(self, requests: list[ReadRequest], cached: int) -> list[torch.Tensor]:
        device = "cuda"
        batch = len(requests)
        noised = [noise_canvas(r.canvas, [s.position for s in r.slots], r.seed or 0, VOCAB) for r in requests]
        if cached == 0:
            prompt = torch.tensor([r.prompt_ids for r in requests], device=device)
            out = self.model(input_ids=prompt, decoder_input_ids=torch.tensor(noised, device=device))
            logits = out.logits
        else:
            head = sum(len(s) for s in requests[0].prompt[:cached])
            base = self.prefix(requests[0].prompt_ids[:head])
            cache = _expanded(base, batch, self.config)
            own = [r.prompt_ids[head:] for r in requests]
            length = len(requests[0].prompt_ids)
            if own[0]:
                self.model.model.encoder(
                    input_ids=torch.tensor(own, device=device),
                    position_ids=torch.arange(head, length, device=device)[None].expand(batch, -1),
                    past_key_values=cache,
                )
            hidden = self.model.model.decoder(
                decoder_input_ids=torch.tensor(noised, device=device),
                past_key_values=cache,
                decoder_position_ids=torch.arange(length, length + len(noised[0]), device=device)[None].expand(
                    batch, -1
                ),
            ).last_hidden_state
            cap = self.config.final_logit_softcapping
            logits = cap * torch.tanh(self.model.lm_head(hidden).float() / cap)
        return [logits[i, [s.position for s in r.slots]][:, list(r.slots[0].label_ids)] for i, r in enumerate(requests)]


def _expanded(base: DynamicCache, batch: int, config: DiffusionGemmaTextConfig) -> DynamicCache:
    """A cache whose layers view ``base``'s expanded to ``batch`` rows (the library copies on append)."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache()
    for (keys, values, _), kind, source in zip(base, config.layer_types, base.layers, strict=True):
        sliding = kind == "sliding_attention"
        layer = DynamicSlidingWindowLayer(config.sliding_window) if sliding else DynamicLayer()
        expanded_keys, expanded_values = keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1)
        layer.lazy_initialization(expanded_keys, expanded_values)
        layer.keys, layer.values = expanded_keys, expanded_values
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length = source.cumulative_length
        cache.layers.append(layer)
    return cache


def time_batches(run: Callable[[int], object], iterations: int) -> list[float]:
    """The wall time of ``run(i)`` for each of ``iterations`` batches on the GPU, after two warm-up batches."""
    for warm in range(2):
        run(-1 - warm)
    torch.cuda.synchronize()
    times = []
    for i in range(iterations):
        start = time.perf_counter()
        run(i)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``: the value at rank ``round(q * (n - 1))`` of the sorted
    values (NaN for none)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(
    command: list[str], log: Path, env: dict[str, str] | None = None, wrapper: Sequence[str] = ()
) -> subprocess.Popen[bytes]:
    """A ``slotread`` subcommand as its own process (in its own session, so it can be stopped whole);
    ``wrapper``: a script and its arguments that run the CLI's module in turn (``call_profile.py``)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, *wrapper, "-m", "slotread.cli", *command],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def wait_ready(url: str, process: subprocess.Popen[bytes], log: Path, path: str = "/readyz") -> None:
    """Wait until ``url`` + ``path`` answers 200 (20 minutes at most); stop the run if the process exits."""

    def gone() -> str | None:
        if process.poll() is None:
            return None
        return f"the server exited ({process.returncode}):\n{log.read_text()[-3000:]}"

    poll_ready(url, gone, path, lambda: log.read_text()[-3000:])


def poll_ready(
    url: str, gone: Callable[[], str | None], path: str = "/readyz", detail: Callable[[], str] = str, every: float = 1.0
) -> None:
    """Poll ``url`` + ``path`` until it answers 200 (20 minutes at most); stop the run with ``gone()``'s
    reason once it gives one (the server ended), or with ``detail()`` when time runs out."""
    deadline = time.monotonic() + 1200
    while time.monotonic() < deadline:
        if (reason := gone()) is not None:
            raise SystemExit(reason)
        try:
            if httpx.get(f"{url}{path}", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(every)
    raise SystemExit(f"the server was not ready in time:\n{detail()}")


def stop(process: subprocess.Popen[bytes]) -> None:
    """Stop a process ``start`` started, and its children: SIGTERM, then SIGKILL after a minute."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
