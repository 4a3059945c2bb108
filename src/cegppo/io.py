"""Crash-safe file writes (a reader never sees a half-written file or directory), the cache root, and
one-line error text."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from cegppo.errors import one_line  # noqa: F401 - re-exported: io's callers use it for their messages


def cache_root() -> Path:
    """`$CEGPPO_CACHE`, else `~/.cache/cegppo`: converted models (the SmolLM2 preset, the tiny model)."""
    env = os.environ.get("CEGPPO_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "cegppo"


def probe_writable(directory: Path) -> None:
    """Create ``directory`` (and its parents) and write then remove a probe file in it: raises ``OSError`` now,
    before any work, where the real writes would fail later."""
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".write-test-{os.getpid()}"
    probe.write_text("ok")
    probe.unlink()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write to a temporary sibling, fsync, rename over ``path``, fsync the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


def replace_dir(tmp: Path, target: Path) -> None:
    """Move a fully written directory ``tmp`` into place. An existing ``target`` is first renamed aside and
    then deleted (a directory cannot be renamed onto a non-empty one), so ``target`` is never half-deleted."""
    if target.exists():
        stale = target.parent / f".stale-{target.name}-{os.getpid()}-{time.time_ns()}"
        os.replace(target, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.replace(tmp, target)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSONL file; a torn last line (a kill mid-append) is ignored."""
    rows = []
    path = Path(path)
    if not path.exists():
        return rows
    lines = path.read_text().splitlines(keepends=True)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1 and not line.endswith("\n"):
                break  # torn final append
            raise ValueError(f"{path}:{i + 1}: not valid JSON") from None
    return rows


def append_jsonl(path: str | Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
