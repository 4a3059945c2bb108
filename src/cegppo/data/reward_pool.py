"""Custom reward code (``reward.fn=module:function``) graded in worker processes, where it cannot end, hang or
change the run (issue 41, class 6), as verl runs its graders in a process pool.

Each worker is a fresh ``python -m cegppo.data.reward_pool`` in its own session: it imports the reward, then grades
one item at a time, each through the same :class:`~cegppo.data.rewards.RewardFn` rules as in-process (any exception,
``SystemExit`` included, or a result that is not a bool or finite number: an incorrect score, counted), with the
``SIGALRM`` per-item timer. The parent holds a hard deadline of its own per item (``timeout`` + :data:`GRACE_S`): a
reward that defeats the alarm (replaces the handler, loops on ``except BaseException``) has its worker killed, process
group and all, and the item counts as timed out. A reward that ends its process (``os._exit``, a crash) fails only
its item; a new worker takes over. ``chdir``, signal handlers, threads (non-daemon ones included: workers are killed
on :meth:`RewardPool.close` and at exit) and any global state stay in the worker. Replies are JSON lines on a
descriptor of their own (what the reward prints goes to stderr), read as data only: never unpickled.

The built-in math graders stay in-process: they are our code, and faster there (docs/reliability.md).
"""

from __future__ import annotations

import json
import math
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from pathlib import Path

from cegppo.data.rewards import RewardFn

GRACE_S = 1.0  # beyond the reward's timeout before the parent kills a worker (the in-worker alarm fires first)
START_S = 120.0  # a worker's start (interpreter, the reward's import)
MAX_WORKERS = 4
Graded = tuple  # (score, correct, failure message or None, the judged answer or None)


def default_workers() -> int:
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


class _Worker:
    def __init__(self, init: dict):
        src = str(Path(__file__).resolve().parents[2])  # so the worker imports this cegppo
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.proc = subprocess.Popen([sys.executable, "-m", "cegppo.data.reward_pool"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, start_new_session=True)
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.buffer = b""
        self.ready = False
        self.judge = False
        self.item: int | None = None  # the item in flight
        self.deadline = time.monotonic() + START_S
        self.send(init)

    def send(self, message: dict) -> bool:
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
            return True
        except OSError:  # it died: its EOF is read next
            return False

    def lines(self) -> list[bytes] | None:
        """Complete lines read so far; None at EOF (the worker ended)."""
        try:
            data = os.read(self.proc.stdout.fileno(), 1 << 16)
        except BlockingIOError:
            return []
        except OSError:
            data = b""
        if not data:
            return None
        self.buffer += data
        *done, self.buffer = self.buffer.split(b"\n")
        return done

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the reward's own children too
        except OSError:
            pass
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def ended(self) -> str:
        code = self.proc.wait()
        return f"signal {-code}" if code < 0 else f"status {code}"


def _close_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.kill()
    workers.clear()


def _reply(raw: bytes) -> Graded | None:
    """A worker's ``{"r": [score, correct, error, judged]}`` as data, None unless it has exactly that shape."""
    try:
        r = json.loads(raw)["r"]
        score, ok, err, judged = r
    except (ValueError, KeyError, TypeError):
        return None
    if (isinstance(score, (int, float)) and not isinstance(score, bool) and math.isfinite(score)
            and isinstance(ok, bool) and (err is None or isinstance(err, str))
            and (judged is None or isinstance(judged, str))):
        return float(score), ok, err, judged
    return None


class RewardPool:
    """Workers grading ``spec`` (module:function) with the given scores and per-item ``timeout``; started on the
    first call, kept until :meth:`close` (also run at exit)."""

    def __init__(self, spec: str, *, correct_score: float, incorrect_score: float, timeout: float | None,
                 workers: int | None = None):
        self.init = {"spec": spec, "correct": correct_score, "incorrect": incorrect_score, "timeout": timeout,
                     "path": [p for p in sys.path if isinstance(p, str)], "cwd": os.getcwd()}
        self.timeout = timeout
        self.size = workers or default_workers()
        self.workers: list[_Worker] = []
        self.judge: bool | None = None  # whether the reward reports the answers it judged (known once one started)
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _close_all, self.workers)

    def close(self) -> None:
        """Kill the workers (a later call starts new ones; the finalizer still kills those at exit)."""
        _close_all(self.workers)

    def grade(self, completions: list[str], answers: list[str]) -> list[Graded]:
        with self._lock:
            return self._grade(completions, answers)

    def _grade(self, completions: list[str], answers: list[str]) -> list[Graded]:
        try:
            return self._schedule(completions, answers)
        except BaseException:  # Ctrl-C, or a reward its workers cannot load: none is left mid-item
            _close_all(self.workers)
            raise

    def _schedule(self, completions: list[str], answers: list[str]) -> list[Graded]:
        results: list[Graded | None] = [None] * len(completions)
        todo = deque(range(len(completions)))
        want = min(self.size, len(todo))
        while len(self.workers) < want:
            self.workers.append(_Worker(self.init))
        sel = selectors.DefaultSelector()
        try:
            for w in self.workers:
                sel.register(w.proc.stdout, selectors.EVENT_READ, w)
            while todo or any(w.item is not None for w in self.workers):
                for w in self.workers:  # hand out work
                    if w.ready and w.item is None and todo:
                        w.item = todo.popleft()
                        w.deadline = (time.monotonic() + self.timeout + GRACE_S) if self.timeout else math.inf
                        w.send({"i": w.item, "c": completions[w.item], "a": answers[w.item]})
                deadline = min((w.deadline for w in self.workers if w.item is not None or not w.ready),
                               default=math.inf)
                wait = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
                for key, _ in sel.select(wait):
                    self._read(key.data, results, sel, todo, completions)
                now = time.monotonic()
                for w in list(self.workers):
                    if (w.item is not None or not w.ready) and now >= w.deadline:
                        how = (f"timed out after {self.timeout:g} s (its process was killed: the reward did not "
                               f"stop at the alarm)" if w.ready else f"the reward process did not start in {START_S:g} s")
                        self._replace(w, sel, todo, results, how, completions)
        finally:
            sel.close()
        return results  # type: ignore[return-value]

    def _read(self, w: _Worker, results: list, sel, todo: deque, completions: list[str]) -> None:
        lines = w.lines()
        if lines is None:
            self._replace(w, sel, todo, results, f"the reward ended its process ({w.ended()})", completions)
            return
        for raw in lines:
            if not w.ready:
                try:
                    hello = json.loads(raw)
                except ValueError:
                    hello = {"error": "unreadable start message"}
                if "error" in hello:  # it cannot grade anything: every item would fail the same way
                    raise ValueError(f"reward {self.init['spec']!r}: its worker process could not load it: "
                                     f"{' '.join(str(hello['error']).split())[:300]}")
                w.ready, w.judge = True, bool(hello.get("judge"))
                self.judge = w.judge
                continue
            graded = _reply(raw)
            if w.item is None:
                continue
            results[w.item] = graded or (self.init["incorrect"], False, "the reward process sent an unreadable reply",
                                         None)
            w.item = None

    def _replace(self, w: _Worker, sel, todo: deque, results: list, why: str, completions: list[str]) -> None:
        """Kill ``w``, fail its item with ``why``, and start another worker if work remains."""
        if not w.ready:  # it never loaded the reward (its own error is on stderr): no worker would
            raise ValueError(f"reward {self.init['spec']!r}: its worker process could not load it: {why}")
        if w.item is not None:
            results[w.item] = (self.init["incorrect"], False, why, None)
            w.item = None
        sel.unregister(w.proc.stdout)
        w.kill()
        self.workers.remove(w)
        if todo and len(self.workers) < self.size:
            fresh = _Worker(self.init)
            self.workers.append(fresh)
            sel.register(fresh.proc.stdout, selectors.EVENT_READ, fresh)


