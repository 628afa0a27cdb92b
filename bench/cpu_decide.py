"""CPU decision latency: p50/p95 for 1- and 3-question decisions, cold and with the prefix cache warm.

    python bench/cpu_decide.py --model qwen2.5-coder-1.5b-instruct --model qwen2.5-coder-0.5b-instruct

Each decision asks about a different ~100-token state (SST-5 reviews joined until 100 tokens).
"cold" clears the engine's prefix cache before every decision; "warm" keeps it, so the question
schema (the prompt prefix) is encoded once and each decision only runs its state and reply.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from slotread.decider import Decider
from slotread.eval.datasets import load_dataset
from slotread.prompt.render import LAYOUTS, Renderer

QUESTIONS: dict[str, Any] = {
    "positive": {"type": "noul", "instructions": "Is this review positive overall?"},
    "topic": {
        "type": "choice",
        "instructions": "What does the review mostly talk about?",
        "criteria": {
            "acting": "the performances",
            "story": "the plot or script",
            "visuals": "how it looks",
            "music": "the soundtrack",
            "other": None,
        },
    },
    "sentiment": {
        "type": "score",
        "instructions": "How positive is the review?",
        "criteria": ["very negative", "negative", "neutral", "positive", "very positive"],
    },
}


def states(decider: Decider, data_dir: Path | None, count: int, tokens: int = 100) -> list[str]:
    """``count`` states of about ``tokens`` tokens each, from SST-5 test sentences."""
    sentences = [item.state for item in load_dataset("sst5", data_dir=data_dir).items]
    tokenizer = decider.renderer.tokenizer
    out, current = [], ""
    for sentence in sentences:
        current = f"{current} {sentence}".strip()
        if len(tokenizer.encode(current, add_special_tokens=False)) >= tokens:
            out.append(current)
            current = ""
            if len(out) == count:
                break
    return out


def measure(decider: Decider, questions: dict[str, Any], texts: list[str], warm: bool) -> dict[str, float]:
    """Latency percentiles (ms) and reads per decision over one decision per state."""
    cache = decider.engine.prefix_cache  # type: ignore[attr-defined]
    cache.clear()
    if warm:
        decider.decide({"state": "warm-up", "questions": questions})
    latencies, reads, tokens = [], [], []
    for text in texts:
        if not warm:
            cache.clear()
        start = time.perf_counter()
        response = decider.decide({"state": text, "questions": questions})
        latencies.append((time.perf_counter() - start) * 1000)
        reads.append(response["usage"]["output_tokens"])
        tokens.append(response["usage"]["input_tokens"])
    latencies.sort()
    return {
        "p50": statistics.median(latencies),
        "p95": latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))],
        "reads": statistics.mean(reads),
        "tokens": statistics.mean(tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="model to measure (repeatable)")
    parser.add_argument("--decisions", type=int, default=12, help="decisions per row")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], action="append", help="weights dtype (repeatable)")
    parser.add_argument(
        "--layout",
        choices=["schema_first", "state_first"],
        action="append",
        help="prompt layout (default: the family's)",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        help="data directory holding sst5 (default: $SLOTREAD_DATA, else the copy shipped in the package)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for model in args.model or ["qwen2.5-coder-1.5b-instruct"]:
        for dtype in args.dtype or ["bfloat16"]:
            decider = Decider(model, dtype=getattr(torch, dtype))
            texts = states(decider, args.data_dir, args.decisions)
            for layout in args.layout or [LAYOUTS[decider.engine.family]]:
                decider.renderer = Renderer(decider.renderer.tokenizer, decider.engine.family, layout)
                for count in (1, 3):
                    questions = dict(list(QUESTIONS.items())[:count])
                    for warm in (False, True):
                        result = measure(decider, questions, texts, warm)
                        rows.append((f"{model} {dtype}", layout, count, "warm" if warm else "cold", result))
    print(f"\n{torch.get_num_threads()} threads, {args.decisions} decisions per row, ~100-token states")
    header = f"{'model':<38} {'layout':<12} {'questions':>9} {'cache':>5} {'p50 ms':>7} {'p95 ms':>7}"
    print(f"{header} {'reads':>5} {'tokens':>6}")
    for model, layout, count, cache, r in rows:
        latency = f"{r['p50']:>7.0f} {r['p95']:>7.0f}"
        print(f"{model:<38} {layout:<12} {count:>9} {cache:>5} {latency} {r['reads']:>5.1f} {r['tokens']:>6.0f}")


if __name__ == "__main__":
    main()
