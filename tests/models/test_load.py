"""Loading by registry name, directory or .gguf file, and every way loading can fail."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from slotread.errors import ModelLoadError
from slotread.models.convert import MARKER
from slotread.models.load import LoadedModel, list_models, load_model, load_tokenizer
from slotread.models.registry import REGISTRY
from slotread.models.tiny import GEMMA4_VOCAB_SIZE

SMOLLM2 = "smollm2-135m-instruct"


def test_an_unknown_name_lists_the_registry(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as caught:
        load_model("no-such-model", cache_dir=tmp_path)
    assert caught.value.model == "no-such-model"
    for name in REGISTRY:
        assert name in caught.value.reason


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\x00" * 8)
    with pytest.raises(ModelLoadError, match=r"not a checkpoint directory or a \.gguf file"):
        load_model(str(weights), cache_dir=tmp_path)


def test_a_directory_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no readable config\.json"):
        load_model(str(tmp_path), cache_dir=tmp_path)


def test_a_directory_without_tokenizer_is_refused(tmp_path: Path, tiny_diffusion_dir: Path) -> None:
    shutil.copy(tiny_diffusion_dir / "config.json", tmp_path)
    with pytest.raises(ModelLoadError, match=r"has no tokenizer \(none of tokenizer\.json"):
        load_model(str(tmp_path), cache_dir=tmp_path)


def test_a_tokenizer_without_chat_template_is_refused(tmp_path: Path, tiny_diffusion_dir: Path) -> None:
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_diffusion_dir / name, tmp_path)
    with pytest.raises(ModelLoadError, match="has no chat template"):
        load_model(str(tmp_path), cache_dir=tmp_path)


def test_truncated_weights_are_refused(tmp_path: Path, tiny_diffusion_dir: Path) -> None:
    checkpoint = tmp_path / "broken"
    shutil.copytree(tiny_diffusion_dir, checkpoint)
    with (checkpoint / "model.safetensors").open("r+b") as file:
        file.truncate(1 << 20)
    with pytest.raises(ModelLoadError, match="cannot load the weights") as caught:
        load_model(str(checkpoint), cache_dir=tmp_path)
    assert caught.value.model == str(checkpoint)
    assert caught.value.__cause__ is not None


@pytest.mark.slow
def test_a_registry_model_is_fetched_converted_and_loaded(smollm2: LoadedModel, cache_dir: Path) -> None:
    assert smollm2.name == SMOLLM2
    assert smollm2.family == "causal"
    assert not smollm2.model.training
    assert not any(parameter.requires_grad for parameter in smollm2.model.parameters())
    checkpoint = cache_dir / "models" / SMOLLM2
    assert sorted(path.name for path in checkpoint.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "slotread.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    tokenizer = smollm2.tokenizer
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )


@pytest.mark.slow
def test_the_converted_weights_still_know_things(smollm2: LoadedModel) -> None:
    tokenizer = smollm2.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer.encode(prompt + "The capital of France is", add_special_tokens=False)])
    with torch.no_grad():
        logits = smollm2.model(ids).logits[0, -1]
    assert tokenizer.decode(logits.argmax()) == " Paris"


@pytest.mark.slow
def test_a_second_load_uses_the_converted_checkpoint(smollm2: LoadedModel, cache_dir: Path) -> None:
    marker = cache_dir / "models" / SMOLLM2 / MARKER
    before = marker.stat().st_mtime_ns
    again = load_model(SMOLLM2, cache_dir=cache_dir)
    assert marker.stat().st_mtime_ns == before
    first, second = next(smollm2.model.parameters()), next(again.model.parameters())
    assert torch.equal(first, second)


@pytest.mark.slow
def test_a_local_gguf_is_converted_once_replacing_a_stale_conversion(
    smollm2: LoadedModel, cache_dir: Path, tmp_path: Path
) -> None:
    gguf = cache_dir / "files" / REGISTRY[SMOLLM2].gguf.filename
    stale = tmp_path / "models" / f"{gguf.stem}-{REGISTRY[SMOLLM2].gguf.sha256[:12]}"
    stale.mkdir(parents=True)
    (stale / MARKER).write_text('{"source_sha256": "an older file"}')
    loaded = load_model(str(gguf), cache_dir=tmp_path)
    assert loaded.name == str(gguf)
    assert loaded.family == "causal"
    assert (stale / "model.safetensors").exists()
    assert REGISTRY[SMOLLM2].gguf.sha256 in (stale / MARKER).read_text()
    assert torch.equal(next(loaded.model.parameters()), next(smollm2.model.parameters()))


@pytest.mark.slow
def test_a_bfloat16_load_stores_bfloat16_weights_readable_by_all(smollm2: LoadedModel, cache_dir: Path) -> None:
    loaded = load_model(SMOLLM2, cache_dir=cache_dir, dtype=torch.bfloat16)
    directory = cache_dir / "models" / f"{SMOLLM2}-bfloat16"
    with safe_open(directory / "model.safetensors", "pt") as weights:
        assert {weights.get_slice(name).get_dtype() for name in weights.keys()} == {"BF16"}  # noqa: SIM118
    float32 = cache_dir / "models" / SMOLLM2 / "model.safetensors"
    assert (directory / "model.safetensors").stat().st_size < 0.51 * float32.stat().st_size
    assert {oct(path.stat().st_mode & 0o777) for path in directory.iterdir()} == {"0o644"}
    # the float32 weights rounded to bfloat16, bit for bit, as loading the float32 copy in bfloat16 gave
    for (name, ours), theirs in zip(loaded.model.named_parameters(), smollm2.model.parameters(), strict=True):
        assert torch.equal(ours, theirs.to(torch.bfloat16)), name
    assert {listing.name: listing.path for listing in list_models(cache_dir)}[SMOLLM2] == directory


@pytest.mark.slow
def test_list_models_shows_what_is_cached(smollm2: LoadedModel, cache_dir: Path, tmp_path: Path) -> None:
    listings = {listing.name: listing for listing in list_models(cache_dir)}
    assert list(listings) == list(REGISTRY)
    assert listings[SMOLLM2].cached
    assert listings[SMOLLM2].path in (cache_dir / "models" / SMOLLM2, cache_dir / "models" / f"{SMOLLM2}-bfloat16")
    assert not any(listing.cached for listing in list_models(tmp_path))


def test_masked_checkpoints_load_in_the_masked_family(tiny_bert: LoadedModel, tiny_dream: LoadedModel) -> None:
    assert tiny_bert.family == "masked"  # without a chat template: masked prompts fall back to plain text
    assert not getattr(tiny_bert.tokenizer, "chat_template", None)
    # The Dream-style checkpoint runs the modeling code in its own directory, registered under AutoModel.
    assert tiny_dream.family == "masked"
    assert type(tiny_dream.model).__name__ == "TinyDreamModel"
    assert type(tiny_dream.model).__module__.startswith("transformers_modules.")
    assert not any(parameter.requires_grad for parameter in tiny_dream.model.parameters())


def test_a_config_without_auto_map_runs_no_directory_code(tmp_path: Path, tiny_dream_dir: Path) -> None:
    checkpoint = tmp_path / "no-auto-map"
    shutil.copytree(tiny_dream_dir, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    del config["auto_map"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"no readable config\.json"):
        load_model(str(checkpoint), cache_dir=tmp_path)


def test_load_tokenizer_needs_no_weights(tmp_path: Path, tiny_diffusion_dir: Path) -> None:
    for path in tiny_diffusion_dir.iterdir():
        if path.name != "model.safetensors":
            shutil.copy(path, tmp_path)
    loaded = load_tokenizer(str(tmp_path), cache_dir=tmp_path)
    assert (loaded.name, loaded.family, loaded.vocab_size) == (str(tmp_path), "diffusion", GEMMA4_VOCAB_SIZE)
    assert loaded.tokenizer.chat_template


@pytest.mark.slow
def test_load_tokenizer_builds_from_a_gguf_the_tokenizer_a_conversion_saves(
    smollm2: LoadedModel, cache_dir: Path, tmp_path: Path
) -> None:
    gguf = cache_dir / "files" / REGISTRY[SMOLLM2].gguf.filename
    built = load_tokenizer(str(gguf), cache_dir=tmp_path)
    assert (built.family, built.vocab_size) == ("causal", len(smollm2.tokenizer))
    assert not (tmp_path / "models").exists()  # nothing converted
    messages = [{"role": "user", "content": "Is the card lost?  Ünïcödé\n\nA) yes B) no"}]
    text = smollm2.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert built.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    assert built.tokenizer.encode(text) == smollm2.tokenizer.encode(text)
    assert load_tokenizer(SMOLLM2, cache_dir=cache_dir).tokenizer.encode(text) == smollm2.tokenizer.encode(text)
