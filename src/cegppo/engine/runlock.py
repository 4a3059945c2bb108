"""Ownership of a run directory: one writing process at a time.

A training run holds an exclusive lock (``filelock``, an OS-level ``flock`` on ``<run>/.lock``) for its whole life,
and records who holds it in a sidecar, ``<run>/.lock.json``: ``{"pid", "host", "since", "command"}``. A second
writer is refused with one line that names the holder. The OS drops the lock of a process that dies (SIGKILL
included), so a later run acquires it at once; the dead holder's sidecar is then still there, and the new owner
says so (``reclaimed the lock of dead process N``) before replacing it.

The lock is per process: ``Trainer`` objects created one after the other in one process (a notebook, a test) on
the same directory share it, counted, and the last one to close (or be garbage-collected) releases it.

The outputs of the other commands (``cegppo eval --out``, ``compare --out``, ``sft --out``) are claimed the same way
by :class:`OutputLock`, from the check that the path is new until it is written: a second command with the same
``--out`` is refused naming the path and the holder.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import weakref
from contextlib import ExitStack, contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

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


def holder_record() -> dict:
    """Who holds a lock: this process, its host, since when, and its command line."""
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "since": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv)[:500]}


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


class _Held:
    """A lock object whose release is a ``weakref.finalize`` (run once: by ``release()``, on garbage collection, or
    at interpreter exit); ``acquire()`` is the subclass's."""

    _finalizer: weakref.finalize | None = None

    def acquire(self):  # pragma: no cover - each subclass takes its own lock
        raise NotImplementedError

    @property
    def held(self) -> bool:
        return self._finalizer is not None and self._finalizer.alive

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class RunLock(_Held):
    """``RunLock(run).acquire()`` takes the run's lock or raises :class:`RunLockedError`; ``release()`` (also run
    when the object is garbage-collected or the interpreter exits) gives it back."""

    def __init__(self, run: str | Path):
        self.run = Path(run)
        self.key = str(self.run.resolve())
        self._finalizer: weakref.finalize | None = None

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
        atomic_write_json(Path(self.key) / OWNER_FILE, holder_record())



# ---------------------------------------------------------------------------------------------------- outputs


class OutputInUseError(RunLockedError):
    """Another cegppo command is writing the same output path."""


OUTPUT_LOCK_SUFFIX = ".cegppo-lock"


def _drop_output_lock(fd: int, lock_path: str) -> None:
    """Remove the lock file while still holding it (so no one can take the old file after us), then unlock."""
    try:
        st, mine = os.stat(lock_path), os.fstat(fd)
        if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
            os.unlink(lock_path)
    except OSError:
        pass
    finally:
        os.close(fd)  # drops the flock


class OutputLock(_Held):
    """An exclusive claim on a path a command creates (a file or a directory), held from the check that it is new
    until it is written. The lock is a ``flock`` on a hidden sibling, ``.<name>.cegppo-lock`` (beside the output,
    never in it: an output directory must be new or empty), which holds the holder's record and is removed on
    release; the OS drops the lock of a process that dies, and the next claimant takes the file over.
    ``acquire()`` raises :class:`OutputInUseError` naming ``key`` and the path."""

    def __init__(self, path: str | Path, key: str = "--out"):
        self.path = Path(path)
        self.key = key
        self.lock_path = str(self.path.parent / f".{self.path.name}{OUTPUT_LOCK_SUFFIX}")
        self._finalizer: weakref.finalize | None = None

    def _holder(self) -> dict | None:
        try:
            owner = json.loads(Path(self.lock_path).read_text() or "null")
        except (OSError, ValueError):
            return None
        return owner if isinstance(owner, dict) else None

    def acquire(self) -> OutputLock:
        if self.held:
            return self
        for _ in range(16):  # a holder removing its file between our open and our flock: open the new one
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
                raise OutputInUseError(
                    f"{self.key} {self.path} is being written by another cegppo command "
                    f"({describe_owner(self._holder())}); wait for it to finish, or choose another path") from None
            try:
                st, mine = os.stat(self.lock_path), os.fstat(fd)
                if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        else:
            raise OutputInUseError(f"{self.key} {self.path}: could not claim {self.lock_path} (other commands keep "
                                   f"taking and releasing it); try again")
        try:
            previous = self._holder()
            if previous and previous.get("pid") != os.getpid():  # its process died holding it (the OS unlocked it)
                log.warning("%s %s: took over the claim of process %s on %s (since %s), which no longer holds it",
                            self.key, self.path, previous.get("pid"), previous.get("host"), previous.get("since"))
            record = json.dumps(holder_record()).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, record, 0)
        except BaseException:
            _drop_output_lock(fd, self.lock_path)
            raise
        self._finalizer = weakref.finalize(self, _drop_output_lock, fd, self.lock_path)
        return self



@contextmanager
def claim_outputs(paths: list[Path], key: str, check: Callable[[], None]) -> Iterator[None]:
    """Hold an :class:`OutputLock` on each new output in ``paths`` for the ``with`` block: ``check()`` (that they
    may be written) runs before the claim and again under it, since the command that held the claim until just now
    may have written them."""
    check()
    with ExitStack() as stack:
        for path in paths:
            stack.enter_context(OutputLock(path, key))
        check()
        yield
