"""Imports run one way: api, quality -> core -> prompt, engines; the wiring modules sit on top."""

import ast
import sys
from pathlib import Path

import slotread

PACKAGE = Path(slotread.__file__).parent

#: what each layer may import from slotread (besides itself and the shared errors module)
ALLOWED = {
    "api": {"core", "prompt"},
    "core": {"prompt", "engines"},
    "prompt": {"engines"},
    "engines": set(),
    # calibration and conformal sets work on core's answers (through the hook core.decide offers) and
    # read content-free prompts through core.decide
    "quality": {"core", "prompt", "engines"},
    "models": {"engines"},
    # the server wires the rest: the Decider, the wire formats, the engine contract, the registry
    "serve": {"api", "decider", "engines", "models", "settings"},
    # evaluation drives the public API: the Decider and the System One wire format; example banks
    # (quality.examples) it builds from train splits for the Decider and votes with (the knn baseline)
    "eval": {"api", "decider", "quality", "settings"},
}


def slotread_imports(path: Path) -> set[str]:
    """The top-level slotread subpackages or modules a file imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        found |= {name.split(".")[1] for name in names if name.startswith("slotread.")}
    return found


def test_layers_import_one_way() -> None:
    wrong = []
    for layer, allowed in ALLOWED.items():
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            for target in slotread_imports(path) - allowed - {layer, "errors"}:
                wrong.append(f"{path.relative_to(PACKAGE)} imports slotread.{target}")
    assert not wrong, "\n".join(wrong)


#: third-party packages the model-side layers may import: they run without the server's dependencies
#: (httpx: the remote engine's client; triton: the GPU kernels, shipped with torch's CUDA builds and
#: imported only where installed, engines/kernels.py)
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
    for layer in sorted(MODEL_SIDE):
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            eager, lazy = third_party_imports(path)
            lazy_allowed = MODEL_SIDE_PACKAGES | LAZY_PACKAGES.get(layer, set())
            wrong += [
                f"{path.relative_to(PACKAGE)} imports {package}" for package in sorted(eager - MODEL_SIDE_PACKAGES)
            ]
            wrong += [
                f"{path.relative_to(PACKAGE)} imports {package} in a function"
                for package in sorted(lazy - lazy_allowed)
            ]
    assert not wrong, "\n".join(wrong)


def test_nothing_imports_the_cli() -> None:
    users = [p for p in PACKAGE.rglob("*.py") if p.parent.name != "cli" and "cli" in slotread_imports(p)]
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
