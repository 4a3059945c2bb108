import math
import signal
import textwrap
import threading
import time

import pytest

from cegppo.data.rewards import RewardFn, RewardResult, last_boxed, load_reward, math_reward

# (completion, gold, strict, lenient)
CASES = [
    ("So 17 + 25 = 42. The answer is \\boxed{42}.", "42", True, True),
    ("The answer is \\boxed{41}.", "42", False, False),
    ("17 + 25 = 32\n\nThe answer is \\boxed{}.", "32", False, True),  # empty box; lenient takes 32
    ("The final answer is 42", "42", False, True),  # unboxed
    ("\\boxed{\\frac{1}{2}}", "0.5", True, True),
    ("\\boxed{0.5}", "\\frac{1}{2}", True, True),
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", True, True),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", True, True),
    ("\\boxed{\\sqrt{2}}", "2^{1/2}", True, True),
    ("$x$ is \\boxed{(x+1)^{2}}", "x^2+2x+1", True, True),  # nested braces
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", True, True),
    ("first \\boxed{41}, corrected: \\boxed{42}", "42", True, False),  # strict: last box wins;
    ("first \\boxed{42}, corrected: \\boxed{41}", "42", False, False),  # lenient: math-verify sees a set
    ("\\boxed{42} and then cut off \\boxed{4", "42", True, True),  # unclosed trailing box skipped
    ("\\boxed{N}", "42", False, False),
    ("", "42", False, False),
    ("\\boxed{ 540 }", "540", True, True),
]


@pytest.mark.parametrize("completion, gold, strict, lenient", CASES)
def test_strict_vs_lenient(completion, gold, strict, lenient):
    assert math_reward(completion, gold, mode="strict") is strict
    assert math_reward(completion, gold, mode="lenient") is lenient


def test_last_boxed():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{a}{b}} c") == "\\frac{a}{b}"
    assert last_boxed("\\boxed {7}") == "7"
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{") is None
    assert last_boxed("\\boxed{}") == ""


def test_bad_mode():
    with pytest.raises(ValueError, match="mode must be"):
        math_reward("x", "1", mode="loose")


def test_graders_work_off_main_thread():
    out = []
    t = threading.Thread(target=lambda: out.append((
        math_reward("\\boxed{\\frac{1}{2}}", "0.5", mode="strict"),
        math_reward("answer: 0.5", "\\frac{1}{2}", mode="lenient"),
        load_reward("math-strict")(["\\boxed{3}", "\\boxed{4}"], ["3", "3"]).scores)))
    t.start()
    t.join()
    assert out == [(True, True, [1.0, -1.0])]


def test_reward_fn_scores():
    r = load_reward("math-strict")
    res = r(["\\boxed{3}", "3", "\\boxed{4}"], ["3", "3", "3"])
    assert isinstance(res, RewardResult)
    assert res.scores == [1.0, -1.0, -1.0] and res.correct == [True, False, False] and res.failures == 0
    r0 = load_reward("math-lenient", incorrect_score=0.0)
    assert r0(["\\boxed{3}", "3", "\\boxed{4}"], ["3", "3", "3"]).scores == [1.0, 1.0, 0.0]
    assert load_reward("math").scorer is load_reward("math-lenient").scorer
    with pytest.raises(ValueError, match="completions but"):
        r(["a"], [])


def test_reward_fn_rejects_bad_config():
    with pytest.raises(ValueError, match="incorrect_score"):
        RewardFn(lambda c, a: True, correct_score=0.0, incorrect_score=1.0)
    with pytest.raises(ValueError, match="timeout"):
        RewardFn(lambda c, a: True, timeout=0)


def test_float_scores():
    r = RewardFn(lambda c, a: 0.25 if c == "part" else 1.0, incorrect_score=0.0)
    res = r(["part", "full"], ["x", "x"])
    assert res.scores == [0.25, 1.0] and res.correct == [False, True] and res.failures == 0


def _raises(c, a):
    raise RuntimeError("boom")


def _hangs(c, a):
    time.sleep(30)
    return True


def _swallows(c, a):
    # catches everything it can and keeps sleeping: still timed out
    for _ in range(300):
        try:
            time.sleep(0.1)
        except Exception:
            pass
    return True


@pytest.mark.parametrize("scorer, msg", [
    (_raises, "RuntimeError: boom"),
    (lambda c, a: float("nan"), "scorer returned nan"),
    (lambda c, a: None, "scorer returned None"),
    (lambda c, a: "yes", "scorer returned 'yes'"),
    (lambda c, a: math.inf, "scorer returned inf"),
    (_hangs, "timed out after 0.2 s"),
    (_swallows, "timed out after 0.2 s"),
])
def test_failures_are_counted_not_raised(scorer, msg):
    r = RewardFn(lambda c, a: scorer(c, a) if c == "bad" else c == a, timeout=0.2)
    t0 = time.monotonic()
    res = r(["bad", "ok", "bad", "no"], ["x", "ok", "x", "x"])
    assert time.monotonic() - t0 < 20  # two 30 s hangs were cut short
    assert res.scores == [-1.0, 1.0, -1.0, -1.0]
    assert res.correct == [False, True, False, False]
    assert res.failures == 2
    assert len(res.failure_messages) == 2 and msg in res.failure_messages[0]
    assert res.failure_messages[0].startswith("item 0:")
    # the alarm is cleaned up afterwards
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_failure_messages_capped():
    res = RewardFn(_raises, max_messages=3)(["a"] * 10, ["b"] * 10)
    assert res.failures == 10 and len(res.failure_messages) == 3


def test_outer_timer_is_restored():
    fired = []
    old = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 5.0)
        load_reward("math-strict", timeout=1.0)(["\\boxed{1}"], ["1"])
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 3.0 < remaining <= 5.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert not fired


