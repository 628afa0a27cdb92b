"""Milliseconds per decision for the causal engine's branch reads, four ways.

A decision is ``--branches`` questions on one state: each branch is a ``--prefix``-token shared
prompt prefix plus a ``--suffix``-token branch of its own (question and reply prefix), read at its
last token. ``--decisions`` decisions go to the engine together:

* naive: one full forward per branch over prefix + suffix (``logits_to_keep=1``), no cache;
* grouped by prefix: one ``read`` per decision (its rows share one prefix: an ``expand`` view);
* batched, left-padded: one ``read`` for all decisions (rows hold different prefixes);
* row by row: one ``read`` for all decisions with the engine's default of one row per forward
  (what keeps an answer bit-identical in any batch).

"cold" starts from an empty prefix cache (the prefix is encoded once per decision); "warm" has the
prefixes cached already (only the branches run). Prints a table and the largest logit difference
between the engine and the naive forward. Modes run interleaved, round after round, and the best
round counts: other processes on a shared machine only ever add time.

    python bench/causal_branches.py                                  # tiny random Qwen2
    python bench/causal_branches.py --gguf /path/qwen15.gguf --decisions 2 --repeats 2 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen2Config

from slotread.engines.base import ReadRequest, Slot, SlotScores
from slotread.engines.causal import CausalEngine

REPLY = 3  # reply-prefix tokens in the canvas before the slot
LABELS = (10, 11)


@dataclass(frozen=True)
class Mode:
    """One way to run the decisions: ``run`` is timed, ``before`` sets the prefix cache up."""

    name: str
    cache: str
    run: Callable[[], object]
    before: Callable[[], object] = lambda: None


def load(gguf: Path | None, dtype: torch.dtype) -> PreTrainedModel:
    """The GGUF model, or a small random Qwen2 when no file is given."""
    if gguf is not None:
        return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def decisions(args: argparse.Namespace, vocab: int) -> list[list[ReadRequest]]:
    """Random token ids shaped like the decisions described in the module docstring."""
    generator = np.random.default_rng(0)

    def ids(length: int, jitter: int = 0) -> tuple[int, ...]:
        length += int(generator.integers(-jitter, jitter + 1))
        return tuple(int(i) for i in generator.integers(100, vocab, size=length))

    result = []
    for _ in range(args.decisions):
        prefix = ids(args.prefix, args.jitter)
        questions = [ids(args.suffix - REPLY, args.jitter) for _ in range(args.branches)]
        result.append(
            [ReadRequest((prefix, question), (*ids(REPLY), 0), (Slot(REPLY, LABELS),)) for question in questions]
        )
    return result


def naive(model: PreTrainedModel, requests: list[ReadRequest]) -> list[np.ndarray]:
    """Label logits from one plain forward per branch."""
    out = []
    with torch.inference_mode():
        for request in requests:
            fed = torch.tensor([request.prompt_ids + request.canvas[:REPLY]])
            logits = model(input_ids=fed, logits_to_keep=1).logits[0, -1].float()
            out.append(logits[list(LABELS)].numpy())
    return out


def interleaved(modes: list[Mode], rounds: int) -> list[list[float]]:
    """Wall seconds of each mode per round; each round runs every mode once, in order, calling its
    ``before`` (untimed) first, so load from other processes spreads over all modes alike."""
    seconds: list[list[float]] = [[] for _ in modes]
    for _ in range(rounds):
        for mode, times in zip(modes, seconds, strict=True):
            mode.before()
            start = time.perf_counter()
            mode.run()
            times.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, help="a GGUF causal LM (default: a small random Qwen2)")
    parser.add_argument("--decisions", type=int, default=4, help="decisions per engine call")
    parser.add_argument("--branches", type=int, default=3, help="questions (branches) per decision")
    parser.add_argument("--prefix", type=int, default=100, help="shared prefix tokens per decision")
    parser.add_argument("--suffix", type=int, default=40, help="tokens of each branch after the prefix")
    parser.add_argument("--jitter", type=int, default=0, help="vary each prefix and question length by ±N")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each times every mode once")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights dtype")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    start = time.perf_counter()
    model = load(args.gguf, getattr(torch, args.dtype)).eval()
    engine = CausalEngine(model, max_batch_rows=64)
    alone = CausalEngine(model)
    print(f"{type(model).__name__} loaded in {time.perf_counter() - start:.1f} s; {args}")
    groups = decisions(args, model.config.get_text_config().vocab_size)
    flat = [request for group in groups for request in group]

    def grouped() -> list[SlotScores]:
        return [scores for group in groups for scores in engine.read(group)]

    def batched() -> list[SlotScores]:
        return engine.read(flat)

    reference = naive(model, flat)
    difference = max(
        float(np.abs(scores.logits[0] - expected).max()) for scores, expected in zip(batched(), reference, strict=True)
    )

    def row_by_row() -> list[SlotScores]:
        return alone.read(flat)

    def cold() -> None:
        engine.prefix_cache.clear()

    def cold_alone() -> None:
        alone.prefix_cache.clear()

    def warm() -> None:  # the cold runs before leave every decision's prefix cached
        assert len(engine.prefix_cache) == len(alone.prefix_cache) == args.decisions

    modes = [
        Mode("naive full forward per branch", "-", lambda: naive(model, flat)),
        Mode("grouped by prefix", "cold", grouped, cold),
        Mode("batched, left-padded", "cold", batched, cold),
        Mode("row by row", "cold", row_by_row, cold_alone),
        Mode("grouped by prefix", "warm", grouped, warm),
        Mode("batched, left-padded", "warm", batched, warm),
        Mode("row by row", "warm", row_by_row, warm),
    ]
    seconds = interleaved(modes, args.repeats)
    naive_best = min(seconds[0])
    print(f"\n{'mode':32} {'prefix':>6} {'best ms/decision':>17} {'median':>9} {'vs naive':>9}")
    for mode, times in zip(modes, seconds, strict=True):
        best, median = (1000 * t / args.decisions for t in (min(times), statistics.median(times)))
        print(f"{mode.name:32} {mode.cache:>6} {best:17.1f} {median:9.1f} {naive_best / min(times):8.2f}x")
    print(f"\nmax |label logit difference| engine vs naive: {difference:.2e}")


if __name__ == "__main__":
    main()
