"""Hygiene of the tests themselves, read from their source with ``ast``.

Every ``Trainer(...)`` a test builds holds its run directory's lock until it is closed, so each one is closed
deterministically: it is the context expression of a ``with`` item (``with Trainer(cfg) as tr:``), or handed to
an ``ExitStack.enter_context(...)``, or built inside a ``with pytest.raises(...)`` block, where construction is
expected to fail. Any other ``Trainer(...)`` call (``tr = Trainer(cfg)``, ``train_loop(Trainer(cfg))``) is
reported. Other classes whose name merely ends in Trainer (TRL's ``CEGPPOTrainer``, ``GRPOTrainer``, the
``ReplayTrainer`` of the multiprocess worker) are not ours and are not checked."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _is_trainer_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Name) and f.id == "Trainer") or (isinstance(f, ast.Attribute) and f.attr == "Trainer")


def _is_raises(expr: ast.expr) -> bool:
    """``pytest.raises(...)`` (or a bare ``raises(...)`` imported from pytest)."""
    if not isinstance(expr, ast.Call):
        return False
    f = expr.func
    return (isinstance(f, ast.Attribute) and f.attr == "raises" and isinstance(f.value, ast.Name)
            and f.value.id == "pytest") or (isinstance(f, ast.Name) and f.id == "raises")


def _closed(call: ast.Call, parents: dict[ast.AST, ast.AST]) -> bool:
    parent = parents.get(call)
    if isinstance(parent, ast.withitem) and parent.context_expr is call:
        return True  # with Trainer(...) as tr:
    if (isinstance(parent, ast.Call) and isinstance(parent.func, ast.Attribute)
            and parent.func.attr == "enter_context" and parent.args and parent.args[0] is call):
        return True  # stack.enter_context(Trainer(...))
    # inside the body of a `with pytest.raises(...)`: the construction is the thing expected to fail
    node = parent
    while node is not None and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                                                     ast.ClassDef, ast.Module)):
        if isinstance(node, (ast.With, ast.AsyncWith)) and any(_is_raises(i.context_expr) for i in node.items):
            return True
        node = parents.get(node)
    return False


def unclosed_trainers(source: str, name: str = "<test>") -> list[str]:
    """``name:line: ...`` for every ``Trainer(...)`` call in ``source`` that is not closed deterministically."""
    tree = ast.parse(source, name)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    return [f"{name}:{node.lineno}: Trainer(...) is not the context expression of a `with` (nor an "
            f"ExitStack.enter_context argument, nor inside pytest.raises): its run lock is held until GC"
            for node in ast.walk(tree) if _is_trainer_call(node) and not _closed(node, parents)]


def violations(root: Path = TESTS) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        found += unclosed_trainers(path.read_text(), str(path.relative_to(root)))
    return found


def test_the_tests_read_here_build_trainers():
    """The scan sees the tests that build trainers (guards against checking an empty or wrong directory)."""
    sources = {p.name: p.read_text() for p in TESTS.glob("test_*.py")}
    building = {n for n, s in sources.items() if any(_is_trainer_call(x) for x in ast.walk(ast.parse(s)))}
    assert {"test_trainer.py", "test_ownership.py", "test_reliability.py"} <= building, building


def test_every_trainer_in_the_tests_is_closed_deterministically():
    assert violations() == []


@pytest.mark.parametrize("planted", [
    "def test_x(cfg):\n    tr = Trainer(cfg)\n    tr.step()\n",  # the plain leak
    "def test_x(cfg):\n    train_loop(Trainer(cfg))\n",  # built and dropped inside a call
    "def test_x(cfg, caplog):\n    with caplog.at_level(10):\n        tr = Trainer(cfg)\n",  # in a with, not its item
    "def test_x(cfg):\n    import cegppo.engine.trainer as m\n    tr = m.Trainer(cfg)\n",  # through the module
    "def test_x(cfg):\n    with contextlib.closing(Trainer(cfg)):\n        pass\n",  # wrapped: not the item itself
    "def test_x(cfg):\n    with pytest.raises(E):\n        def make():\n            return Trainer(cfg)\n"
    "    make()\n",  # a function defined under pytest.raises is not the construction expected to fail
])
def test_a_planted_unclosed_trainer_is_found(tmp_path, planted):
    """The checker itself can fail: a copy of the tests with one unclosed Trainer added is reported, once."""
    import shutil

    shutil.copytree(TESTS, tmp_path / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "tests" / "test_planted.py").write_text(planted)
    found = violations(tmp_path / "tests")
    assert len(found) == 1 and found[0].startswith("test_planted.py:"), found


@pytest.mark.parametrize("allowed", [
    "def test_x(cfg):\n    with Trainer(cfg) as tr:\n        tr.step()\n",
    "def test_x(cfg, caplog):\n    with caplog.at_level(10), Trainer(cfg) as tr, Trainer(cfg, resume=True):\n"
    "        pass\n",
    "def test_x(cfg):\n    with contextlib.ExitStack() as stack:\n        a = stack.enter_context(Trainer(cfg))\n",
    "def test_x(cfg):\n    with pytest.raises(E, match='x'):\n        Trainer(cfg, resume=True)\n",
    "def test_x(cfg):\n    with pytest.raises(E):\n        try:\n            Trainer(cfg)\n        finally:\n"
    "            pass\n",
    "def test_x(args):\n    t = CEGPPOTrainer(args)\n    g = GRPOTrainer(args)\n    r = ReplayTrainer(args)\n",
])
def test_closed_forms_are_accepted(allowed):
    assert unclosed_trainers(allowed) == []
