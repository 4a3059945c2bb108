"""Issue 41, class 6: a user's reward code runs in worker processes, where it cannot end, hang or change the run:
`os._exit` fails one item, a reward that defeats the alarm is killed at its deadline, a non-daemon thread does not
keep the process alive, `chdir`, signal handlers and the environment stay in the worker, what it prints cannot
corrupt the replies; the grades equal the in-process ones (docs/reliability.md). Each hostile case runs in a child
interpreter with a timeout, so that a regression shows as a failure, not as a hung or ended test session."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cegppo.data.reward_pool import GRACE_S, PooledRewardFn
from cegppo.data.rewards import RewardFn, load_reward

ROOT = Path(__file__).resolve().parents[1]
HOSTILE = '''
import os, signal, sys, threading, time

def exits(c, g):
    if c == "exit":
        os._exit(0)
    return c == g

def crashes(c, g):
    os.kill(os.getpid(), signal.SIGSEGV)

def alarm_proof(c, g):
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    while True:
        try:
            time.sleep(10)
        except BaseException:
            pass

def thread(c, g):
    threading.Thread(target=time.sleep, args=(3600,)).start()  # non-daemon: would keep the process alive
    return True

def meddles(c, g):
    os.chdir("/")
    os.environ["CEGPPO_MEDDLED"] = "1"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print('{"i": 0, "r": [99.0, true, null, null]}')  # on stdout: must not pass for a reply
    sys.stdout.flush()
    sys.stdin.read()
    return c == g
'''

RUN = '''
import json, os, signal, sys
sys.path.insert(0, sys.argv[1])
signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever the launcher left (a background job: ignored)
from cegppo.data.rewards import load_reward
r = load_reward(sys.argv[2], timeout=float(sys.argv[3]), incorrect_score=0.0)
res = r(json.loads(sys.argv[4]), json.loads(sys.argv[5]))
print(json.dumps({"scores": res.scores, "failed": res.failed, "timed_out": res.timed_out,
                  "messages": res.failure_messages, "cwd": os.getcwd(), "env": os.environ.get("CEGPPO_MEDDLED"),
                  "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler}))
'''


@pytest.fixture
def hostile(tmp_path) -> Path:
    (tmp_path / "hostile_rewards.py").write_text(HOSTILE)
    return tmp_path


def grade(path: Path, fn: str, completions: list[str], golds: list[str], timeout: float = 2.0,
          limit: float = 60.0) -> tuple[dict, float]:
    """Grade in a child interpreter (which must end by itself within ``limit`` seconds): its result, its time."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", RUN, str(path), f"hostile_rewards:{fn}", str(timeout),
                        json.dumps(completions), json.dumps(golds)], capture_output=True, text=True, timeout=limit,
                       env=env, cwd=path)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), time.monotonic() - t0


def test_a_reward_that_ends_its_process_fails_only_its_item(hostile):
    res, _ = grade(hostile, "exits", ["1", "exit", "3", "x"], ["1", "2", "3", "4"])
    assert res["scores"] == [1.0, 0.0, 1.0, 0.0] and res["failed"] == [False, True, False, False]
    assert res["messages"] == ["item 1: the reward ended its process (status 0)"]
    res, _ = grade(hostile, "crashes", ["1"], ["1"])
    assert res["messages"] == [f"item 0: the reward ended its process (signal {int(signal.SIGSEGV)})"]


def test_a_reward_that_defeats_the_alarm_is_killed_at_its_deadline(hostile):
    res, took = grade(hostile, "alarm_proof", ["1", "2"], ["1", "2"], timeout=0.2)
    assert res["failed"] == res["timed_out"] == [True, True] and res["scores"] == [0.0, 0.0]
    assert res["messages"][0] == ("item 0: timed out after 0.2 s (its process was killed: the reward did not stop "
                                  "at the alarm)")
    assert took < 30  # each item: 0.2 s + GRACE_S, in parallel workers


def test_a_non_daemon_thread_does_not_keep_the_run_alive(hostile):
    res, took = grade(hostile, "thread", ["1", "2"], ["1", "2"], limit=60)
    assert res["scores"] == [1.0, 1.0] and took < 60  # the child interpreter ended


def test_the_reward_cannot_change_the_run(hostile):
    """chdir, the environment, a signal handler, stdout and stdin: all the worker's own."""
    res, _ = grade(hostile, "meddles", ["1", "2"], ["1", "3"])
    assert res["scores"] == [1.0, 0.0] and not any(res["failed"])
    assert res["cwd"] == str(hostile) and res["env"] is None and res["sigint"]


def test_os_exit_in_a_reward_no_longer_ends_cegppo_eval_with_rc_0(hostile):
    """The issue's example: `os._exit` in a reward ended the run with rc 0; now every item is a counted failure and
    `cegppo eval` says the scorer failed on every item (exit 2)."""
    (hostile / "exit_always.py").write_text("import os\ndef f(c, g):\n    os._exit(0)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hostile), str(ROOT / "src")])}
    p = subprocess.run([sys.executable, "-m", "cegppo.cli", "eval", "--model", "tiny", "--data", "arithmetic",
                        "--num-problems", "2", "--reward", "exit_always:f"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "| arithmetic | 2 | 0.0000 | 0.0000 | 0.0000 | 2 of 2 (0) |" in p.stdout
    assert "the reward ended its process (status 0)" in p.stderr.splitlines()[-1]


def test_pooled_grades_equal_the_in_process_ones(tmp_path, monkeypatch):
    from fixtures.rewards import digit_overlap

    completions = [f"text {i} {i * 7 % 10}" for i in range(40)] + ["\\boxed{3}", ""]
    golds = [str(i % 13) for i in range(40)] + ["3", "1"]
    pooled = load_reward("fixtures.rewards:digit_overlap", timeout=5.0)
    assert isinstance(pooled, PooledRewardFn)
    try:
        assert pooled(completions, golds) == RewardFn(digit_overlap, timeout=5.0, name=pooled.name)(completions, golds)
        # the built-in graders run in-process, where they are faster (figures in docs/reliability.md)
        assert type(load_reward("math-strict")) is RewardFn and type(load_reward("math")) is RewardFn
        # a judged answer comes back from the workers as well
        from cegppo.data.rewards import math_strict

        judged = PooledRewardFn("cegppo.data.rewards:math_strict", math_strict, timeout=5.0)
        try:
            assert judged(["so \\boxed{4}", "\\boxed{5}"], ["4", "4"]).answers == ["4", "5"]
        finally:
            judged.close()
        pids = [w.proc.pid for w in pooled.pool.workers]
    finally:
        pooled.close()
    assert pids and not pooled.pool.workers and GRACE_S > 0
    for pid in pids:  # killed and reaped: a non-daemon thread of the reward cannot keep a worker alive
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_reward_its_workers_cannot_load_is_refused_in_one_line(tmp_path, monkeypatch):
    """A module the parent imported but a fresh interpreter cannot (it is found only through state the parent
    built up): one ValueError naming the reward, not an item-by-item failure."""
    mod = tmp_path / "only_here.py"
    mod.write_text("def f(c, g):\n    return True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    r = load_reward("only_here:f")
    mod.unlink()
    try:
        with pytest.raises(ValueError, match=r"reward 'only_here:f': its worker process could not load it: "
                                             r"ValueError: reward 'only_here:f': cannot import module 'only_here'"):
            r(["1"], ["1"])
    finally:
        r.close()
