"""Single-token labels, verified against a tokenizer in the answer template's context.

Each option is read through one label token: choices use letters (A-Z) up to 26 options and
two-letter labels (AA, AB, ... skipping pairs that are not one token) beyond that, scores use the
digits 0-9, nouls Yes/No. A label is usable only if appending it to the reply prefix adds exactly one
token and leaves the prefix's tokens (and the text after the slot) as they were. After a reply
prefix such as "Answer:", whether the space before the label belongs to the label token (" A" in
most BPE vocabularies) or to the prefix (Qwen and Gemma split digits off the space) is decided per
tokenizer and label kind; at the start of a reply the label is bare.
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
    """Labels of one kind as shown in the prompt, their token ids, and how they follow the reply prefix.

    ``lead`` is text appended to the reply prefix before the slot (" " when the tokenizer splits the
    space off, as Qwen and Gemma do before digits); ``spaced`` says whether the label token itself
    starts with a space (" A" after "Answer:"; not after a newline, where the label is bare).
    """

    texts: tuple[str, ...]
    ids: tuple[int, ...]
    lead: str
    spaced: bool

    def take(self, n: int) -> LabelSet:
        """The first n labels."""
        return LabelSet(self.texts[:n], self.ids[:n], self.lead, self.spaced)


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


Form = tuple[str, bool]  # (lead, spaced), as in LabelSet


def _forms(prefix: str) -> tuple[Form, ...]:
    """The ways a label may follow ``prefix``, most natural first.

    After whitespace (or at the very start of the reply) the label is bare; after other text it
    carries a space, either inside its token (" A") or split off into the prefix (" " then "3").
    """
    if not prefix or prefix[-1].isspace():
        return (("", False),)
    return (("", True), (" ", False))


def _single_token_forms(tokenizer: PreTrainedTokenizerBase, prefix: str, label: str, after: str) -> dict[Form, int]:
    """For each form under which ``label`` is one token in context, that token's id."""
    found: dict[Form, int] = {}
    after_ids = tokenizer.encode(after, add_special_tokens=False) if after else []
    for lead, spaced in _forms(prefix):
        head = tokenizer.encode(prefix + lead, add_special_tokens=False)
        whole = tokenizer.encode(prefix + lead + (" " if spaced else "") + label + after, add_special_tokens=False)
        one_more = len(whole) == len(head) + 1 + len(after_ids)
        in_context = whole[: len(head)] == head and whole[len(head) + 1 :] == after_ids
        if one_more and in_context and whole[len(head)] != tokenizer.unk_token_id:
            found[(lead, spaced)] = whole[len(head)]
    return found


def _label_set(tokenizer: PreTrainedTokenizerBase, prefix: str, after: str, candidates: tuple[str, ...]) -> LabelSet:
    """The candidates that are single tokens under the form that admits the most of them."""
    forms = _forms(prefix)
    found: dict[Form, list[tuple[str, int]]] = {form: [] for form in forms}
    for label in candidates:
        for form, token in _single_token_forms(tokenizer, prefix, label, after).items():
            found[form].append((label, token))
    best = max(forms, key=lambda form: (len(found[form]), -forms.index(form)))
    return LabelSet(tuple(p[0] for p in found[best]), tuple(p[1] for p in found[best]), *best)


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
