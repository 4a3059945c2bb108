"""Crash-safe file writes (a reader never sees a half-written file or directory), the cache root, and
one-line error text."""

from __future__ import annotations

import errno
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
    """Create ``directory`` (and its parents) and write then remove a probe file in it: raises ``OSError`` naming
    the file now, before any work, where the real writes would fail later."""
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".write-test-{os.getpid()}"
    try:
        probe.write_text("ok")  # a full disk fails the write, naming no file
        probe.unlink()
    except OSError as e:
        probe.unlink(missing_ok=True)
        raise named(e, probe) from None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def named(e: OSError, path: str | Path) -> OSError:
    """``e`` with ``path`` as its file name when it has none (``write()`` on a full disk raises ``ENOSPC`` naming no
    file): the message then says which file could not be written."""
    if e.filename is not None or e.errno is None:
        return e
    return OSError(e.errno, e.strerror or os.strerror(e.errno), str(path))  # the errno's subclass, e.g. PermissionError


def _write_temp(path: Path, data: bytes) -> Path:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise named(e, path) from None
    return tmp


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write to a temporary sibling, fsync, rename over ``path``, fsync the directory."""
    path = Path(path)
    tmp = _write_temp(path, data)
    try:
        os.replace(tmp, path)
    except OSError as e:
        raise named(e, path) from None
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


# file systems without hard links (some FUSE and SMB mounts) answer os.link with one of these
_NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK, errno.EXDEV}


def create_new_file(path: str | Path, data: bytes) -> None:
    """Write ``data`` as the new file ``path``, an output that must replace nothing: into a temporary sibling,
    fsynced, then hard-linked into place, which fails (``FileExistsError`` naming ``path``) where ``os.replace`` would
    silently replace a file that appeared meanwhile. A reader never sees a half-written file."""
    path = Path(path)
    appeared = FileExistsError(errno.EEXIST, "created by something else while this command ran; not overwritten",
                               str(path))
    tmp = _write_temp(path, data)
    try:
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise appeared from None
        except OSError as e:
            if e.errno not in _NO_LINKS:
                raise named(e, path) from None
            if os.path.lexists(path):  # no hard links here: check, then rename (the output's claim guards the gap)
                raise appeared from None
            os.rename(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
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


def read_jsonl(path: str | Path, int_keys: tuple[str, ...] = ()) -> list[dict]:
    """Rows of a JSONL file, each a JSON object (with an integer >= 0 under each of ``int_keys``); a torn last line
    (a kill mid-append) is ignored. Anything else is a one-line ``ValueError`` naming ``path:line``: a line that is
    not UTF-8 or not JSON, JSON nested too deep or a number too long to read, a row that is not an object."""
    rows: list[dict] = []
    path = Path(path)
    if not path.exists():
        return rows
    lines = path.read_bytes().splitlines(keepends=True)
    for i, raw in enumerate(lines):
        where = f"{path}:{i + 1}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x}); expected JSON lines") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1 and not line.endswith("\n"):
                break  # torn final append
            raise ValueError(f"{where}: not valid JSON") from None
        except (ValueError, RecursionError) as e:  # an integer of thousands of digits, nesting past the stack
            raise ValueError(f"{where}: not readable JSON ({type(e).__name__}: {one_line(e, 120)})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object (one row per line), got {type(row).__name__} "
                             f"{one_line(line, 60)}")
        for key in int_keys:
            value = row.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}: {key!r} must be an integer >= 0, got {one_line(repr(value), 60)}")
        rows.append(row)
    return rows


def append_jsonl(path: str | Path, row: dict) -> None:
    try:
        with open(path, "a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise named(e, path) from None
