"""The layer rule, read from the source: every ``import`` of every module under ``src/cegppo`` (function-level
ones included, relative ones resolved) checked against one table of allowed edges between layers, and every
import of a third-party package against that layer's allow-list (the standard library is always allowed)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

LEAVES = {"cegppo.errors", "cegppo.io", "cegppo.faults"}  # import nothing of ours but one another
# layer -> the layers it may import (besides itself). A layer is a top-level module or subpackage of cegppo.
ALLOWED: dict[str, set[str]] = {
    "cegppo.errors": set(),
    "cegppo.io": {"cegppo.errors"},
    "cegppo.faults": set(),
    "cegppo.algorithm": {"cegppo.errors"},  # pure torch
    "cegppo.config": {"cegppo.algorithm"} | LEAVES,  # a schema: no engine, data or reporting
    "cegppo.data": LEAVES,  # no engine
    "cegppo.engine": {"cegppo.algorithm", "cegppo.data", "cegppo.config"} | LEAVES,  # never reporting
    "cegppo.integrations": {"cegppo.algorithm", "cegppo.errors"},
    "cegppo.reporting": {"cegppo.engine", "cegppo.algorithm", "cegppo.data", "cegppo.config"} | LEAVES,
    "cegppo.recipes": {"cegppo.engine", "cegppo.reporting", "cegppo.algorithm", "cegppo.data", "cegppo.config"}
    | LEAVES,
    "cegppo.cli": {"cegppo.recipes", "cegppo.engine", "cegppo.reporting", "cegppo.algorithm", "cegppo.data",
                   "cegppo.config"} | LEAVES,
    "cegppo": set(),  # the package's __init__
}
# layer -> the third-party packages (top-level import names) it may import; the standard library is always allowed.
# Derived from what each layer imports today: adding a package to a layer is a decision, made here.
THIRD_PARTY: dict[str, set[str]] = {
    "cegppo.errors": set(),
    "cegppo.io": set(),
    "cegppo.faults": set(),
    "cegppo.algorithm": {"torch"},  # math on tensors: no model library, no data library
    "cegppo.config": {"yaml"},
    "cegppo.data": {"datasets", "math_verify"},
    "cegppo.engine": {"torch", "transformers", "tokenizers", "safetensors", "gguf", "filelock", "yaml",
                      "vllm", "wandb"},  # vllm, wandb: optional, imported where used
    "cegppo.integrations": {"torch", "transformers", "trl", "verl", "math_verify"},
    "cegppo.reporting": {"matplotlib", "tqdm", "transformers", "yaml"},
    "cegppo.recipes": {"torch"},
    "cegppo.cli": set(),
    "cegppo": set(),
}


def module_name(path: Path, root: Path = SRC) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path = SRC) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement anywhere in the file, relative imports resolved."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from cegppo import engine` imports the subpackage itself
            out += [(node.lineno, f"{target}.{a.name}" if target == "cegppo" else target) for a in node.names]
    return out


def layer_of(module: str) -> str:
    parts = module.split(".")
    return "cegppo" if len(parts) == 1 else ".".join(parts[:2])


def layer_violations(root: Path = SRC) -> list[str]:
    found = []
    for path in sorted((root / "cegppo").rglob("*.py")):
        src_layer = layer_of(module_name(path, root))
        if src_layer not in ALLOWED:
            found.append(f"{path.relative_to(root)}: layer {src_layer} is not in the table")
            continue
        for line, target in imports_of(path, root):
            if target != "cegppo" and not target.startswith("cegppo."):
                continue
            dst = layer_of(target)
            if dst != src_layer and dst not in ALLOWED[src_layer]:
                found.append(f"{path.relative_to(root)}:{line}: {src_layer} imports {target}")
    return found


def third_party_violations(root: Path = SRC) -> list[str]:
    """Imports of a package that is neither ours, nor the standard library, nor on the layer's allow-list."""
    found = []
    for path in sorted((root / "cegppo").rglob("*.py")):
        src_layer = layer_of(module_name(path, root))
        allowed = THIRD_PARTY.get(src_layer, set())
        for line, target in imports_of(path, root):
            top = target.split(".")[0]
            if top == "cegppo" or top in sys.stdlib_module_names or top in allowed:
                continue
            found.append(f"{path.relative_to(root)}:{line}: {src_layer} imports third-party {top!r} "
                         f"(allowed there: {', '.join(sorted(allowed)) or 'none'}, and the standard library)")
    return found


def violations(root: Path = SRC) -> list[str]:
    return layer_violations(root) + third_party_violations(root)


def test_every_import_follows_the_layer_table():
    assert layer_violations() == []


def test_every_third_party_import_is_on_its_layers_allow_list():
    assert third_party_violations() == []


def test_every_layer_in_the_source_is_in_the_table():
    layers = {layer_of(module_name(p)) for p in (SRC / "cegppo").rglob("*.py")}
    assert layers <= set(ALLOWED), layers - set(ALLOWED)
    assert set(THIRD_PARTY) == set(ALLOWED), set(THIRD_PARTY) ^ set(ALLOWED)


@pytest.mark.parametrize("planted, layer", [
    ("def f():\n    from cegppo.config import ConfigError\n", "cegppo/algorithm/planted.py"),  # function-level
    ("from ..reporting import plots\n", "cegppo/engine/planted.py"),  # relative
    ("import cegppo.engine.models\n", "cegppo/config/planted.py"),
    ("from cegppo import engine\n", "cegppo/data/planted.py"),
    ("from cegppo.config import Config\n", "cegppo/integrations/planted.py"),
    ("def f():\n    import transformers\n", "cegppo/algorithm/planted.py"),  # third-party, function-level
    ("from transformers.modeling_utils import PreTrainedModel\n", "cegppo/algorithm/planted.py"),
    ("import numpy as np\n", "cegppo/config/planted.py"),
])
def test_a_planted_violation_is_found(tmp_path, planted, layer):
    """The checker itself can fail: a copy of the source with one forbidden import added is reported."""
    import shutil

    shutil.copytree(SRC / "cegppo", tmp_path / "cegppo", ignore=shutil.ignore_patterns("__pycache__", "examples"))
    (tmp_path / layer).write_text(planted)
    found = violations(tmp_path)
    assert len(found) == 1 and found[0].startswith(layer), found