def test_math_verify_inside_timer_still_times_out_hangs():
    # math-verify's own signal.alarm(0) must not cancel our timer for the rest of the scorer.
    def scorer(c, a):
        ok = math_reward(c, a)
        time.sleep(30)
        return ok

    res = RewardFn(scorer, timeout=0.3)(["\\boxed{1}"], ["1"])
    assert res.failures == 1 and "timed out" in res.failure_messages[0]


def test_user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        NOT_CALLABLE = 3
        def exact(completion, ground_truth):
            return completion.strip() == ground_truth
        def partial(completion, ground_truth):
            return 0.5
        class Ns:
            @staticmethod
            def f(c, g):
                return True
    """))
    (tmp_path / "broken_mod.py").write_text("raise RuntimeError('import-time failure')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    r = load_reward("my_rewards:exact", incorrect_score=0.0)
    assert r([" 7 ", "8"], ["7", "7"]).scores == [1.0, 0.0]
    assert load_reward("my_rewards:partial")(["x"], ["y"]).scores == [0.5]
    assert load_reward("my_rewards:Ns.f")(["x"], ["y"]).correct == [True]
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod_xyz'"):
        load_reward("no_such_mod_xyz:f")
    with pytest.raises(ValueError, match="cannot import module 'broken_mod'.*import-time failure"):
        load_reward("broken_mod:f")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        load_reward("my_rewards:missing")
    with pytest.raises(ValueError, match="not callable"):
        load_reward("my_rewards:NOT_CALLABLE")
    with pytest.raises(ValueError, match="expected 'module:function'"):
        load_reward("my_rewards:")
    with pytest.raises(ValueError, match="unknown reward 'mathh'"):
        load_reward("mathh")


class _BadRepr:
    def __repr__(self):
        raise SystemExit("from __repr__")


class _HugeRepr:
    def __repr__(self):
        return "x\n" * 1_000_000


def _no_truth(self):
    raise RuntimeError("no truth value")


_BadBool = type("bool_", (), {"__module__": "numpy", "__bool__": _no_truth})  # looks like numpy.bool_


def _exits(c, a):
    raise SystemExit(3)


def _exits_none(c, a):
    import sys
    sys.exit()


class _CustomBase(BaseException):
    pass


def _raises_base(c, a):
    raise _CustomBase("odd")


def _raises_generator_exit(c, a):
    raise GeneratorExit()


def _raises_unprintable(c, a):
    class E(Exception):
        def __str__(self):
            raise ValueError("cannot print")
    raise E()


@pytest.mark.parametrize("scorer, msg", [
    (_exits, "SystemExit: 3"),
    (_exits_none, "SystemExit"),
    (_raises_base, "_CustomBase: odd"),
    (_raises_generator_exit, "GeneratorExit"),
    (_raises_unprintable, "<unprintable E>"),
    (lambda c, a: 10**400, "too large for a float"),
    (lambda c, a: -(10**400), "too large for a float"),
    (lambda c, a: -math.inf, "scorer returned -inf"),
    (lambda c, a: [1.0], "scorer returned [1.0] (list)"),
    (lambda c, a: list(range(10**6)), "(list)"),
    (lambda c, a: {"score": 1}, "(dict)"),
    (lambda c, a: object(), "(object)"),
    (lambda c, a: _BadRepr(), "<unprintable _BadRepr>"),
    (lambda c, a: _HugeRepr(), "(_HugeRepr)"),
    (lambda c, a: _BadBool(), "RuntimeError: no truth value"),
    (lambda c, a: 1j, "(complex)"),
    (lambda c, a: b"1", "(bytes)"),
])
def test_user_code_cannot_end_a_run(scorer, msg):
    """Anything a reward raises (SystemExit included) or returns (huge ints, +-inf, lists, arrays, objects whose
    repr fails or is huge) is one counted failure with a bounded one-line message; the batch goes on."""
    r = RewardFn(lambda c, a: scorer(c, a) if c == "bad" else c == a, timeout=2.0)
    res = r(["bad", "ok"], ["x", "ok"])
    assert res.scores == [-1.0, 1.0] and res.correct == [False, True] and res.failures == 1
    (m,) = res.failure_messages
    assert msg in m and "\n" not in m and len(m) <= 300, m
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_numpy_results():
    np = pytest.importorskip("numpy")
    r = RewardFn(lambda c, a: {"t": np.bool_(True), "f": np.float64(0.5), "a": np.array([1.0, 2.0]),
                               "n": np.float32("nan"), "z": np.array(1.0)}[c], incorrect_score=0.0)
    res = r(["t", "f", "a", "n", "z"], ["x"] * 5)
    assert res.scores == [1.0, 0.5, 0.0, 0.0, 0.0] and res.correct == [True, False, False, False, False]
    assert res.failures == 3 and "ndarray" in res.failure_messages[0]


def test_keyboard_interrupt_still_stops():
    def ctrl_c(c, a):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        RewardFn(ctrl_c, timeout=1.0)(["a"], ["a"])
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_hang_in_the_result_is_timed_out():
    class Slow:
        def __float__(self):
            time.sleep(30)
            return 1.0

    import numbers
    numbers.Real.register(Slow)
    t0 = time.monotonic()
    res = RewardFn(lambda c, a: Slow(), timeout=0.2)(["a"], ["a"])
    assert time.monotonic() - t0 < 10 and res.failures == 1 and "timed out" in res.failure_messages[0]


@pytest.mark.parametrize("timeout", [math.inf, -math.inf, math.nan, 0, -1, 3601, 1e300, True, "5"])
def test_timeout_must_be_finite_and_bounded(timeout):
    with pytest.raises(ValueError, match=r"timeout must be a number of seconds in \(0, 3600\]"):
        RewardFn(lambda c, a: True, timeout=timeout)


@pytest.mark.parametrize("scores", [(math.inf, -1.0), (1.0, -math.inf), (math.nan, 0.0), (1.0, math.nan)])
def test_scores_must_be_finite(scores):
    with pytest.raises(ValueError, match="must be a finite number"):
        RewardFn(lambda c, a: True, correct_score=scores[0], incorrect_score=scores[1])


def test_no_math_verify_timeout_warning(caplog, monkeypatch):
    """Our per-item timer guards the grader, so math-verify's "Timeout is disabled" warning never shows."""
    import logging

    import math_verify.grader
    import math_verify.parser

    from cegppo.data.rewards import load_reward

    monkeypatch.setattr(math_verify.parser, "TIMEOUT_WARNING_SHOWN", False)  # as in a fresh process
    monkeypatch.setattr(math_verify.grader, "TIMEOUT_WARNING_SHOWN", False)

    with caplog.at_level(logging.WARNING):
        result = load_reward("math-lenient", timeout=5.0)(["so \\boxed{\\frac{1}{2}}", "x"], ["0.5", "3"])
    assert result.correct == [True, False]
    assert "Timeout is disabled" not in caplog.text
