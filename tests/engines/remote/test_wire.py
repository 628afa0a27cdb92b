"""The engine wire contract: vLLM-shaped bodies built from reads, vLLM-shaped responses parsed into scores.

Responses here are written by hand in vLLM's shape; the server tests (tests/serve/test_engine_app.py)
check the same functions against real engine reads.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

from slotread.engines.base import ReadRequest, Slot, SlotScores
from slotread.engines.diffusion_gemma.noise import noise_canvas
from slotread.engines.remote.wire import (
    MAX_BATCH,
    MAX_LOGPROB_TOKEN_IDS,
    PER_READ,
    CompletionRead,
    batch_body,
    batch_responses,
    completion_bodies,
    completion_response,
    parse_completion,
    parse_completions,
    read_request,
    slot_scores,
)
from slotread.errors import UnknownModel, WireError

VOCAB = 262_144  # Gemma-4's
MODEL = "diffusion-gemma"
TURN_END, PAD = 106, 0

# A DiffusionGemma read: "Answer: <slot> <turn|> pad pad" with Yes/No-like labels at position 2.
PROMPT = ((2, 105, 2364, 107), (9_413, 236_881, 106, 107, 105, 4_368, 107))
CANVAS = (7_925, 236_787, 3, TURN_END, PAD, PAD)
LABELS = (6_750, 3_771)


def diffusion_request(seed: int | None = 11) -> ReadRequest:
    return ReadRequest(prompt=PROMPT, canvas=CANVAS, slots=(Slot(2, LABELS),), seed=seed)


def response(positions: list[tuple[int, float, dict[int, float]]]) -> dict[str, Any]:
    """A completion response in vLLM's shape: per position the argmax, its logprob and the top logprobs."""
    return {
        "id": "cmpl-0",
        "object": "text_completion",
        "created": 1_700_000_000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "text": "",
                "finish_reason": "length",
                "logprobs": {
                    "tokens": [f"token_id:{argmax}" for argmax, _, _ in positions],
                    "token_logprobs": [logprob for _, logprob, _ in positions],
                    "text_offset": [0] * len(positions),
                    "top_logprobs": [{f"token_id:{i}": lp for i, lp in top.items()} for _, _, top in positions],
                },
            }
        ],
        "usage": {"prompt_tokens": 11, "completion_tokens": len(positions), "total_tokens": 11 + len(positions)},
    }


def parse(body: Any, family: str = "diffusion", **served: Any) -> CompletionRead:
    """The server's check of a body as it arrives (through JSON), for a served model like ``MODEL``."""
    options = {"model": MODEL, "family": family, "vocab_size": VOCAB, "max_model_len": 4096, **served}
    return parse_completion(json.loads(json.dumps(body)), **options)  # type: ignore[arg-type]


# -- requests --------------------------------------------------------------------------------------


def test_a_diffusion_read_is_one_read_only_body_with_the_noised_seed_canvas() -> None:
    (body,) = completion_bodies(diffusion_request(seed=11), "diffusion", MODEL, VOCAB)
    noised = list(noise_canvas(CANVAS, [2], 11, VOCAB))
    assert noised[:2] + noised[3:] == [7_925, 236_787, TURN_END, PAD, PAD] and noised[2] != 3
    assert body == {
        "model": MODEL,
        "prompt": [2, 105, 2364, 107, 9_413, 236_881, 106, 107, 105, 4_368, 107],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 1,
        "logprob_token_ids": [6_750, 3_771],
        "return_tokens_as_token_ids": True,
        "vllm_xargs": {
            "diffusion_seed_canvas": noised,
            "diffusion_canvas_length": 6,
            "diffusion_max_steps": 1,
            "diffusion_read_only": True,
        },
    }
    # The server reads it back as the same canvas, read as given, at every position.
    read = parse(body)
    assert read == CompletionRead(prompt=tuple(body["prompt"]), canvas=tuple(noised), token_ids=LABELS)
    engine_read = read_request(read)
    assert engine_read.seed is None and engine_read.canvas == tuple(noised)
    assert engine_read.slots == tuple(Slot(p, LABELS) for p in range(6))


def test_a_read_without_a_seed_sends_its_canvas_as_it_is() -> None:
    (body,) = completion_bodies(diffusion_request(seed=None), "diffusion", MODEL, VOCAB)
    assert body["vllm_xargs"]["diffusion_seed_canvas"] == list(CANVAS)