class PooledRewardFn(RewardFn):
    """A user's reward (``spec``, module:function, already imported here as ``scorer`` to check it) graded by a
    :class:`RewardPool`: the same results as :class:`RewardFn`, from worker processes."""

    def __init__(self, spec: str, scorer, *, workers: int | None = None, **kwargs) -> None:
        super().__init__(scorer, **kwargs)
        self.pool = RewardPool(spec, correct_score=self.correct_score, incorrect_score=self.incorrect_score,
                               timeout=self.timeout, workers=workers)

    def grade_all(self, completions: list[str], answers: list[str]) -> list[tuple]:
        return self.pool.grade(list(completions), list(answers))

    def grade_one(self, completion: str, answer: str) -> tuple:
        return self.grade_all([completion], [answer])[0]

    def close(self) -> None:
        self.pool.close()


# ------------------------------------------------------------------------------------------------------ worker


def _watch_parent(parent: int) -> None:
    while True:  # the parent died (killed): end, whatever the reward's threads are doing
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def worker_main() -> None:
    """The worker: protocol on private descriptors (what the reward prints or reads never touches it)."""
    inp = os.fdopen(os.dup(0), "rb")
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    sys.stdin, sys.stdout = open(os.devnull), sys.stderr
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()

    def reply(message: dict) -> None:
        out.write((json.dumps(message) + "\n").encode())
        out.flush()

    init = json.loads(inp.readline())
    sys.path[:0] = [p for p in init["path"] if p not in sys.path]
    try:
        os.chdir(init["cwd"])
        from cegppo.data.rewards import RewardFn, _import_scorer

        fn = RewardFn(_import_scorer(init["spec"]), correct_score=init["correct"],
                      incorrect_score=init["incorrect"], timeout=init["timeout"], name=init["spec"])
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which refuses the reward
        reply({"error": f"{type(e).__name__}: {e}"})
        os._exit(1)
    reply({"ready": True, "judge": fn.judge is not None})
    for line in inp:
        item = json.loads(line)
        score, ok, err, judged = fn.grade_one(item["c"], item["a"])
        reply({"i": item["i"], "r": [score, ok, err, judged]})
    os._exit(0)  # stdin closed: the parent is done (threads the reward started end here too)


if __name__ == "__main__":
    worker_main()
