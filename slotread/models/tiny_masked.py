"""Tiny random-weight masked LMs (BERT, ModernBERT) for tests and ``slotread models tiny``.

The architectures are transformers' own, shrunk (ModernBERT keeps its mix of global and local
attention layers, with a local window of 8 tokens so short prompts already go past it). The weights
are random: they test plumbing and maths, never answers.

No BERT vocabulary installs here, so the tokenizer is SmolLM2's byte-level BPE (the registry's
smallest model; ModernBERT's own tokenizer is a byte-level BPE of the same kind) made into a masked-LM
tokenizer the way real ones are: [CLS], [SEP], [MASK] and [PAD] as special tokens, [CLS] ... [SEP]
around every sequence through the post-processor, and no chat template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import Tokenizer, processors
from transformers import (
    AutoModelForMaskedLM,
    BertConfig,
    ModernBertConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from slotread.models.load import load_tokenizer

Architecture = Literal["bert", "modernbert"]
#: The registry model whose tokenizer the tiny masked LMs use.
TOKENIZER_SOURCE = "smollm2-135m-instruct"

_SHAPE: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    # far beyond BERT's real 512, so a 255-option question fits
    "max_position_embeddings": 4096,
    # larger than the library's 0.02 so random logits spread over a few units
    "initializer_range": 0.2,
}


def masked_lm_tokenizer(base: PreTrainedTokenizerBase) -> PreTrainedTokenizerFast:
    """``base``'s vocabulary with BERT's special tokens added (new ids at the end) and no chat template."""
    backend = Tokenizer.from_str(base.backend_tokenizer.to_str())
    backend.add_special_tokens(["[CLS]", "[SEP]", "[MASK]", "[PAD]"])
    cls, sep = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        pad_token="[PAD]",
        unk_token=base.unk_token,
        clean_up_tokenization_spaces=False,
    )


def tiny_masked_lm_config(architecture: Architecture, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The tiny config of ``architecture`` over ``tokenizer``'s vocabulary and special tokens."""
    vocab = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id}
    if architecture == "bert":
        return BertConfig(**_SHAPE, **vocab, num_hidden_layers=2)
    return ModernBertConfig(
        **_SHAPE,
        **vocab,
        # layer 0 global, layers 1-2 local (ModernBERT's global_attn_every_n_layers=3 pattern)
        num_hidden_layers=3,
        local_attention=8,
        cls_token_id=tokenizer.cls_token_id,
        sep_token_id=tokenizer.sep_token_id,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
    )


def tiny_masked_lm(
    architecture: Architecture, tokenizer: PreTrainedTokenizerBase, seed: int = 0, dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """A tiny masked LM with random weights drawn from ``seed``, in eval mode, on the CPU.

    The global torch RNG is left as it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForMaskedLM.from_config(tiny_masked_lm_config(architecture, tokenizer), dtype=dtype)
    return model.eval()


def write_tiny_masked_lm(
    architecture: Architecture, out_dir: Path, *, cache_dir: Path | None = None, seed: int = 0
) -> Path:
    """Write config, float32 safetensors and the masked-LM tokenizer into ``out_dir``; returns it.

    The first call fetches and converts SmolLM2 (94 MB) into ``cache_dir`` for its tokenizer.
    """
    tokenizer = masked_lm_tokenizer(load_tokenizer(TOKENIZER_SOURCE, cache_dir=cache_dir).tokenizer)
    tiny_masked_lm(architecture, tokenizer, seed=seed).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