def test_more_than_128_labels_split_into_bodies_of_the_same_read() -> None:
    first = tuple(range(1_000, 1_200))  # 200 labels
    second = (*range(1_150, 1_250), 1_000)  # 50 shared with the first slot, 50 new
    request = ReadRequest(prompt=PROMPT, canvas=(5, 3, 3, TURN_END), slots=(Slot(1, first), Slot(2, second)), seed=4)
    bodies = completion_bodies(request, "diffusion", MODEL, VOCAB)

    assert [len(body["logprob_token_ids"]) for body in bodies] == [128, 122]
    sent = [i for body in bodies for i in body["logprob_token_ids"]]
    assert sent == list(range(1_000, 1_250))  # each distinct label once, in first-seen order
    assert all(len(body["logprob_token_ids"]) <= MAX_LOGPROB_TOKEN_IDS for body in bodies)
    for body in bodies[1:]:
        assert {k: v for k, v in body.items() if k != "logprob_token_ids"} == {
            k: v for k, v in bodies[0].items() if k != "logprob_token_ids"
        }
        parse(body)


def test_a_causal_read_sends_the_prompt_and_reply_prefix_for_one_token() -> None:
    request = ReadRequest(prompt=((1, 2, 3), (4, 5)), canvas=(40, 41, 9), slots=(Slot(2, (7, 8)), Slot(2, (8, 9))))
    (body,) = completion_bodies(request, "causal", "smollm2", 49_152)
    assert body == {
        "model": "smollm2",
        "prompt": [1, 2, 3, 4, 5, 40, 41],
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": 1,
        "logprob_token_ids": [7, 8, 9],
        "return_tokens_as_token_ids": True,
    }
    read = parse(body, "causal", model="smollm2", vocab_size=49_152)
    assert read == CompletionRead(prompt=(1, 2, 3, 4, 5, 40, 41), canvas=None, token_ids=(7, 8, 9))
    assert read_request(read) == ReadRequest(((1, 2, 3, 4, 5, 40, 41),), (), (Slot(0, (7, 8, 9)),), seed=None)


@pytest.mark.parametrize(
    ("request_", "family"),
    [
        (ReadRequest(((1, 2),), (5, 6), (Slot(0, (3,)), Slot(1, (3,)))), "causal"),  # two positions
        (ReadRequest(((1, 2),), (5, 6), (Slot(0, (VOCAB,)),)), "diffusion"),  # a label out of vocabulary
        (ReadRequest(((1, 2),), (5, 6), (Slot(2, (3,)),)), "diffusion"),  # a slot past the canvas
        (ReadRequest(((1, 2),), (5, 6), (Slot(0, ()),)), "diffusion"),  # a slot without labels
        (ReadRequest(((1, 2),), (5, 6), ()), "causal"),  # no slots
    ],
)
def test_a_read_no_engine_can_read_is_refused_before_sending(request_: ReadRequest, family: Any) -> None:
    with pytest.raises(ValueError):
        completion_bodies(request_, family, MODEL, VOCAB)


# -- responses ---------------------------------------------------------------------------------------


def test_a_diffusion_response_gives_label_logprobs_mass_and_argmax() -> None:
    request = ReadRequest(prompt=PROMPT, canvas=(5, 3, 3, TURN_END), slots=(Slot(1, (10, 11)), Slot(2, (12, 10))))
    (body,) = completion_bodies(request, "diffusion", MODEL, VOCAB)
    assert body["logprob_token_ids"] == [10, 11, 12]
    positions = [
        (5, -0.1, {5: -0.1, 10: -4.0, 11: -5.0, 12: -6.0}),
        (10, -0.5, {10: -0.5, 11: -1.5, 12: -3.0}),  # the argmax is a label
        (7, -0.01, {7: -0.01, 10: -9.0, 11: -9999.0, 12: -7.0}),  # vLLM's floor for -inf
        (TURN_END, -0.2, {TURN_END: -0.2, 10: -8.0, 11: -8.5, 12: -9.5}),
    ]
    scores = slot_scores(request, [body], [response(positions)])

    np.testing.assert_array_equal(scores.logits[0], np.array([-0.5, -1.5], dtype=np.float32))
    np.testing.assert_array_equal(scores.logits[1], np.array([-7.0, -9.0], dtype=np.float32))
    assert scores.logits[0].dtype == np.float32
    assert scores.label_mass[0] == pytest.approx(math.exp(-0.5) + math.exp(-1.5), rel=1e-12)
    assert scores.label_mass[1] == pytest.approx(math.exp(-7.0) + math.exp(-9.0), rel=1e-12)
    assert scores.argmax_id == (10, 7) and scores.argmax_is_label == (True, False)
    assert scores.argmax_logit == (-0.5, -0.01) and scores.log_normalizer == (0.0, 0.0)


