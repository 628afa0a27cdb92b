"""``/v1/chat/completions`` schema mode on the real server (SmolLM2-135M), through the ``openai`` client."""

from __future__ import annotations

import json
import math

import openai
import pytest

from tests.serve.live import Live

SCHEMA = {
    "questions": [
        {"id": "billing", "type": "noul", "instructions": "Is the message about billing?"},
        {
            "id": "tone",
            "type": "choice",
            "instructions": "How does the customer sound?",
            "options": [{"name": "calm"}, {"name": "angry", "description": "upset"}],
            "depends_on": ["billing"],
        },
        {"id": "urgency", "type": "score", "levels": ["low", "medium", "high"], "ask_if": {"billing": ["no"]}},
    ],
    "instructions": "Support triage.",
}
STATE = json.dumps({"message": "My card was charged twice for one order. Fix it today!"})


def client(live: Live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def served_name(live: Live) -> str:
    decider = live.app.state.service.decider
    assert decider is not None
    return str(decider.name)


def test_the_openai_client_lists_the_models(smollm2_server: Live) -> None:
    """``/v1/models`` carries OpenAI's listing beside System One's: ``models.list()`` finds the served model."""
    listed = client(smollm2_server).models.list().data
    assert [model.id for model in listed] == [served_name(smollm2_server), "jev-latest"]
    assert all(model.object == "model" and model.owned_by == "slotread" and model.created > 0 for model in listed)


def test_the_openai_client_gets_typed_answers(smollm2_server: Live) -> None:
    completion = client(smollm2_server).chat.completions.create(
        model=served_name(smollm2_server),
        messages=[{"role": "system", "content": json.dumps(SCHEMA)}, {"role": "user", "content": STATE}],
        seed=3,
    )
    assert completion.object == "chat.completion" and completion.choices[0].finish_reason == "stop"
    content = completion.choices[0].message.content
    assert content is not None
    answers = json.loads(content)["answers"]
    assert list(answers) == ["billing", "tone", "urgency"]
    billing, tone = answers["billing"], answers["tone"]
    assert billing["label"] == ("yes" if billing["noul"] >= 0.5 else "no")
    assert math.isclose(billing["probabilities"]["yes"] + billing["probabilities"]["no"], 1.0, abs_tol=1e-9)
    assert tone["choice"] in ("calm", "angry") and tone["label"] == "AB"[["calm", "angry"].index(tone["choice"])]
    assert tone["confidence"] == max(tone["probabilities"].values())
    # urgency is asked only when billing is no
    assert (answers["urgency"] is None) == (billing["label"] == "yes")
    usage = completion.usage
    assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens > 0


def test_ask_and_a_score_answer(smollm2_server: Live) -> None:
    schema = {
        **SCHEMA,
        "ask": ["urgency"],
        "questions": [*SCHEMA["questions"][:2], {**SCHEMA["questions"][2], "ask_if": {}}],
    }
    completion = client(smollm2_server).chat.completions.create(
        model=served_name(smollm2_server),
        messages=[{"role": "developer", "content": json.dumps(schema)}, {"role": "user", "content": STATE}],
    )
    answers = json.loads(completion.choices[0].message.content or "")["answers"]
    assert answers["billing"] is None and answers["tone"] is None
    urgency = answers["urgency"]
    probabilities = urgency["probabilities"]
    assert list(probabilities) == ["low", "medium", "high"]
    assert math.isclose(urgency["score"], sum((i + 1) * p for i, p in enumerate(probabilities.values())), abs_tol=1e-9)
    assert urgency["level"] == max(probabilities, key=probabilities.__getitem__)
    assert urgency["label"] == str(list(probabilities).index(urgency["level"]) + 1)


def test_a_bad_schema_is_a_422_located_in_the_messages(smollm2_server: Live) -> None:
    bad = {**SCHEMA, "think": True}
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client(smollm2_server).chat.completions.create(
            model=served_name(smollm2_server),
            messages=[{"role": "system", "content": json.dumps(bad)}, {"role": "user", "content": STATE}],
        )
    body = caught.value.body
    assert isinstance(body, dict)
    assert [d["loc"] for d in body["detail"]] == [["body", "messages", 0, "content", "think"]]
