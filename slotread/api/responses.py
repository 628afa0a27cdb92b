"""The 200 response bodies of both wire formats, as pydantic models.

The api modules build these bodies as plain dicts (``systemone.to_response``, ``decisions.from_systemone``);
these models describe them for the OpenAPI document, which generated clients are built from, and the
server tests check every body they receive against them. Answers carry slotread's ``x_`` diagnostics
beside the contract's fields.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: A score level as the request gave it (text, object or array), echoed in the legend.
Level = str | dict[str, Any] | list[Any]


class _Diagnostics(BaseModel):
    model_config = ConfigDict(extra="forbid")

    x_entropy: float = Field(description="normalised entropy of the answer's distribution: 0 sure, 1 uniform")
    x_label_mass: float = Field(description="share of the model's next-token mass that fell on the labels")
    x_reads: int = Field(description="reads averaged: draws × option assignments")
    x_stderr: float | dict[str, float] | None = Field(None, description="standard error over the reads (2+ reads)")
    x_agreement: float | None = Field(None, description="share of reads whose top answer is the final one")
    x_set: list[str] | None = Field(None, description="the conformal prediction set (with x_coverage)")
    x_thought: str | None = Field(None, description="the thought the model wrote before its reads (with x_thought)")


class NoulAnswer(_Diagnostics):
    type: Literal["noul"]
    noul: float = Field(description="P(yes)")


class ChoiceAnswer(_Diagnostics):
    type: Literal["choice"]
    choice: str
    probabilities: dict[str, float]
    confidence: float


class ScoreAnswer(_Diagnostics):
    type: Literal["score"]
    score: float = Field(description="Σ i·p_i over the 0-indexed levels")
    legend: dict[str, Level]
    probabilities: dict[str, float]
    confidence: float


Answer = Annotated[NoulAnswer | ChoiceAnswer | ScoreAnswer, Field(discriminator="type")]


class Usage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_tokens: int
    output_tokens: int


class SystemOneResponse(BaseModel):
    """``/v1/systemone``: answers keyed by question id; a question skipped by ``ask_if`` has none."""

    model_config = ConfigDict(extra="forbid")

    model: str
    answers: dict[str, Answer]
    usage: Usage
    #: whether these probabilities are bit-identical to what the same request gets alone, in any burst
    #: and any cache state (``slotread serve --deterministic``); absent behind ``--upstream``
    x_deterministic: bool | None = None


class _Decision(_Diagnostics):
    name: str | None


class PredicateAnswer(_Decision):
    type: Literal["predicate"]
    probability: float
    confidence: float


class ChoiceProbability(BaseModel):
    model_config = ConfigDict(extra="forbid")

    value: str
    probability: float


class DecisionChoiceAnswer(_Decision):
    type: Literal["choice"]
    choice: str
    probabilities: list[ChoiceProbability]
    confidence: float


class LevelProbability(BaseModel):
    model_config = ConfigDict(extra="forbid")

    label: str
    value: int
    probability: float


class DecisionScoreAnswer(_Decision):
    type: Literal["score"]
    score: float
    probabilities: list[LevelProbability]
    confidence: float


DecisionAnswer = Annotated[PredicateAnswer | DecisionChoiceAnswer | DecisionScoreAnswer, Field(discriminator="type")]


class DecisionsUsage(Usage):
    total_tokens: int


class DecisionsResponse(BaseModel):
    """``/v1/decisions``: answers in question order."""

    model_config = ConfigDict(extra="forbid")

    model: str
    answers: list[DecisionAnswer]
    usage: DecisionsUsage