def test_split_responses_merge_into_one_read() -> None:
    labels = tuple(range(2_000, 2_200))
    request = ReadRequest(prompt=PROMPT, canvas=(3, TURN_END), slots=(Slot(0, labels),), seed=1)
    bodies = completion_bodies(request, "diffusion", MODEL, VOCAB)
    logprob = {i: -10.0 - (i - 2_000) / 100 for i in labels}
    responses = [
        response(
            [
                (2_000, -10.0, {2_000: -10.0, **{i: logprob[i] for i in body["logprob_token_ids"]}}),
                (TURN_END, -0.1, {TURN_END: -0.1, **{i: -20.0 for i in body["logprob_token_ids"]}}),
            ]
        )
        for body in bodies
    ]
    scores = slot_scores(request, bodies, responses)
    np.testing.assert_array_equal(scores.logits[0], np.array([logprob[i] for i in labels], dtype=np.float32))
    assert scores.label_mass[0] == pytest.approx(sum(math.exp(v) for v in logprob.values()), rel=1e-12)
    assert scores.argmax_id == (2_000,) and scores.argmax_is_label == (True,)


def test_a_causal_response_has_one_position() -> None:
    request = ReadRequest(prompt=((1, 2, 3),), canvas=(40,), slots=(Slot(1, (7, 8)), Slot(1, (9, 7))))
    bodies = completion_bodies(request, "causal", "smollm2", 49_152)
    scores = slot_scores(request, bodies, [response([(9, -0.3, {9: -0.3, 7: -2.0, 8: -3.0})])])
    np.testing.assert_array_equal(scores.logits[0], np.array([-2.0, -3.0], dtype=np.float32))
    np.testing.assert_array_equal(scores.logits[1], np.array([-0.3, -2.0], dtype=np.float32))
    assert scores.argmax_id == (9, 9) and scores.argmax_is_label == (False, True)


def broken(edit: str) -> dict[str, Any]:
    body = response([(5, -0.1, {5: -0.1, 10: -4.0}), (6, -0.2, {6: -0.2, 10: -3.0})])
    logprobs = body["choices"][0]["logprobs"]
    if edit == "no choices":
        body["choices"] = []
    elif edit == "no logprobs":
        body["choices"][0]["logprobs"] = None
    elif edit == "one position short":
        for name in ("tokens", "token_logprobs", "top_logprobs"):
            logprobs[name].pop()
    elif edit == "a label missing":
        del logprobs["top_logprobs"][1]["token_id:10"]
    elif edit == "tokens as text":
        logprobs["tokens"][0] = "Yes"
    elif edit == "a logprob that is not a number":
        logprobs["top_logprobs"][0]["token_id:10"] = "-4.0"
    return body


@pytest.mark.parametrize(
    "edit",
    [
        "no choices",
        "no logprobs",
        "one position short",
        "a label missing",
        "tokens as text",
        "a logprob that is not a number",
    ],
)
def test_a_response_without_what_was_asked_is_a_wire_error(edit: str) -> None:
    request = ReadRequest(prompt=PROMPT, canvas=(3, 3), slots=(Slot(1, (10,)),), seed=None)
    bodies = completion_bodies(request, "diffusion", MODEL, VOCAB)
    slot_scores(request, bodies, [broken("nothing")])
    with pytest.raises(WireError):
        slot_scores(request, bodies, [broken(edit)])


# -- the server's response, and the round trip -------------------------------------------------------


