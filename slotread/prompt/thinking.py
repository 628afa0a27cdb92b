"""Where a thought goes in a read, per family: the prompt that opens it, and the read with it in place.

DiffusionGemma has a thought channel: a plain read's prompt ends with the empty block
``<|channel>thought\\n<channel|>``. Thinking opens the channel instead (the prompt ends at
``<|channel>thought\\n``), the model writes into it (``engines.diffusion_gemma.thought``), and the read's
prompt is the opened channel, the thought and ``<channel|>``; the canvas is unchanged.

A causal chat model without a thinking mode in its template (Qwen2.5, SmolLM2) is asked to reason in
its reply: the reply opens with ``CAUSAL_OPENER``, the model continues it greedily, and the slot is read
after the thought and the fixed answer cue ``ANSWER_CUE``, so the canvas becomes
opener + thought + cue + the plain canvas. The prompt is the plain read's, so a thinking read shares
its prefix KV with plain reads of the same state. The cue ends on a new line, where a label starts a
line as it starts a reply (the same single token; ``tests/prompt/test_thought_format.py`` checks it on the
real tokenizers).

Masked models have no way to write a thought: ``ThoughtFormat`` refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from transformers import PreTrainedTokenizerBase

from slotread.engines.base import Family, Slot
from slotread.prompt.render import THOUGHT_BLOCK, TURN_END, Rendered

#: What a causal reply opens with when the model is to think first.
CAUSAL_OPENER = "Let me think it through step by step.\n"
#: What follows a causal thought, before the slot.
ANSWER_CUE = "\n\nAnswer:\n"
#: The token that closes DiffusionGemma's thought channel.
CHANNEL_CLOSE = "<channel|>"
_REPLY_MARK = "SLOTREAD-REPLY"

Segments = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class ThoughtFormat:
    """One tokenizer's way of placing a thought: ``opener`` and ``closer`` ids around it (DiffusionGemma: the
    channel's close only; causal: the reply opener and the answer cue), and the ids that end a thought."""

    family: Family
    opener: tuple[int, ...]
    closer: tuple[int, ...]
    stop_ids: frozenset[int]

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, family: Family) -> ThoughtFormat:
        """The format for ``tokenizer``; ValueError for a family that cannot think (masked)."""

        def ids(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        if family == "diffusion":
            close = ids(CHANNEL_CLOSE)
            if len(close) != 1 or ids(THOUGHT_BLOCK)[-1:] != close:
                raise ValueError("the tokenizer has no single <channel|> token closing DiffusionGemma's thought block")
            return cls(family, (), close, frozenset({*close, *ids(TURN_END)[:1], *eos}))
        if family == "causal":
            return cls(family, ids(CAUSAL_OPENER), ids(ANSWER_CUE), frozenset({*_turn_end(tokenizer), *eos}))
        raise ValueError(f"a {family} model reads in one forward and writes no thought")

    def thought_prompt(self, rendered: Rendered) -> Segments:
        """The prompt a thought is generated after (segments; a causal opener is its own last segment)."""
        if self.family == "diffusion":
            return (*rendered.prompt[:-1], self._opened(rendered))
        return (*rendered.prompt, self.opener)

    def with_thought(self, rendered: Rendered, thought: tuple[int, ...]) -> Rendered:
        """The read of ``rendered`` after ``thought`` (the generated ids, without their stop id)."""
        if self.family == "diffusion":
            prompt = (*rendered.prompt[:-1], self._opened(rendered), (*thought, *self.closer))
            return replace(rendered, prompt=prompt)
        lead = (*self.opener, *thought, *self.closer)
        slots = tuple(Slot(slot.position + len(lead), slot.label_ids) for slot in rendered.slots)
        return Rendered(rendered.prompt, (*lead, *rendered.canvas), slots)

    def _opened(self, rendered: Rendered) -> tuple[int, ...]:
        """The last prompt segment with its thought channel open (the empty block's close cut off)."""
        last = rendered.prompt[-1]
        if last[-len(self.closer) :] != self.closer:
            raise ValueError("the prompt does not end with DiffusionGemma's empty thought block")
        return last[: -len(self.closer)]


def _turn_end(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The first token the chat template puts after an assistant reply (its end of turn), if special."""
    messages = [{"role": "user", "content": "Question?"}, {"role": "assistant", "content": _REPLY_MARK}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert isinstance(text, str)
    if _REPLY_MARK not in text:
        return set()
    end = tokenizer.encode(text[text.rindex(_REPLY_MARK) + len(_REPLY_MARK) :].strip(), add_special_tokens=False)
    return {end[0]} if end and end[0] in tokenizer.all_special_ids else set()
