"""Single-token labels, verified against a tokenizer in the answer template's context.

Each option is read through one label token: choices use letters (A-Z) up to 26 options and
two-letter labels (AA, AB, ... skipping pairs that are not one token) beyond that, scores use the
digits 0-9, nouls Yes/No. A label is usable only if appending it to the reply prefix adds exactly one
token and leaves the prefix's tokens (and the text after the slot) as they were. Whether the space
before the label belongs to the label token (" A" in most BPE vocabularies) or to the prefix (Qwen
and Gemma split digits off the space) is decided per tokenizer and label kind.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from slotread.errors import ModelLoadError

MAX_CHOICE_OPTIONS = 255
MAX_SCORE_LEVELS = 10
LETTERS = tuple(string.ascii_uppercase)
PAIRS = tuple(a + b for a in string.ascii_uppercase for b in string.ascii_uppercase)
DIGITS = tuple(string.digits)
YES_NO = ("Yes", "No")


@dataclass(frozen=True)
class LabelSet:
    """Labels of one kind as shown in the prompt, their token ids, and the text before each label.

    ``lead`` is " " when the space before the label ends the reply prefix (so the label token has
    no space), "" when the label token carries its own leading space.
    """

    texts: tuple[str, ...]
    ids: tuple[int, ...]
    lead: str

    def take(self, n: int) -> LabelSet:
        """The first n labels."""
        return LabelSet(self.texts[:n], self.ids[:n], self.lead)


@dataclass(frozen=True)
class Alphabet:
    """Every label set one tokenizer offers."""

    letters: LabelSet
    pairs: LabelSet
    digits: LabelSet
    yes_no: LabelSet

    def choice(self, n: int) -> LabelSet:
        """Labels for an n-option choice: letters up to 26 options, two-letter labels beyond."""
        return self.letters.take(n) if n <= len(self.letters.texts) else self.pairs.take(n)

    def score(self, n: int) -> LabelSet:
        """Labels for an n-level score: 0..n-1."""
        return self.digits.take(n)


def _single_token_form(tokenizer: PreTrainedTokenizerBase, prefix: str, label: str, after: str) -> dict[str, int]:
    """For each lead ("" or " ") under which ``label`` is one token in context, that token's id.

    Lead "" appends " " + label to the prefix (the label token carries the space); lead " " appends
    the space to the prefix and then the bare label.
    """
    forms: dict[str, int] = {}
    after_ids = tokenizer.encode(after, add_special_tokens=False) if after else []
    for lead in ("", " "):
        head = tokenizer.encode(prefix + lead, add_special_tokens=False)
        text = prefix + lead + (label if lead else " " + label) + after
        whole = tokenizer.encode(text, add_special_tokens=False)
        one_more = len(whole) == len(head) + 1 + len(after_ids)
        in_context = whole[: len(head)] == head and whole[len(head) + 1 :] == after_ids
        if one_more and in_context and whole[len(head)] != tokenizer.unk_token_id:
            forms[lead] = whole[len(head)]
    return forms


def _label_set(tokenizer: PreTrainedTokenizerBase, prefix: str, after: str, candidates: tuple[str, ...]) -> LabelSet:
    """The candidates that are single tokens under the lead that admits the most of them."""
    found: dict[str, list[tuple[str, int]]] = {"": [], " ": []}
    for label in candidates:
        for lead, token in _single_token_form(tokenizer, prefix, label, after).items():
            found[lead].append((label, token))
    lead = max(found, key=lambda k: (len(found[k]), k == ""))
    pairs = found[lead]
    return LabelSet(tuple(p[0] for p in pairs), tuple(p[1] for p in pairs), lead)


def build_alphabet(tokenizer: PreTrainedTokenizerBase, prefix: str, after: str = "") -> Alphabet:
    """Find this tokenizer's labels in the template context ``prefix`` + label + ``after``.

    Raises ModelLoadError if the tokenizer cannot give 255 distinct choice labels, 10 digits or
    Yes/No as single tokens.
    """
    alphabet = Alphabet(
        letters=_label_set(tokenizer, prefix, after, LETTERS),
        pairs=_label_set(tokenizer, prefix, after, PAIRS),
        digits=_label_set(tokenizer, prefix, after, DIGITS),
        yes_no=_label_set(tokenizer, prefix, after, YES_NO),
    )
    model = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
    problems = []
    if len(alphabet.pairs.texts) < MAX_CHOICE_OPTIONS:
        problems.append(
            f"only {len(alphabet.pairs.texts)} two-letter labels are single tokens "
            f"(a {MAX_CHOICE_OPTIONS}-option choice needs {MAX_CHOICE_OPTIONS})"
        )
    if len(alphabet.letters.texts) < len(LETTERS):
        problems.append(f"only {len(alphabet.letters.texts)} of the letters A-Z are single tokens")
    if alphabet.digits.texts != DIGITS:
        problems.append(f"the digits 0-9 are not all single tokens (found {''.join(alphabet.digits.texts)})")
    if alphabet.yes_no.texts != YES_NO:
        problems.append("Yes/No are not both single tokens")
    for labels in (alphabet.letters, alphabet.pairs, alphabet.digits, alphabet.yes_no):
        if len(set(labels.ids)) != len(labels.ids):
            problems.append(f"labels {labels.texts[:3]}... map to repeated token ids")
    if problems:
        raise ModelLoadError(model, "its tokenizer cannot provide single-token labels: " + "; ".join(problems))
    return alphabet