def test_the_response_reports_logit_minus_normalizer_at_every_position() -> None:
    read = CompletionRead(prompt=(1, 2, 3), canvas=(4, 5), token_ids=(10, 11))
    scores = SlotScores(
        logits=(np.array([1.0, -2.0], dtype=np.float32), np.array([0.5, -np.inf], dtype=np.float32)),
        label_mass=(0.5, 0.1),
        argmax_is_label=(True, False),
        argmax_id=(10, 99),
        argmax_logit=(1.0, 3.0),
        log_normalizer=(1.5, 4.0),
    )
    body = completion_response([read], [scores], MODEL)
    json.dumps(body, allow_nan=False)  # strict JSON: no -inf, no NaN
    assert body["id"].startswith("cmpl-") and type(body["created"]) is int
    assert {k: body[k] for k in ("object", "model")} == {"object": "text_completion", "model": MODEL}
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    choice = body["choices"][0]
    assert {k: choice[k] for k in ("index", "text", "finish_reason")} == {
        "index": 0,
        "text": "",
        "finish_reason": "length",
    }
    assert choice["logprobs"] == {
        "tokens": ["token_id:10", "token_id:99"],
        "token_logprobs": [-0.5, -1.0],
        "text_offset": [0, 0],
        "top_logprobs": [
            {"token_id:10": -0.5, "token_id:11": -3.5},
            {"token_id:99": -1.0, "token_id:10": -3.5, "token_id:11": -9999.0},
        ],
    }


def test_without_requested_ids_only_the_argmax_is_reported() -> None:
    read = CompletionRead(prompt=(1, 2), canvas=None, token_ids=())
    assert read_request(read).slots == (Slot(0, (0,)),)  # the stand-in label
    scores = SlotScores((np.array([2.0], dtype=np.float32),), (0.1,), (False,), (7,), (3.0,), (3.25,))
    logprobs = completion_response([read], [scores], MODEL)["choices"][0]["logprobs"]
    assert logprobs["top_logprobs"] == [{"token_id:7": -0.25}]


def test_a_round_trip_keeps_the_label_softmax_the_mass_and_the_argmax() -> None:
    request = ReadRequest(prompt=PROMPT, canvas=(3, 3, TURN_END), slots=(Slot(0, (10, 11, 12)), Slot(1, (12, 13))))
    (body,) = completion_bodies(request, "diffusion", MODEL, VOCAB)
    read = parse(body)
    rng = np.random.default_rng(0)
    full = rng.normal(0, 4, size=(3, 64)).astype(np.float32)  # the model's logits at each position
    full[1, 12] = 30.0  # the argmax at position 1 is a label
    normalizer = np.log(np.exp(full.astype(np.float64)).sum(axis=1))
    labels = read_request(read).slots[0].label_ids
    server = SlotScores(
        logits=tuple(full[p, list(labels)] for p in range(3)),
        label_mass=(0.0,) * 3,  # not sent: the client recomputes it
        argmax_is_label=(False,) * 3,
        argmax_id=tuple(int(row.argmax()) for row in full),
        argmax_logit=tuple(float(row.max()) for row in full),
        log_normalizer=tuple(normalizer),
    )
    client = slot_scores(request, [body], [json.loads(json.dumps(completion_response([read], [server], MODEL)))])

    for index, slot in enumerate(request.slots):
        row = full[slot.position, list(slot.label_ids)].astype(np.float64)
        expected = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        got = client.logits[index].astype(np.float64)
        np.testing.assert_allclose(np.exp(got - got.max()) / np.exp(got - got.max()).sum(), expected, atol=1e-6)
        assert client.label_mass[index] == pytest.approx(np.exp(row - normalizer[slot.position]).sum(), rel=1e-6)
        assert client.argmax_id[index] == server.argmax_id[slot.position]
    assert client.argmax_is_label == (False, True)


# -- the server's checks -----------------------------------------------------------------------------


def valid_body() -> dict[str, Any]:
    (body,) = completion_bodies(diffusion_request(), "diffusion", MODEL, VOCAB)
    return body


def edited(**changes: Any) -> dict[str, Any]:
    """The valid body with top-level fields (or ``vllm_xargs.<name>`` via ``xargs_<name>``) changed; None deletes."""
    body = valid_body()
    for key, value in changes.items():
        target, name = (body["vllm_xargs"], key.removeprefix("xargs_")) if key.startswith("xargs_") else (body, key)
        if value is None:
            del target[name]
        else:
            target[name] = value
    return body


