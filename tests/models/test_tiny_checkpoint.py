"""The tiny DiffusionGemma checkpoint loads like a real one, with the real Gemma-4 tokenizer."""

from pathlib import Path

from safetensors.torch import load_file
from transformers import DiffusionGemmaForBlockDiffusion

from slotread.models.load import LoadedModel
from slotread.models.tiny_checkpoint import write_tiny_diffusion_gemma


def test_the_checkpoint_loads_as_a_diffusion_model(tiny_diffusion: LoadedModel, tiny_diffusion_dir: Path) -> None:
    assert tiny_diffusion.family == "diffusion"
    assert tiny_diffusion.name == str(tiny_diffusion_dir)
    assert isinstance(tiny_diffusion.model, DiffusionGemmaForBlockDiffusion)
    assert not tiny_diffusion.model.training
    assert tiny_diffusion.model.config.text_config.vocab_size == len(tiny_diffusion.tokenizer) == 262_144


def test_the_checkpoint_carries_the_gemma4_tokenizer_and_template(tiny_diffusion: LoadedModel) -> None:
    tokenizer = tiny_diffusion.tokenizer
    assert tokenizer.encode("<|turn>user\nhello<turn|>\n", add_special_tokens=False) == [
        105,
        2364,
        107,
        23391,
        106,
        107,
    ]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<bos><|turn>user\nhello<turn|>\n<|turn>model\n"


def test_the_checkpoint_is_small(tiny_diffusion_dir: Path) -> None:
    # the tied 262,144 x 32 float32 embedding is 32 MiB of it
    assert (tiny_diffusion_dir / "model.safetensors").stat().st_size < 40 * 2**20


def test_the_seed_draws_the_weights(tiny_diffusion_dir: Path, tmp_path: Path, cache_dir: Path) -> None:
    other = write_tiny_diffusion_gemma(tmp_path / "seed1", cache_dir=cache_dir, seed=1)
    weights, other_weights = load_file(tiny_diffusion_dir / "model.safetensors"), load_file(other / "model.safetensors")
    assert weights.keys() == other_weights.keys()
    assert any(not weights[key].equal(other_weights[key]) for key in weights if weights[key].dtype.is_floating_point)
