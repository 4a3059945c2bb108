"""Ownership of a run directory: one writing process at a time.

A training run holds an exclusive lock (``filelock``, an OS-level ``flock`` on ``<run>/.lock``) for its whole life,
and records who holds it in a sidecar, ``<run>/.lock.json``: ``{"pid", "host", "since", "command"}``. A second
writer is refused with one line that names the holder. The OS drops the lock of a process that dies (SIGKILL
included), so a later run acquires it at once; the dead holder's sidecar is then still there, and the new owner
says so (``reclaimed the lock of dead process N``) before replacing it.

The lock is per process: ``Trainer`` objects created one after the other in one process (a notebook, a test) on
the same directory share it, counted, and the last one to close (or be garbage-collected) releases it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import weakref
from datetime import datetime, timezone
from pathlib import Path

from filelock import FileLock, Timeout

from cegppo.io import atomic_write_json

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
OWNER_FILE = ".lock.json"

_mutex = threading.Lock()
_held: dict[str, list] = {}  # resolved run path -> [FileLock, number of RunLock objects sharing it]


class RunLockedError(RuntimeError):
    """Another process is writing to this run directory."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    except OSError:
        return False
    return True


def read_owner(run: str | Path) -> dict | None:
    """The holder recorded in ``<run>/.lock.json`` (None when there is none or it is unreadable)."""
    try:
        owner = json.loads((Path(run) / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def describe_owner(owner: dict | None) -> str:
    if not owner:
        return "holder not recorded yet"
    return f"pid {owner.get('pid')} on {owner.get('host')}, since {owner.get('since')}"


def _release(key: str) -> None:
    with _mutex:
        entry = _held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _held[key]
        lock, owner_file = entry[0], Path(key) / OWNER_FILE
        try:
            owner = read_owner(key)
            if owner and owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
                owner_file.unlink(missing_ok=True)
        except OSError:
            pass
        finally:
            lock.release(force=True)


class RunLock:
    """``RunLock(run).acquire()`` takes the run's lock or raises :class:`RunLockedError`; ``release()`` (also run
    when the object is garbage-collected or the interpreter exits) gives it back."""

    def __init__(self, run: str | Path):
        self.run = Path(run)
        self.key = str(self.run.resolve())
        self._finalizer: weakref.finalize | None = None

    @property
    def held(self) -> bool:
        return self._finalizer is not None and self._finalizer.alive

    def acquire(self) -> RunLock:
        if self.held:
            return self
        with _mutex:
            entry = _held.get(self.key)
            if entry is not None:  # another Trainer of this process: share the lock
                entry[1] += 1
            else:
                lock = FileLock(str(Path(self.key) / LOCK_FILE))
                try:
                    lock.acquire(timeout=0)
                except Timeout:
                    raise RunLockedError(
                        f"{self.run} is in use by another cegppo run ({describe_owner(read_owner(self.key))}); "
                        f"wait for it to finish, or use another output_dir") from None
                try:
                    self._claim()
                except BaseException:
                    lock.release(force=True)
                    raise
                _held[self.key] = [lock, 1]
        self._finalizer = weakref.finalize(self, _release, self.key)
        return self

    def _claim(self) -> None:
        previous = read_owner(self.key)
        host = socket.gethostname()
        if previous and previous.get("pid") != os.getpid():
            pid = previous.get("pid")
            if previous.get("host") == host and isinstance(pid, int) and not _pid_alive(pid):
                log.warning("%s: reclaimed the lock of dead process %d (it held the run since %s)", self.run, pid,
                            previous.get("since"))
            else:
                log.warning("%s: reclaimed the lock of process %s on %s (since %s), which no longer holds it",
                            self.run, pid, previous.get("host"), previous.get("since"))
        atomic_write_json(Path(self.key) / OWNER_FILE, {
            "pid": os.getpid(), "host": host,
            "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv)[:500],
        })

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs _release once
            self._finalizer = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