CANVAS_OF_6 = [7_925, 236_787, 3, TURN_END, PAD, PAD]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (edited(xargs_diffusion_seed_canvas=CANVAS_OF_6[:5]), "vllm_xargs.diffusion_seed_canvas", "has 5 tokens"),
        (
            edited(xargs_diffusion_seed_canvas=[*CANVAS_OF_6[:5], VOCAB]),
            "vllm_xargs.diffusion_seed_canvas",
            "out of vocabulary",
        ),
        (edited(prompt=[1, -1]), "prompt", "out of vocabulary"),
        (edited(prompt=[1, VOCAB]), "prompt", "out of vocabulary"),
        (edited(logprob_token_ids=[5, VOCAB + 7]), "logprob_token_ids", "out of vocabulary"),
        (edited(logprob_token_ids=list(range(129))), "logprob_token_ids", "at most 128"),
        (
            edited(xargs_diffusion_seed_canvas=None, xargs_diffusion_pinned=[0]),
            "vllm_xargs.diffusion_pinned",
            "needs diffusion_seed_canvas",
        ),
        (edited(xargs_diffusion_pinned=[6]), "vllm_xargs.diffusion_pinned", "from 0 to 5"),
        (edited(xargs_diffusion_pinned=[1, 1]), "vllm_xargs.diffusion_pinned", "twice"),
        (edited(xargs_diffusion_seed_canvas=None), "vllm_xargs.diffusion_seed_canvas", "required"),
        (edited(vllm_xargs=None), "vllm_xargs", "a diffusion read needs"),
        (edited(xargs_diffusion_max_steps=9), "vllm_xargs.diffusion_max_steps", "at most 8 denoise steps"),
        (edited(xargs_diffusion_max_steps=None), "vllm_xargs.diffusion_max_steps", "1 to 8"),
        (edited(xargs_diffusion_read_only=False), "vllm_xargs.diffusion_read_only", "only reads"),
        (edited(xargs_diffusion_canvas_length="6"), "vllm_xargs.diffusion_canvas_length", "positive integer"),
        (edited(xargs_diffusion_remask=True), "vllm_xargs.diffusion_remask", "unknown"),
        (edited(max_tokens=5), "max_tokens", "canvas of 6 tokens"),
        (edited(max_tokens=None), "max_tokens", "positive integer"),
        (edited(logprobs=5), "logprobs", "logprob_token_ids"),
        (edited(logprobs=None), "logprobs", "0 or 1"),
        (edited(temperature=0.7), "temperature", "must be 0"),
        (edited(prompt="Is it urgent?"), "prompt", "token ids"),
        (edited(prompt=[[1, 2], [3]]), "prompt", "token ids"),
        (edited(prompt=[1, 2.0]), "prompt", "token ids"),
        (edited(prompt=[True, 2]), "prompt", "token ids"),
        (edited(prompt=[]), "prompt", "empty"),
        (edited(stream=True), "stream", "does not stream"),
        (edited(n=2), "n", "one answer"),
        (edited(echo=True), "echo", "echo"),
        (edited(return_tokens_as_token_ids=False), "return_tokens_as_token_ids", "token_id:N"),
        (edited(prompt_logprobs=1), "prompt_logprobs", "read positions"),
        (edited(model=7), "model", "string"),
        (edited(prompt=list(range(4_091))), "prompt", "maximum context length is 4096"),
        ([valid_body()], None, "JSON object"),
    ],
)
def test_a_bad_diffusion_body_is_refused_naming_the_field(body: Any, param: str | None, words: str) -> None:
    with pytest.raises(WireError) as caught:
        parse(body)
    assert caught.value.param == param and words in caught.value.message


def test_the_server_accepts_what_vllm_accepts() -> None:
    parse(edited(xargs_diffusion_pinned=[0, 1, 3]))
    parse(edited(xargs_diffusion_read_only=1))  # vLLM's lax xargs turn true into 1
    parse(edited(model=None, temperature=None, logprobs=0, stream=False, n=1, top_p=0.9, seed=3))
    assert parse(edited(logprob_token_ids=[5, 5, 6])).token_ids == (5, 6)
    assert parse(edited(prompt=list(range(4_090)))).prompt[-1] == 4_089  # 4090 + 6 = max_model_len


def test_a_body_for_another_model_is_unknown() -> None:
    with pytest.raises(UnknownModel):
        parse(edited(model="llama"))


