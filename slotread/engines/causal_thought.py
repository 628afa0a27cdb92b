"""Greedy thoughts for causal LMs: up to N next-token argmaxes after a prompt, with a KV cache.

It is ``generate(do_sample=False)`` written out (tests compare the two): one forward over the prompt,
then one token at a time, each step feeding the last token with the cache. It stops at a stop id
(not kept) or after ``max_tokens``.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


def greedy_thought(model: PreTrainedModel, prompt: tuple[int, ...], max_tokens: int, stop_ids: frozenset[int]) -> tuple[int, ...]:
    """The thought ``model`` writes greedily after ``prompt``: at most ``max_tokens`` ids, without the stop id."""
    device = model.device
    cache = DynamicCache(config=model.config)
    fed = torch.tensor([prompt], device=device)
    position = 0
    thought: list[int] = []
    with torch.inference_mode():
        while len(thought) < max_tokens:
            positions = torch.arange(position, position + fed.shape[1], device=device)[None, :]
            out = model(input_ids=fed, past_key_values=cache, position_ids=positions, use_cache=True)
            cache = out.past_key_values
            position += fed.shape[1]
            token = int(out.logits[0, -1].argmax())
            if token in stop_ids:
                break
            thought.append(token)
            fed = torch.tensor([[token]], device=device)
    return tuple(thought)
