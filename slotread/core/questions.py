"""The core's view of a decision: questions, their options, stages and read options.

These values are built by ``slotread.api`` from a wire request after validation, and hold text
already rendered for the model (objects as JSON). Question ids are caller data: they key the
answers and the dependencies, and never reach the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from slotread.core.images import Image

# the limits of Decision.steps and Decision.think, re-exported for the api
from slotread.engines.diffusion_gemma.denoise import MAX_STEPS as MAX_STEPS
from slotread.engines.thought import MAX_THOUGHT_TOKENS as MAX_THOUGHT_TOKENS
from slotread.prompt.render import SolvedExample

Kind = Literal["noul", "choice", "score"]
Samples = int | Literal["auto"]
#: How answers are calibrated (``slotread.quality``): not at all, against content-free reads, with a
#: fitted temperature, against the running mean of earlier answers, or contextually and then by
#: fitted top-label bins.
CalibrationMethod = Literal["none", "contextual", "temperature", "batch", "binned"]
#: How the chunks of a joint stage are prompted: each with its own questions, or every chunk with all
#: of the stage's questions (one prompt prefix, cached once) and slots for its own.
ChunkPrompt = Literal["own", "shared"]

#: samples="auto": a question whose first read has a normalised entropy above this is re-read ...
AUTO_THRESHOLD = 0.5
#: ... up to this many draws in all.
AUTO_MAX = 4


@dataclass(frozen=True)
class Option:
    """One option of a question: its caller-given name (returned byte for byte) and description text.

    For a noul the options are ``yes`` then ``no``; for a score they are the levels, low to high,
    named ``"0"``, ``"1"``, ... with the level text as description.
    """

    name: str
    description: str | None = None


@dataclass(frozen=True)
class Condition:
    """``ask_if``: ask only if the answer to ``question`` is one of ``answers`` (option names)."""

    question: str
    answers: frozenset[str]


@dataclass(frozen=True)
class Question:
    """One bounded question.

    ``depends_on`` lists earlier questions whose answers this one sees in its prompt; every
    ``ask_if`` condition must hold for the question to be asked (otherwise its answer is null).
    ``examples`` are solved cases its prompt shows (``slotread.quality.examples`` retrieves them).
    ``alone``: read in a canvas of its own even when the decision reads jointly.
    """

    id: str
    kind: Kind
    instructions: str | None
    options: tuple[Option, ...]
    depends_on: tuple[str, ...] = ()
    ask_if: tuple[Condition, ...] = ()
    examples: tuple[SolvedExample, ...] = ()
    alone: bool = False

    @property
    def prerequisites(self) -> tuple[str, ...]:
        """Every earlier question this one needs answered first."""
        ids = list(self.depends_on)
        ids += [c.question for c in self.ask_if if c.question not in ids]
        return tuple(ids)


@dataclass(frozen=True)
class QualityOptions:
    """A request's options that only ``slotread.quality`` applies; ``core`` carries them and never reads them.

    ``calibration`` and ``coverage`` (the target coverage of conformal prediction sets; None: no sets):
    ``quality.calibration``. ``examples`` (how many solved examples from an example bank each question's
    prompt shows) and ``shortlist`` (read at most this many options, those the nearest examples point
    to; 0: all): ``quality.examples``.
    """

    calibration: CalibrationMethod = "none"
    coverage: float | None = None
    examples: int = 0
    shortlist: int = 0


@dataclass(frozen=True)
class Decision:
    """A whole request: the state text, the questions in caller order, and how to read them.

    ``permutations``: how many option→label assignments each question is read under (at most its
    number of options; scores always one, see ``core.reads``). ``quality``: what ``slotread.quality``
    does around the reads, which ``core.reads`` never reads (``QualityOptions``). ``readout``: answer
    with the schema's learned readout (``slotread.quality.readouts``); it stays here because
    ``core.reads`` then asks the engine for the slots' hidden states. ``auto_threshold`` and
    ``auto_max``: with ``samples="auto"``, a question whose first read's normalised entropy is above
    the threshold is read again, up to ``auto_max`` draws in all. ``chunk_rows``: a joint canvas holds
    at most this many tokens before its padding (None: one canvas per stage), the questions split in
    order into the fewest chunks that fit; ``chunk_prompt`` says what each chunk's prompt lists.
    ``images``: decoded images placed in the state text (``core.images``), read by models with a
    vision tower. ``think``: a thought budget in tokens the model writes before each read
    (``core.thinking``; 0: none); ``steps``: denoise steps of a
    DiffusionGemma read (``engines.diffusion_gemma.denoise``; 1: the one-step read).
    """

    state: str
    questions: tuple[Question, ...]
    instructions: str | None = None
    seed: int = 0
    samples: Samples = 1
    joint: bool = False
    permutations: int = 1
    quality: QualityOptions = QualityOptions()
    readout: bool = False
    auto_threshold: float = AUTO_THRESHOLD
    auto_max: int = AUTO_MAX
    chunk_rows: int | None = None
    chunk_prompt: ChunkPrompt = "own"
    images: tuple[Image, ...] = ()
    think: int = 0
    steps: int = 1