@pytest.mark.parametrize(
    ("changes", "param", "words"),
    [
        ({"max_tokens": 2}, "max_tokens", "must be 1"),
        ({"vllm_xargs": {"diffusion_seed_canvas": [1, 2]}}, "vllm_xargs.diffusion_seed_canvas", "causal model"),
        ({"vllm_xargs": {"diffusion_read_only": True}}, "vllm_xargs.diffusion_read_only", "causal model"),
        ({"prompt": list(range(2_048))}, "prompt", "maximum context length is 2048"),
    ],
)
def test_a_bad_causal_body_is_refused(changes: dict[str, Any], param: str, words: str) -> None:
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1, "logprobs": 1, "logprob_token_ids": [7], **changes}
    parse(dict(body, max_tokens=1, prompt=[1, 2, 3], vllm_xargs=None), "causal", max_model_len=2_048)
    with pytest.raises(WireError) as caught:
        parse(body, "causal", max_model_len=2_048)
    assert caught.value.param == param and words in caught.value.message


def test_segment_ends_carry_the_prompt_pieces_to_a_slotread_replica() -> None:
    # a causal read: the prompt's two segments, then the reply prefix before the slot as a third
    causal = ReadRequest(prompt=((1, 2, 3), (4, 5)), canvas=(40, 41, 9), slots=(Slot(2, (7,)),))
    (body,) = completion_bodies(causal, "causal", "smollm2", 49_152, slotread=True)
    assert body["x_segment_ends"] == [3, 5]
    read = parse(body, "causal", model="smollm2", vocab_size=49_152)
    assert read_request(read).prompt == ((1, 2, 3), (4, 5), (40, 41))
    # a diffusion read: the prompt's own segments again, whatever the canvas
    (body,) = completion_bodies(diffusion_request(), "diffusion", MODEL, VOCAB, slotread=True)
    assert body["x_segment_ends"] == [len(PROMPT[0])]
    assert read_request(parse(body)).prompt == PROMPT
    # without segments (vLLM replicas) the field is absent and the server reads one segment
    (plain,) = completion_bodies(diffusion_request(), "diffusion", MODEL, VOCAB)
    assert "x_segment_ends" not in plain
    assert read_request(parse(plain)).prompt == (tuple(i for segment in PROMPT for i in segment),)


@pytest.mark.parametrize("ends", [[0], [11], [5, 5], [6, 4], ["4"], 4])
def test_bad_segment_ends_are_refused(ends: Any) -> None:
    with pytest.raises(WireError) as caught:
        parse(edited(x_segment_ends=ends))
    assert caught.value.param == "x_segment_ends"


def test_a_slotread_replica_reads_and_reports_the_slots_positions_alone() -> None:
    request = ReadRequest(prompt=PROMPT, canvas=CANVAS, slots=(Slot(4, LABELS), Slot(2, LABELS)), seed=11)
    (body,) = completion_bodies(request, "diffusion", MODEL, VOCAB, slotread=True)
    assert body["x_positions"] == [2, 4]
    read = parse(body)
    assert read.at == (2, 4) and [slot.position for slot in read_request(read).slots] == [2, 4]
    # the answer's two entries are positions 2 and 4, in that order: the first slot reads the second
    answer = response([(9, -0.5, {6_750: -1.0, 3_771: -2.0, 9: -0.5}), (6_750, -0.1, {6_750: -0.1, 3_771: -3.0})])
    scores = slot_scores(request, [body], [answer])
    assert scores.argmax_id == (6_750, 9)
    np.testing.assert_allclose(scores.logits[0], [-0.1, -3.0])
    np.testing.assert_allclose(scores.logits[1], [-1.0, -2.0])
    # a causal read has one position, and no x_positions
    causal = ReadRequest(prompt=((1, 2, 3),), canvas=(40, 9), slots=(Slot(1, (7,)),))
    (causal_body,) = completion_bodies(causal, "causal", "smollm2", 49_152, slotread=True)
    assert "x_positions" not in causal_body
    with pytest.raises(WireError) as caught:
        parse({**causal_body, "x_positions": [0]}, "causal", model="smollm2", vocab_size=49_152)
    assert caught.value.param == "x_positions"


@pytest.mark.parametrize("positions", [[], [6], [4, 2], [2, 2], ["2"], 2])
def test_bad_positions_are_refused(positions: Any) -> None:
    with pytest.raises(WireError) as caught:
        parse(edited(x_positions=positions))
    assert caught.value.param == "x_positions" and "0 to 5" in caught.value.message


# -- several reads in one body (slotread replicas) ----------------------------------------------------


