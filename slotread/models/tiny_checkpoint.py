"""Write a tiny random-weight DiffusionGemma checkpoint that ``load_model`` loads like a real one.

The model comes from ``slotread.models.tiny`` (the real architecture, shrunk; the tied 262,144-row
embedding makes it about 35 MB); the tokenizer is the real Gemma-4 one from ``gemma_tokenizer``,
with the Gemma-4 chat template. There are no real diffusion-LM weights here, so this is how the
DiffusionGemma path is exercised end to end.
"""

from __future__ import annotations

from pathlib import Path

from slotread.models.gemma_tokenizer import gemma_tokenizer
from slotread.models.tiny import tiny_diffusion_gemma


def write_tiny_diffusion_gemma(out_dir: Path, *, cache_dir: Path | None = None, seed: int = 0) -> Path:
    """Write config, float32 safetensors and the Gemma-4 tokenizer into ``out_dir``; returns it.

    ``seed`` draws the weights; ``cache_dir`` is where the tokenizer is built and cached (the
    first call downloads its 56 MB source). Files already in ``out_dir`` are overwritten.
    """
    tokenizer = gemma_tokenizer("gemma4", cache_dir=cache_dir)
    model = tiny_diffusion_gemma(vocab_size=len(tokenizer), seed=seed)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
