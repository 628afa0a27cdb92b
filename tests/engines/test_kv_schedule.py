"""Which boundary a read call defers its prompts from: merging the parents of isolated questions."""

from __future__ import annotations

import torch

from slotread.engines.base import ReadRequest, Slot
from slotread.engines.diffusion_gemma import kv_schedule
from slotread.engines.prefix_cache import PrefixCache, PrefixKV


def entry(tokens: int) -> PrefixKV:
    return PrefixKV(keys=(torch.zeros(1, 2, tokens, 4),), values=(torch.zeros(1, 2, tokens, 4),))


def isolated_call(questions: list[int], states: int) -> tuple[list[ReadRequest], PrefixCache, tuple[int, ...]]:
    """``states`` decisions, each asking questions of the given lengths after a 50-token instructions
    segment: every (instructions, question) prefix cached, the 10-token states new."""
    instructions = tuple(range(50))
    cache = PrefixCache(max_bytes=2**30)
    cache.put(instructions, entry(50))
    requests = []
    for k, length in enumerate(questions):
        question = tuple(range(1000 * (k + 1), 1000 * (k + 1) + length))
        cache.put(instructions + question, entry(50 + length))
        for s in range(states):
            state = tuple(range(100_000 + 10 * s, 100_000 + 10 * s + 10))
            requests.append(ReadRequest((instructions, question, state), (1, 2), (Slot(0, (1, 2)),)))
    return requests, cache, instructions


def schedule(requests: list[ReadRequest], cache: PrefixCache, forward_tokens: int) -> tuple[dict, dict]:
    found, todo = kv_schedule.resume(requests, cache)
    deferred = kv_schedule.deferrable(requests, found, todo, max_canvases=32)
    return found, kv_schedule.merged_parents(requests, deferred, found, cache, forward_tokens)


def test_isolated_questions_continue_their_shared_instructions_when_it_saves_forwards() -> None:
    requests, cache, instructions = isolated_call([20, 30, 40], states=1)
    found, merged = schedule(requests, cache, forward_tokens=512)
    # 90 question tokens re-encoded, against two forwards saved (1,024 tokens' worth)
    assert set(merged.values()) == {len(instructions)}
    for request in requests:
        ids = request.prompt_ids
        assert found[ids][len(instructions)] is cache.get(instructions)  # the parent every prompt now reads


def test_parents_stay_apart_when_re_encoding_costs_more_than_the_forwards_saved() -> None:
    requests, cache, instructions = isolated_call([20, 30, 40], states=12)  # 12 x 90 tokens > 1,024
    found, merged = schedule(requests, cache, forward_tokens=512)
    assert all(merged[r.prompt_ids] == len(r.prompt[0]) + len(r.prompt[1]) for r in requests)
    assert all(len(instructions) not in found[r.prompt_ids] for r in requests)


def test_prompts_of_one_parent_are_left_as_they_are() -> None:
    requests, cache, _ = isolated_call([30], states=3)
    _, merged = schedule(requests, cache, forward_tokens=10_000)
    assert set(merged.values()) == {80}
