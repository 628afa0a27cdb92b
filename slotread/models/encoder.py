"""A sentence encoder beside the language model: texts in, unit-length embeddings out.

all-MiniLM-L6-v2 (``registry.ENCODERS``) is sentence-transformers' pipeline Transformer → mean
pooling → L2 normalisation; here it is the same computation with transformers alone:

    e = normalise( Σ_t m_t · h_t / Σ_t m_t )     h_t the last hidden state of token t, m the attention mask

Texts are tokenised with the model's WordPiece tokenizer and cut at ``max_tokens`` (256, as
sentence-transformers cuts them: an embedding reads a long text's beginning). Batches are formed from
texts of similar length (less padding; padding never changes an embedding, the mask excludes it), and
every embedding is cached by its text (bounded, least recently used dropped first), so a bank, a
question's options and repeated states are embedded once.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from slotread.errors import ModelLoadError
from slotread.models.registry import DEFAULT_ENCODER, ENCODERS

logger = logging.getLogger(__name__)

#: Texts per forward.
BATCH_SIZE = 64
#: Embeddings kept in the per-text cache (384 floats each: 100,000 are about 150 MB).
CACHE_SIZE = 100_000


class SentenceEncoder:
    """An encoder loaded from a folder of its files (see the module docstring)."""

    def __init__(self, directory: Path, *, name: str, max_tokens: int, device: str = "cpu") -> None:
        from transformers import AutoModel, AutoTokenizer

        self.name = name
        self.max_tokens = max_tokens
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self.model = AutoModel.from_pretrained(directory, dtype=torch.float32).to(self.device).eval()
        self.dimension = int(self.model.config.hidden_size)
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-length embeddings (N, d) float32 of ``texts``, from the cache where it holds them."""
        with self._lock:
            found = {text: self._cache[text] for text in texts if text in self._cache}
            for text in found:
                self._cache.move_to_end(text)
        missing = sorted({text for text in texts if text not in found}, key=len)
        for start in range(0, len(missing), BATCH_SIZE):
            chunk = missing[start : start + BATCH_SIZE]
            for text, vector in zip(chunk, self._forward(chunk), strict=True):
                found[text] = vector
        with self._lock:
            for text in missing:
                self._cache[text] = found[text]
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        return np.stack([found[text] for text in texts])

    def _forward(self, texts: list[str]) -> np.ndarray:
        batch = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt"
        ).to(self.device)
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state.float()  # (B, T, d)
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).cpu().numpy()


@lru_cache(maxsize=4)
def load_encoder(name: str = DEFAULT_ENCODER, cache_dir: Path | None = None, device: str = "cpu") -> SentenceEncoder:
    """The registry encoder ``name``, fetched into ``cache_dir`` (default: ``fetch.default_cache_dir``) if
    needed and loaded once per (name, cache, device). ModelLoadError names the encoders known."""
    from slotread.models.fetch import default_cache_dir, fetch_encoder

    if name not in ENCODERS:
        raise ModelLoadError(name, f"no such sentence encoder; the registry has {', '.join(ENCODERS)}")
    model = ENCODERS[name]
    directory = fetch_encoder(model, cache_dir if cache_dir is not None else default_cache_dir())
    logger.info("sentence encoder %s from %s on %s", name, directory, device)
    return SentenceEncoder(directory, name=name, max_tokens=model.max_tokens, device=device)
