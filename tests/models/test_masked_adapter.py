"""Which checkpoints the masked engine reads, and each one's adapter, from configs and tokenizers."""

import pytest
from transformers import BertConfig, LlamaConfig, ModernBertConfig

from slotread.errors import ModelLoadError
from slotread.models.load import LoadedModel
from slotread.models.masked_adapter import is_masked, masked_adapter
from tests.engines.tiny_dream import TinyDreamConfig

REMOTE = {"AutoConfig": "modeling_x.XConfig", "AutoModel": "modeling_x.XModel"}


def test_masked_lm_architectures_read_the_tokenizers_mask(tiny_bert: LoadedModel) -> None:
    for config in (
        BertConfig(architectures=["BertForMaskedLM"]),
        ModernBertConfig(architectures=["ModernBertForMaskedLM"]),
    ):
        assert is_masked(config)
        adapter = masked_adapter("m", config, tiny_bert.tokenizer)
        assert (adapter.mask_id, adapter.read_offset, adapter.attention_mask) == (
            tiny_bert.tokenizer.mask_token_id,
            0,
            "2d",
        )


def test_remote_code_with_a_mask_id_reads_the_configs_mask(tiny_bert: LoadedModel) -> None:
    llada_style = LlamaConfig(architectures=["XModel"], auto_map=REMOTE)
    llada_style.mask_token_id = 126336
    assert is_masked(llada_style)
    adapter = masked_adapter("m", llada_style, tiny_bert.tokenizer)  # the config wins over the tokenizer's [MASK]
    assert (adapter.mask_id, adapter.read_offset, adapter.attention_mask) == (126336, 0, "2d")

    dream_style = TinyDreamConfig(mask_token_id=7, auto_map=REMOTE)
    assert is_masked(dream_style)
    adapter = masked_adapter("m", dream_style, tiny_bert.tokenizer)
    assert (adapter.mask_id, adapter.read_offset, adapter.attention_mask) == (7, -1, "4d")


def test_other_checkpoints_are_not_masked() -> None:
    assert not is_masked(LlamaConfig(architectures=["LlamaForCausalLM"]))
    assert not is_masked(LlamaConfig(architectures=["XModel"], auto_map=REMOTE))  # remote code, no mask id
    local = LlamaConfig(architectures=["LlamaForCausalLM"])
    local.mask_token_id = 5  # a mask id without remote code does not make a causal LM masked
    assert not is_masked(local)


def test_no_mask_anywhere_is_refused(smollm2: LoadedModel) -> None:
    with pytest.raises(ModelLoadError, match="names a mask token"):
        masked_adapter("m", BertConfig(architectures=["BertForMaskedLM"]), smollm2.tokenizer)
