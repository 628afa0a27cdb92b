"""Which checkpoints the masked engine reads, and the ``MaskedAdapter`` each needs, from its config.

* A transformers ``*ForMaskedLM`` architecture (BERT family, ModernBERT): the mask is the tokenizer's
  mask token, and each slot is read at its own position.
* A remote-code checkpoint (``auto_map`` in its config; loaded from local directories only) whose
  config names a ``mask_token_id``: a masked-diffusion LM such as LLaDA or Dream; the mask is that id.
* Dream (model type "Dream") was trained from a causal model (Qwen2.5) and kept its shift: the logits
  at position p - 1 predict the token at p, so it reads with offset -1; its remote code hands the
  attention mask to ``scaled_dot_product_attention`` as it is, so it gets a boolean 4D mask.
"""

from __future__ import annotations

from transformers import PretrainedConfig, PreTrainedTokenizerBase

from slotread.engines.masked import MaskedAdapter
from slotread.errors import ModelLoadError

#: Model types (lower-cased) of checkpoints that read slot p at p - 1 and take a 4D attention mask.
SHIFTED_MODEL_TYPES = frozenset({"dream"})


def has_remote_code(config: PretrainedConfig) -> bool:
    """Whether the checkpoint brings its own modeling code (its config has an ``auto_map``)."""
    return bool(getattr(config, "auto_map", None))


def is_masked(config: PretrainedConfig) -> bool:
    """Whether the masked engine reads this checkpoint (see the module docstring)."""
    architectures = getattr(config, "architectures", None) or []
    if any(architecture.endswith("ForMaskedLM") for architecture in architectures):
        return True
    return has_remote_code(config) and getattr(config, "mask_token_id", None) is not None


def masked_adapter(name: str, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> MaskedAdapter:
    """The adapter for a masked checkpoint; ModelLoadError names ``name`` when no mask id is known."""
    mask_id = getattr(config, "mask_token_id", None) if has_remote_code(config) else None
    if mask_id is None:
        mask_id = tokenizer.mask_token_id
    if mask_id is None:
        raise ModelLoadError(name, "neither its config (mask_token_id) nor its tokenizer names a mask token")
    if config.model_type.lower() in SHIFTED_MODEL_TYPES:
        return MaskedAdapter(int(mask_id), read_offset=-1, attention_mask="4d")
    return MaskedAdapter(int(mask_id))
