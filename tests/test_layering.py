"""Imports run one way: api, quality -> core -> prompt, engines; the pipeline above them, the wiring on top.

Every module of slotread belongs to a layer (a top-level module or subpackage, or a module below one
named on its own), and the test fails for a module that belongs to none.
"""

import ast
import sys
from pathlib import Path

import slotread

PACKAGE = Path(slotread.__file__).parent

#: the training entry points (``slotread calibrate``, ``slotread fit``) read labelled data through the
#: Decider, as an evaluation does; they live beside what they fit, and nothing else in quality imports them
TRAINING = {"api", "core", "decider", "engines", "eval", "models", "pipeline", "prompt", "quality", "settings"}
#: what each layer may import from slotread (besides itself and the shared errors module); a module's
#: layer is the longest key its dotted name below slotread starts with
ALLOWED = {
    "api": {"core", "prompt"},
    "core": {"prompt", "engines"},
    "prompt": {"engines"},
    "engines": set(),
    # calibration and conformal sets, example banks and learned readouts work on core's answers; the
    # pipeline calls them before and after the reads
    "quality": {"core", "prompt", "engines"},
    "quality.calibration.train": TRAINING,
    "quality.readouts.train": TRAINING,
    "models": {"engines"},
    # the server wires the rest: the Decider, the wire formats, the engine contract, the registry
    "serve": {"api", "decider", "engines", "models", "serve.batcher", "settings"},
    # evaluation drives the public API: the Decider and the System One wire format; example banks
    # (quality.examples) it builds from train splits for the Decider and votes with (the knn baseline)
    # and runs concurrent decisions through the server's batcher, as the server does (--concurrency); the
    # sentence encoder (models.encoder) the vote's bank ranks by with --retrieval dense or hybrid
    "eval": {"api", "decider", "models", "quality", "serve.batcher", "settings"},
    # ``slotread calibrate`` and ``fit`` from settings: they call the training entry points, and fit loads the
    # sentence encoder a readout's partner embeds with, as the Decider does
    "eval.fitting": {
        "decider",
        "eval",
        "models",
        "quality",
        "quality.calibration.train",
        "quality.readouts.train",
        "settings",
    },
    # the batcher merges concurrent engine calls; it knows the engine contract alone
    "serve.batcher": {"engines"},
    # a request's stages in order: the wire format (api), the reads (core), the fits around them
    # (quality), the sentence encoder's embeddings (models)
    "pipeline": {"api", "core", "engines", "models", "prompt", "quality"},
    # the Decider wires a model, its engine and the quality stores behind the System One API; each
    # request it hands to the pipeline
    "decider": {"api", "core", "engines", "models", "pipeline", "prompt", "quality", "settings"},
    "settings": {"api", "engines", "models", "prompt"},
    "errors": set(),
    "__init__": {"decider"},
}
#: the command line sits on top of everything
ALLOWED["cli"] = set(ALLOWED)


def module_name(path: Path) -> str:
    """A file's dotted module name below slotread (a package's ``__init__`` named as its package)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def layer(module: str) -> str | None:
    """The layer of a dotted module name below slotread: the longest ALLOWED key it starts with."""
    parts = module.split(".")
    return next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in ALLOWED), None)


def slotread_imports(path: Path) -> set[str]:
    """The slotread modules a file imports, as dotted names below slotread."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        found |= {name.removeprefix("slotread.") for name in names if name.startswith("slotread.")}
    return found


def test_every_module_belongs_to_a_layer() -> None:
    homeless = [str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if layer(module_name(path)) is None]
    assert not homeless


def test_layers_import_one_way() -> None:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = layer(module_name(path))
        assert own is not None
        for target in sorted(slotread_imports(path)):
            target_layer = layer(target)
            if target_layer not in ALLOWED[own] | {own, "errors"}:
                wrong.append(f"{path.relative_to(PACKAGE)} ({own}) imports slotread.{target} ({target_layer})")
    assert not wrong, "\n".join(wrong)


#: third-party packages the model-side layers may import: they run without the server's dependencies
#: (httpx: the remote engine's client; triton: the GPU kernels, shipped with torch's CUDA builds and
#: imported only where installed, engines/diffusion_gemma/kernels.py)
MODEL_SIDE = {"core", "prompt", "engines", "quality"}
MODEL_SIDE_PACKAGES = {"numpy", "torch", "transformers", "httpx", "triton"}
#: and those a layer may import inside a function only, where a feature that needs them runs
#: (scikit-learn: a readout's lexical classifier)
LAZY_PACKAGES = {"quality": {"sklearn"}}


def third_party_imports(path: Path) -> tuple[set[str], set[str]]:
    """The top-level packages a file imports, other than the standard library and slotread: at module
    level (or in a class body), and inside functions."""
    eager: set[str] = set()
    lazy: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        found = lazy if in_function else eager
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    ours = set(sys.stdlib_module_names) | {"slotread", "__future__"}
    return eager - ours, lazy - ours


def test_the_model_side_needs_no_server_packages() -> None:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = layer(module_name(path))
        if own in MODEL_SIDE:
            eager, lazy = third_party_imports(path)
            lazy_allowed = MODEL_SIDE_PACKAGES | LAZY_PACKAGES.get(own, set())
            wrong += [
                f"{path.relative_to(PACKAGE)} imports {package}" for package in sorted(eager - MODEL_SIDE_PACKAGES)
            ]
            wrong += [
                f"{path.relative_to(PACKAGE)} imports {package} in a function"
                for package in sorted(lazy - lazy_allowed)
            ]
    assert not wrong, "\n".join(wrong)


def test_nothing_imports_the_cli() -> None:
    users = [
        p
        for p in PACKAGE.rglob("*.py")
        if layer(module_name(p)) != "cli" and any(layer(target) == "cli" for target in slotread_imports(p))
    ]
    assert not users


def test_public_surface() -> None:
    assert slotread.__all__ == [
        "Decider",
        "InvalidRequest",
        "ModelLoadError",
        "PromptTooLong",
        "SlotreadError",
        "UnknownModel",
    ]
    for name in slotread.__all__:
        assert getattr(slotread, name) is not None
