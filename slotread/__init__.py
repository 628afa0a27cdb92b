"""slotread: typed answers with probabilities, read from a language model's answer slots in one pass.

from slotread import Decider
decider = Decider(model="qwen2.5-coder-1.5b-instruct")
decider.decide({"state": "...", "questions": {"urgent": {"type": "noul"}}})
"""

from typing import TYPE_CHECKING, Any

from slotread.errors import InvalidRequest, ModelLoadError, PromptTooLong, SlotreadError, UnknownModel

if TYPE_CHECKING:
    from slotread.decider import Decider

__all__ = ["Decider", "InvalidRequest", "ModelLoadError", "PromptTooLong", "SlotreadError", "UnknownModel"]


def __getattr__(name: str) -> Any:
    # Decider pulls in torch and transformers; importing slotread.core or slotread.api alone should not.
    if name == "Decider":
        from slotread.decider import Decider

        return Decider
    raise AttributeError(f"module 'slotread' has no attribute {name!r}")
