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
opinion pool of the model's read and the encoder, with equal weights w:

    p(i) = Q_S · (p_read(i) · q_i)^w / Σ_{j∈S} (p_read(j) · q_j)^w    (i ∈ S)

So the unread mass is the encoder's belief that the answer lies outside the list, per state (a
state that points clearly at a few options leaves little outside), never zero; and neither the
model's read nor the encoder decides the list alone. The two constants are fitted once, never on the
user's task (this works with no labels at all) and never on a test item: τ by maximum likelihood of q
on the train splits of BANKING77 and CLINC150 (``SIMILARITY_TEMPERATURE``), w by maximum likelihood of
the pooled list on the model's reads of train-split items of both (``POOL_EXPONENT``). w = ½ (the
geometric mean, the first choice) was under-confident on the full test sets: the 1.5B's read of a
10-option list spreads its mass (RESULTS.md, issue 22).
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

#: w of the pool on the list (module docstring): ``fit_pool_exponent`` on qwen2.5-coder-1.5b-instruct's reads of
#: 10-option lists for 150 BANKING77 and 150 CLINC150 in-scope train messages (seed 0; the 276 whose list held
#: the gold intent), 0.625 (likelihood-ratio 95%: 0.555-0.700); mean NLL on the list 0.831 against 0.855 at ½.
POOL_EXPONENT = 0.625
#: The range ``fit_pool_exponent`` searches: from nearly flat to twice the product of the two.
EXPONENT_BOUNDS = (0.05, 2.0)


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


def pool(read: np.ndarray, prior: np.ndarray, options: Sequence[int], exponent: float = POOL_EXPONENT) -> np.ndarray:
    """The answer over every option (module docstring): the list ``options`` shares its prior mass Q_S as
    normalise((p_read · q)^w), ``read`` (m,) being the model's distribution over the listed options in
    that order; every other option keeps its q_i."""
    full = np.array(prior, dtype=np.float64)
    listed = list(options)
    scores = exponent * np.log(np.maximum(np.asarray(read, dtype=np.float64) * full[listed], 1e-300))
    full[listed] = full[listed].sum() * softmax(scores)
    return full


def read_from_pool(answer: np.ndarray, prior: np.ndarray, options: Sequence[int], exponent: float) -> np.ndarray:
    """The model's read over ``options`` that ``pool`` turned into ``answer`` with this exponent (the pool is
    invertible: p_read ∝ (p / Q_S)^(1/w) / q on the list), for re-pooling finished runs offline."""
    listed = list(options)
    share = np.log(answer[listed] / answer[listed].sum())
    return softmax(share / exponent - np.log(prior[listed]))


def pool_log_likelihood(exponent: float, scores: np.ndarray, gold: np.ndarray) -> float:
    """Σ log normalise((p_read · q)^w)[gold] over items: ``scores`` (N, m) are log(p_read · q) on each item's
    list, ``gold`` (N,) the gold option's position in it (items whose list holds the gold option)."""
    z = exponent * scores
    top = z.max(axis=1, keepdims=True)
    log_norm = top[:, 0] + np.log(np.exp(z - top).sum(axis=1))
    return float((z[np.arange(len(gold)), gold] - log_norm).sum())


def fit_pool_exponent(scores: np.ndarray, gold: np.ndarray, tolerance: float = 1e-4) -> float:
    """The w in ``EXPONENT_BOUNDS`` of maximum ``pool_log_likelihood`` (concave in w: a golden-section search)."""
    low, high = EXPONENT_BOUNDS
    ratio = (np.sqrt(5) - 1) / 2
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    fa, fb = pool_log_likelihood(a, scores, gold), pool_log_likelihood(b, scores, gold)
    while high - low > tolerance:
        if fa < fb:
            low, a, fa = a, b, fb
            b = low + ratio * (high - low)
            fb = pool_log_likelihood(b, scores, gold)
        else:
            high, b, fb = b, a, fa
            a = high - ratio * (high - low)
            fa = pool_log_likelihood(a, scores, gold)
    return (low + high) / 2
