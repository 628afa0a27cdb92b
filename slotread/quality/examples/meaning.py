"""Shortlists from meaning: the options nearest the state in a sentence encoder's space, no labels needed.

A choice with many options (BANKING77's 77 intents) is read badly all at once by a small model; a
shortlist of the options that matter reads far better, but ``x_shortlist`` from a bank needs labelled
examples. Here the shortlist comes from the question alone: each option is embedded as its text
(``option_text``: name, then its description), the state likewise, and their cosine similarities
s_i rank the options. The top k (in the question's own option order, so the listing carries no
ranking in as a position prior) are read by the language model; the answer still gives every
option a probability, from the encoder's own distribution over the options

    q = softmax(s / τ)

an option left out keeps its own q_i, and the shortlist shares Q_S = Σ_{j∈S} q_j as the logarithmic
opinion pool of the model's read and the encoder, with equal weights:

    p(i) = Q_S · √(p_read(i) · q_i) / Σ_{j∈S} √(p_read(j) · q_j)    (i ∈ S)

So the unread mass is the encoder's belief that the answer lies outside the list, per state (a
state that points clearly at a few options leaves little outside), never zero; and neither the
model's read (overconfident on a 10-option list: ECE 0.18 on BANKING77 read alone) nor the
encoder decides the list alone. No weight is fitted: equal weights need no labels. τ is a constant,
fitted once by maximum likelihood of q on the train splits of BANKING77 and CLINC150 (no test item;
``SIMILARITY_TEMPERATURE``), never on the user's task: this works with no labels at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from slotread.core.aggregate import softmax
from slotread.core.questions import Question

#: Texts in, unit-length embeddings (N, d) out (``models.encoder.SentenceEncoder.embed``).
Embed = Callable[[Sequence[str]], np.ndarray]

#: τ of q = softmax(s / τ). all-MiniLM-L6-v2, state vs option name, NLL of the gold option on the train
#: splits: BANKING77 (10,003 messages) 1.506 at τ = 0.05 (0.03: 1.926, 0.08: 1.556); CLINC150
#: (15,100) 1.247 at 0.05 (0.03: 1.463, 0.08: 1.517).
SIMILARITY_TEMPERATURE = 0.05


def option_text(question: Question, index: int) -> str:
    """What an option is embedded as: its name, and its description after a colon when it has one."""
    option = question.options[index]
    return option.name if not option.description else f"{option.name}: {option.description}"


def similarity_distribution(question: Question, state: str, embed: Embed) -> np.ndarray:
    """q (n,): the encoder's distribution over the question's options for ``state`` (module docstring)."""
    vectors = embed([state, *(option_text(question, i) for i in range(len(question.options)))])
    return softmax((vectors[1:] @ vectors[0]).astype(np.float64) / SIMILARITY_TEMPERATURE)


def nearest_options(prior: np.ndarray, size: int) -> tuple[int, ...]:
    """The ``size`` most likely options under ``prior`` (ties to the earlier option), in option order."""
    order = np.argsort(-prior, kind="stable")
    return tuple(sorted(int(i) for i in order[:size]))
