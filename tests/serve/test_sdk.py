"""The official System One client, ``typesafe-sdk`` 0.7.5, unchanged, against the real server.

It finds the server through ``TYPESAFE_BASE_URL`` and compresses bodies of 1 KiB or more with zstd.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx2
import pytest
from typesafe_sdk import (
    Choice,
    Noul,
    RetryPolicy,
    Score,
    TypeSafeClient,
    TypeSafeNotFoundError,
    TypeSafeUnprocessableEntityError,
)

from tests.serve.live import Live


@pytest.fixture
def sent() -> list[httpx2.Request]:
    return []


@pytest.fixture
def client(
    smollm2_server: Live, monkeypatch: pytest.MonkeyPatch, sent: list[httpx2.Request]
) -> Iterator[TypeSafeClient]:
    monkeypatch.setenv("TYPESAFE_BASE_URL", smollm2_server.url)
    monkeypatch.setenv("TYPESAFE_API_KEY", "any-key-auth-is-off")
    recorder = httpx2.Client(timeout=60.0, event_hooks={"request": [sent.append]})
    with TypeSafeClient(http_client=recorder, retry=RetryPolicy(max_retries=0)) as typesafe:
        yield typesafe


def test_the_sdk_parses_every_answer_type(client: TypeSafeClient) -> None:
    result = client.system_one(
        state="I was charged twice for the same order. Please help.",
        questions={
            "billing": Noul(instructions="Is this message about billing?"),
            "tone": Choice(instructions="What is the tone?", criteria={"calm": None, "angry": "upset or hostile"}),
            "urgency": Score(instructions="How urgent is it?", criteria=["can wait", "this week", "today"]),
        },
    )
    assert result.model == "smollm2-135m-instruct"
    assert 0 <= result.nouls["billing"].noul <= 1
    assert result.choices["tone"].choice in {"calm", "angry"}
    assert abs(sum(result.choices["tone"].probabilities.values()) - 1) < 1e-9
    assert set(result.scores["urgency"].probabilities) == {0, 1, 2}
    assert 0 <= result.scores["urgency"].score <= 2
    assert result.usage.output_tokens == 3


def test_the_sdk_compresses_a_large_body_with_zstd_and_the_server_reads_it(
    client: TypeSafeClient, sent: list[httpx2.Request]
) -> None:
    state = {"ticket": "My card has not arrived. " * 60, "customer": {"tier": "gold"}}
    result = client.system_one(state=state, questions={"late": Noul(instructions="Is a delivery late?")})
    assert sent[-1].headers["content-encoding"] == "zstd"
    assert 0 <= result.nouls["late"].noul <= 1


def test_the_sdk_lists_the_models(client: TypeSafeClient) -> None:
    names = [model.name for model in client.models.list().models]
    assert names == ["smollm2-135m-instruct", "jev-latest"]


def test_the_sdk_raises_its_typed_errors(client: TypeSafeClient) -> None:
    with pytest.raises(TypeSafeUnprocessableEntityError) as invalid:
        client.system_one(state="s", questions={"q": {"type": "choice", "criteria": {"only": None}}})
    assert "criteria" in str(invalid.value) and invalid.value.request_id
    with pytest.raises(TypeSafeNotFoundError):
        client.system_one(state="s", questions={"q": Noul(instructions="?")}, model="not-served")


def test_the_sdk_parses_answers_to_null_descriptions_and_instructions_and_json_levels(client: TypeSafeClient) -> None:
    result = client.system_one(
        state={"message": "Where is my card?", "tags": None},
        questions={
            "bare": {"type": "noul", "instructions": "Is this about a card?", "criteria": None},
            "half": {"type": "noul", "instructions": None, "criteria": {"true": "about a card", "false": None}},
            "topic": {"type": "choice", "instructions": None, "criteria": {"card": None, "loan": {"kind": ["credit"]}}},
            "level": {"type": "score", "criteria": ["low", {"text": "mid", "note": None}, ["high", None]]},
        },
    )
    assert set(result.nouls) == {"bare", "half"} and set(result.choices["topic"].probabilities) == {"card", "loan"}
    assert result.scores["level"].legend == {0: "low", 1: {"text": "mid", "note": None}, 2: ["high", None]}


def test_the_sdk_gets_a_typed_422_for_a_null_level_or_an_unknown_question_field(client: TypeSafeClient) -> None:
    # System One's legend values are never null, so a null level is refused rather than echoed.
    with pytest.raises(TypeSafeUnprocessableEntityError) as null_level:
        client.system_one(state="s", questions={"q": {"type": "score", "criteria": ["low", None]}})
    assert "level 1 is null" in str(null_level.value)
    with pytest.raises(TypeSafeUnprocessableEntityError) as typo:
        client.system_one(
            state="s", questions={"q": {"type": "choice", "instruction": "Tone?", "criteria": {"a": None, "b": None}}}
        )
    assert "did you mean 'instructions'?" in str(typo.value)


def test_the_sdk_parses_skipped_questions_and_the_x_diagnostics(client: TypeSafeClient) -> None:
    # "card" is answered yes or no, so exactly one of "if_yes" and "if_no" is skipped: it has no answer.
    result = client.system_one(
        state="My card has not arrived.",
        questions={
            "card": Noul(instructions="Is this about a card?"),
            "if_yes": {"type": "noul", "instructions": "Is it late?", "ask_if": {"card": [True]}},
            "if_no": {"type": "noul", "instructions": "Is it late?", "ask_if": {"card": [False]}},
            "tone": Choice(criteria={"calm": None, "angry": None}),
        },
        extra_body={"x_permutations": 2, "unknown_top_level": True},
    )
    assert len(set(result.nouls) & {"if_yes", "if_no"}) == 1 and "card" in result.nouls
    raw = result.raw_http_response.json()["answers"]
    assert raw["tone"]["x_reads"] == 2 and set(raw["tone"]["x_stderr"]) == {"calm", "angry"}
