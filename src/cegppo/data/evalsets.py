"""Evaluation sets that ship with the package, loadable by name (`load_problems("aime24")`).

Each set is a verl-schema JSON-lines file in `cegppo/data/bundled/` (see the README there for where the
files come from). Rows loaded from a bundled file are labelled with the set's readable data-source name
("AIME 2024"), not with the files' verl routing key (`math_longcot_math_verify`).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

BUNDLED_DIR = Path(__file__).with_name("bundled")


class EvalSet(NamedTuple):
    file: str  # in BUNDLED_DIR
    data_source: str  # the readable name that results are reported under
    description: str


EVAL_SETS: dict[str, EvalSet] = {
    "aime24": EvalSet("aime24.jsonl", "AIME 2024", "AIME 2024 I and II: 30 problems, integer answers 0-999"),
    "aime25": EvalSet("aime25.jsonl", "AIME 2025", "AIME 2025 I and II: 30 problems, integer answers 0-999"),
}


def resolve_dataset(spec: str) -> Path | None:
    """The bundled file for a set name (`aime24`, `aime25`); None for anything else (paths included)."""
    s = EVAL_SETS.get(str(spec))
    return None if s is None else BUNDLED_DIR / s.file


def bundled_source(path: Path) -> str | None:
    """The readable data-source name when `path` is one of the bundled files, else None."""
    for s in EVAL_SETS.values():
        if path.resolve() == (BUNDLED_DIR / s.file).resolve():
            return s.data_source
    return None