def batch_reads() -> list[ReadRequest]:
    """A read of 300 labels (three bodies), a plain one, and one without a seed on a shorter canvas."""
    many = tuple(range(1_000, 1_300))
    return [
        ReadRequest(prompt=PROMPT, canvas=CANVAS, slots=(Slot(2, many),), seed=5),
        diffusion_request(),
        ReadRequest(prompt=(PROMPT[0], (9, 10)), canvas=CANVAS[:4], slots=(Slot(1, LABELS),), seed=None),
    ]


def parse_all(body: Any, **served: Any) -> list[CompletionRead]:
    options = {"model": MODEL, "family": "diffusion", "vocab_size": VOCAB, "max_model_len": 4096, **served}
    return parse_completions(json.loads(json.dumps(body)), **options)  # type: ignore[arg-type]


def vllm_batch(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's batch form of ``bodies``: every prompt whole in ``prompt``, each body's own fields in ``x_reads``."""
    shared = {key: value for key, value in bodies[0].items() if key != "prompt" and key not in PER_READ}
    return {
        **shared,
        "prompt": [body["prompt"] for body in bodies],
        "x_reads": [{key: body[key] for key in PER_READ if key in body} for body in bodies],
    }


def test_a_batch_sends_each_segment_once_and_the_server_reads_each_body_as_alone() -> None:
    bodies = [body for read in batch_reads() for body in completion_bodies(read, "diffusion", MODEL, VOCAB, True)]
    assert len(bodies) == 5
    batch = batch_body(bodies)
    assert batch["x_segments"] == [list(PROMPT[0]), list(PROMPT[1]), [9, 10]]
    assert [read["x_prompt"] for read in batch["x_reads"]] == [[0, 1]] * 4 + [[0, 2]]
    assert "prompt" not in batch and not any("x_segment_ends" in read for read in batch["x_reads"])
    assert "logprob_token_ids" not in batch and "vllm_xargs" not in batch
    assert parse_all(batch) == [parse(body) for body in bodies]
    # the same bodies in vLLM's batch form, prompts whole, read the same
    assert parse_all(vllm_batch(bodies)) == [parse(body) for body in bodies]
    # a single body is still one read
    assert parse_all(bodies[1]) == [parse(bodies[1])]
    # vLLM's own batch form (no x_reads) reads every prompt with the top level's fields
    plain = {**bodies[3], "prompt": [bodies[3]["prompt"], bodies[3]["prompt"][:5]]}
    assert parse_all(plain) == [parse(bodies[3]), parse({**bodies[3], "prompt": bodies[3]["prompt"][:5]})]


def test_a_batch_answer_splits_into_each_bodys_answer() -> None:
    requests = batch_reads()
    bodies = [completion_bodies(read, "diffusion", MODEL, VOCAB, True) for read in requests]
    flat = [body for request_bodies in bodies for body in request_bodies]
    reads = parse_all(batch_body(flat))
    rng = np.random.default_rng(0)
    scores = []
    for read in reads:
        full = rng.normal(size=(read.positions, 8)).astype(np.float32)
        scores.append(
            SlotScores(
                logits=tuple(
                    np.linspace(-3, -1, len(read.token_ids), dtype=np.float32) + p for p in range(read.positions)
                ),
                label_mass=(0.0,) * read.positions,
                argmax_is_label=(False,) * read.positions,
                argmax_id=tuple(int(row.argmax()) for row in full),
                argmax_logit=(0.0,) * read.positions,
                log_normalizer=(0.0,) * read.positions,
            )
        )
    answer = json.loads(json.dumps(completion_response(reads, scores, MODEL)))
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2, 3, 4]
    assert answer["usage"]["prompt_tokens"] == sum(len(body["prompt"]) for body in flat)
    answer["choices"].reverse()  # an answer's choices are placed by index, not by order
    split = batch_responses(answer, len(flat))
    alone = [
        completion_response([read], [score], MODEL)["choices"][0] for read, score in zip(reads, scores, strict=True)
    ]
    assert [one["choices"][0] for one in split] == [dict(choice, index=i) for i, choice in enumerate(alone)]
    first = slot_scores(requests[0], bodies[0], split[:3])
    assert len(first.logits[0]) == 300
    with pytest.raises(WireError, match="5 choices"):
        batch_responses({"choices": answer["choices"][:4]}, 5)
    answer["choices"][0]["index"] = 7
    with pytest.raises(WireError, match="no choice of index 4"):
        batch_responses(answer, 5)


def bad_batch(edit: str) -> dict[str, Any]:
    bodies = [body for read in batch_reads()[1:] for body in completion_bodies(read, "diffusion", MODEL, VOCAB, True)]
    batch = vllm_batch(bodies)
    if edit == "label":
        batch["x_reads"][1]["logprob_token_ids"] = [VOCAB]
    elif edit == "prompt":
        batch["prompt"][1] = []
    elif edit == "shared":
        batch["temperature"] = 1
    elif edit == "unknown":
        batch["x_reads"][0]["prompt"] = [1]
    elif edit == "count":
        batch["x_reads"].pop()
    elif edit == "entry":
        batch["x_reads"][1] = 4
    elif edit == "many":
        batch["prompt"] *= MAX_BATCH
        batch["x_reads"] *= MAX_BATCH
    elif edit == "single":
        batch["prompt"] = batch["prompt"][0]
    return batch


@pytest.mark.parametrize(
    ("edit", "param", "words"),
    [
        ("label", "x_reads[1].logprob_token_ids", "prompt 1: logprob_token_ids: token id 262144 is out of vocabulary"),
        ("prompt", "prompt[1]", "prompt 1: prompt: empty"),
        ("shared", "temperature", "prompt 0: temperature must be 0"),
        ("unknown", "x_reads[0].prompt", "an entry holds only max_tokens"),
        ("count", "x_reads", "a list of 2 objects, one per prompt"),
        ("entry", "x_reads[1]", "must be an object"),
        ("many", "prompt", f"at most {MAX_BATCH} per request"),
        ("single", "x_reads", "x_reads needs prompt to be a list of prompts, one per entry, or x_segments"),
    ],
)
def test_a_bad_batch_is_refused_naming_the_read_and_field(edit: str, param: str, words: str) -> None:
    with pytest.raises(WireError) as caught:
        parse_all(bad_batch(edit))
    assert caught.value.param == param and words in caught.value.message


def bad_segmented_batch(edit: str) -> dict[str, Any]:
    bodies = [body for read in batch_reads()[1:] for body in completion_bodies(read, "diffusion", MODEL, VOCAB, True)]
    batch = batch_body(bodies)
    if edit == "segment":
        batch["x_segments"][1] = [1, VOCAB]
    elif edit == "empty":
        batch["x_segments"][1] = []
    elif edit == "index":
        batch["x_reads"][1]["x_prompt"] = [0, 3]
    elif edit == "no prompt":
        del batch["x_reads"][0]["x_prompt"]
    elif edit == "both":
        batch["prompt"] = [body["prompt"] for body in bodies]
    elif edit == "ends":
        batch["x_reads"][0]["x_segment_ends"] = [4]
    elif edit == "label":
        batch["x_reads"][1]["logprob_token_ids"] = [VOCAB]
    elif edit == "model":
        batch["model"] = "another"
    elif edit == "many":
        batch["x_reads"] *= MAX_BATCH
    return batch


@pytest.mark.parametrize(
    ("edit", "param", "words"),
    [
        ("segment", "x_segments[1]", "token id 262144 is out of vocabulary"),
        ("empty", "x_segments[1]", "empty; a segment holds at least one token"),
        ("index", "x_reads[1].x_prompt", "indices into x_segments (0 to 2)"),
        ("no prompt", "x_reads[0].x_prompt", "must be a non-empty list of indices"),
        ("both", "prompt", "gives each read's prompt in x_reads[i].x_prompt"),
        ("ends", "x_reads[0].x_segment_ends", "an entry holds only max_tokens"),
        ("label", "x_reads[1].logprob_token_ids", "prompt 1: logprob_token_ids: token id 262144 is out of vocabulary"),
        ("many", "x_reads", f"1 to {MAX_BATCH} objects"),
    ],
)
def test_a_bad_segmented_batch_is_refused_naming_the_read_and_field(edit: str, param: str, words: str) -> None:
    with pytest.raises(WireError) as caught:
        parse_all(bad_segmented_batch(edit))
    assert caught.value.param == param and words in caught.value.message


def test_a_segmented_batch_for_another_model_or_too_long_a_prompt_is_refused() -> None:
    with pytest.raises(UnknownModel):
        parse_all(bad_segmented_batch("model"))
    with pytest.raises(WireError) as caught:
        parse_all(bad_segmented_batch(""), max_model_len=12)
    assert caught.value.param == "x_reads[0].x_prompt" and "maximum context length is 12" in caught.value.message
