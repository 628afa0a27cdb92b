"""The tiny masked LMs load like real ones, with a masked-LM tokenizer built on SmolLM2's vocabulary."""

from pathlib import Path

from safetensors.torch import load_file
from transformers import BertForMaskedLM, ModernBertForMaskedLM

from slotread.models.load import LoadedModel
from slotread.models.tiny_masked import write_tiny_masked_lm


def test_the_checkpoints_load_as_masked_lms(tiny_bert: LoadedModel, tiny_modernbert: LoadedModel) -> None:
    assert isinstance(tiny_bert.model, BertForMaskedLM)
    assert isinstance(tiny_modernbert.model, ModernBertForMaskedLM)
    config = tiny_modernbert.model.config
    assert {"full_attention", "sliding_attention"} <= set(config.layer_types) and config.local_attention == 8
    for loaded in (tiny_bert, tiny_modernbert):
        assert loaded.family == "masked" and not loaded.model.training
        assert loaded.model.config.vocab_size == len(loaded.tokenizer) == 49_152 + 4


def test_the_tokenizer_wraps_sequences_in_cls_and_sep(tiny_bert: LoadedModel) -> None:
    tokenizer = tiny_bert.tokenizer
    assert not getattr(tokenizer, "chat_template", None)
    bare = tokenizer.encode("Answer: Yes", add_special_tokens=False)
    assert tokenizer.encode("Answer: Yes") == [tokenizer.cls_token_id, *bare, tokenizer.sep_token_id]
    assert tokenizer.convert_ids_to_tokens(bare) == ["Answer", ":", "ĠYes"]  # SmolLM2's own BPE
    assert tokenizer.mask_token == "[MASK]" and tokenizer.pad_token == "[PAD]"
    assert tokenizer.encode("[MASK]", add_special_tokens=False) == [tokenizer.mask_token_id]


def test_the_seed_draws_the_weights(tiny_bert_dir: Path, tmp_path: Path, cache_dir: Path) -> None:
    other = write_tiny_masked_lm("bert", tmp_path / "seed1", cache_dir=cache_dir, seed=1)
    weights, other_weights = load_file(tiny_bert_dir / "model.safetensors"), load_file(other / "model.safetensors")
    assert weights.keys() == other_weights.keys()
    assert any(not weights[key].equal(other_weights[key]) for key in weights if weights[key].dtype.is_floating_point)
    assert (tiny_bert_dir / "model.safetensors").stat().st_size < 16 * 2**20
