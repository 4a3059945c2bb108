"""Verifiable rewards: math-verify graders (strict = last \\boxed{} only, lenient = paper-style) and a
robust wrapper (`RewardFn`) that maps any scorer failure (any exception, `SystemExit` included; a timeout;
a result that is not a bool or a finite float: NaN, inf, an int too large for a float, None, a list, an
array, any other object) to an incorrect score, counts it, and never lets it propagate into the training
loop. Only a KeyboardInterrupt (the user's Ctrl-C) goes through.

Model output is only ever parsed by math-verify / string operations; it is never evaluated.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import numbers
import re
import reprlib
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger(__name__)

Scorer = Callable[[str, str], "float | bool"]
MODES = ("strict", "lenient")
BUILTIN_SPECS = ("math", "math-strict", "math-lenient")
MAX_TIMEOUT_S = 3600.0  # a per-item timeout is a finite number of seconds in (0, MAX_TIMEOUT_S]

# Set while RewardFn's own SIGALRM timer is armed: math-verify's internal timeouts also use SIGALRM
# (signal.alarm) and cancel any outer timer on exit, so inside RewardFn they must be switched off.
_outer_timer_active = False
_warned_no_timeout = False


def _mv_timeouts_allowed() -> bool:
    # signal-based timeouts only work in the main thread (math-verify raises ValueError elsewhere).
    return threading.current_thread() is threading.main_thread() and not _outer_timer_active


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """Content of the last complete \\boxed{...} (nested braces handled); None if there is none.

    An unclosed trailing box (a truncated completion) is skipped in favour of the last closed one.
    """
    for m in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, m.end()
        for i in range(start, len(text)):
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def _quiet_math_verify() -> None:
    """math-verify warns "Timeout is disabled ... provide the logic for timeout interruption yourself" the first
    time it runs without its own timer. Inside RewardFn we do exactly that (the per-item ``reward.timeout_s``
    alarm interrupts a hung grader), so mark the warning as shown instead of printing it on every run."""
    import math_verify.grader
    import math_verify.parser

    math_verify.parser.TIMEOUT_WARNING_SHOWN = math_verify.grader.TIMEOUT_WARNING_SHOWN = True


def _parse(text: str) -> list:
    from math_verify import parse

    if _mv_timeouts_allowed():
        return parse(text)
    _quiet_math_verify()
    return parse(text, parsing_timeout=None)


def _verify(gold: list, pred: list) -> bool:
    from math_verify import verify

    if _mv_timeouts_allowed():
        return bool(verify(gold, pred))
    _quiet_math_verify()
    return bool(verify(gold, pred, timeout_seconds=None))


@functools.lru_cache(maxsize=4096)
def _gold(ground_truth: str) -> tuple:
    # The same few golds are graded many times per step (group of n samples); parse them once.
    return tuple(_parse(f"\\boxed{{{ground_truth}}}"))


def _judged_text(parsed: list) -> str | None:
    """The text of math-verify's extraction (its string form; else the expression's), None for no extraction."""
    texts = [p for p in parsed if isinstance(p, str) and p.strip()]
    if texts:
        return texts[-1].strip()
    return (str(parsed[0]).strip() or None) if parsed else None


def judge_math(completion: str, ground_truth: str, *, mode: str = "strict") -> tuple[bool, str | None]:
    """(is `completion` correct for `ground_truth`, the answer that verdict rests on: the extraction the grader
    compared with the gold, stripped; None when it found none). See :func:`math_reward`."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    gt = ground_truth.strip()
    if mode == "strict":
        content = last_boxed(completion)
        if content is None or not content.strip():
            return False, None
        if content.strip() == gt:
            return True, content.strip()
        return _verify(list(_gold(gt)), _parse(f"\\boxed{{{content}}}")), content.strip()
    if not completion.strip():
        return False, None
    parsed = _parse(completion)
    answer = _judged_text(parsed)
    if any(isinstance(p, str) and p.strip() == gt for p in parsed):
        return True, answer
    return bool(parsed) and _verify(list(_gold(gt)), parsed), answer


def math_reward(completion: str, ground_truth: str, *, mode: str = "strict") -> bool:
    """Is `completion` correct for `ground_truth`?

    strict: only the content of the last \\boxed{...} counts; no box or an empty box is wrong.
    lenient: math-verify's own extraction on the whole completion (the authors' reward: last boxed answer,
    else last LaTeX/number), plus an exact string match of the gold. The paper's reward.
    """
    return judge_math(completion, ground_truth, mode=mode)[0]


def math_strict(completion: str, ground_truth: str) -> bool:
    return math_reward(completion, ground_truth, mode="strict")


def math_lenient(completion: str, ground_truth: str) -> bool:
    return math_reward(completion, ground_truth, mode="lenient")


# A scorer may carry ``judge(completion, ground_truth) -> (bool | float, answer: str | None)``: the same verdict
# and the answer it judged, which maj@k votes over (cegppo.engine.evaluation); the built-in rewards do.
math_strict.judge = functools.partial(judge_math, mode="strict")  # type: ignore[attr-defined]
math_lenient.judge = functools.partial(judge_math, mode="lenient")  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------------------------------


TIMEOUT_PREFIX = "timed out after"  # how a per-item timeout's failure message starts


@dataclass
class RewardResult:
    """One batch's grades. ``failures`` counts the items the scorer failed on (raised, timed out or returned
    garbage: each scored incorrect), ``timeouts`` the timed-out ones among them; ``failed`` / ``timed_out`` flag
    each item (empty when the producer of the result does not track items). ``answers`` holds, per item, the answer
    the scorer judged when it reports one (a scorer with a ``judge``, as the built-in math rewards: their extraction;
    None where it found none or failed); it is empty when the scorer reports none (maj@k then votes over the
    normalised responses)."""

    scores: list[float]
    correct: list[bool]
    failures: int = 0
    failure_messages: list[str] = field(default_factory=list)
    timeouts: int = 0
    failed: list[bool] = field(default_factory=list)
    timed_out: list[bool] = field(default_factory=list)
    answers: list[str | None] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct) if self.correct else 0.0


class _ScorerTimeout(BaseException):
    # BaseException so a scorer's `except Exception:` cannot swallow it.
    pass


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlong = 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6
_REPR.maxlevel = 2


def _text(obj: object, limit: int = 160) -> str:
    """A bounded one-line description of a scorer's exception or result; never raises (but for a Ctrl-C or
    our own timeout): user objects may fail in __repr__/__str__, or describe themselves at any length."""
    try:
        text = str(obj) if isinstance(obj, BaseException) else _REPR.repr(obj)
    except (KeyboardInterrupt, _ScorerTimeout):
        raise
    except BaseException:  # noqa: BLE001 - a broken __repr__ is one more scorer failure, not a crash
        text = f"<unprintable {type(obj).__name__}>"
    return " ".join(text.split())[:limit]


class RewardFn:
    """Wrap `scorer(completion, ground_truth) -> bool | float` into a batch reward that never raises.

    bool results map to correct_score / incorrect_score; a number is used as the score directly and
    counts as correct when >= correct_score. Anything the scorer raises (SystemExit included; only a
    KeyboardInterrupt propagates), timeouts (per item, `timeout` seconds in (0, 3600], main thread only),
    and any result that is not a bool or a finite float (NaN, inf, an int that overflows a float, None,
    lists, arrays, other objects) score incorrect_score and are counted in `failures`.

    A scorer that carries ``judge(completion, ground_truth) -> (bool | float, answer: str | None)`` is graded
    through it: the same verdict, plus the answer it judged (``RewardResult.answers``, which maj@k votes over).
    """

    def __init__(self, scorer: Scorer, *, correct_score: float = 1.0, incorrect_score: float = -1.0,
                 timeout: float | None = 10.0, name: str | None = None, max_messages: int = 5):
        if not callable(scorer):
            raise TypeError(f"scorer must be callable, got {type(scorer).__name__}")
        for key, v in (("correct_score", correct_score), ("incorrect_score", incorrect_score)):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
                raise ValueError(f"{key} must be a finite number, got {v!r:.60}")
        if not incorrect_score < correct_score:
            raise ValueError(f"incorrect_score ({incorrect_score}) must be < correct_score ({correct_score})")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                                    or not 0 < float(timeout) <= MAX_TIMEOUT_S):
            raise ValueError(f"timeout must be a number of seconds in (0, {MAX_TIMEOUT_S:g}] or None, "
                             f"got {timeout!r:.60}")
        self.scorer = scorer
        judge = getattr(scorer, "judge", None)
        self.judge: Callable[[str, str], tuple] | None = judge if callable(judge) else None
        self.correct_score = float(correct_score)
        self.incorrect_score = float(incorrect_score)
        self.timeout = None if timeout is None else float(timeout)
        self.name = name or getattr(scorer, "__name__", repr(scorer))
        self.max_messages = max_messages

    def __repr__(self) -> str:
        return (f"RewardFn({self.name}, correct={self.correct_score}, incorrect={self.incorrect_score}, "
                f"timeout={self.timeout})")

    def __call__(self, completions: list[str], answers: list[str]) -> RewardResult:
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        res = RewardResult(scores=[], correct=[])
        for i, (score, ok, err, judged) in enumerate(self.grade_all(completions, answers)):
            if self.judge is not None:
                res.answers.append(judged)
            res.scores.append(score)
            res.correct.append(ok)
            res.failed.append(err is not None)
            res.timed_out.append(err is not None and err.startswith(TIMEOUT_PREFIX))
            res.timeouts += res.timed_out[-1]
            if err is not None:
                res.failures += 1
                if len(res.failure_messages) < self.max_messages:
                    res.failure_messages.append(f"item {i}: {err}"[:300])
        return res

    def grade_all(self, completions: list[str], answers: list[str]) -> list[tuple]:
        """:meth:`grade_one` of every item (a pooled reward grades them in worker processes)."""
        return [self.grade_one(c, a) for c, a in zip(completions, answers)]

    def close(self) -> None:
        """Release what grading holds (worker processes of a pooled reward); nothing in-process."""

    def score_one(self, completion: str, answer: str) -> tuple[float, bool, str | None]:
        """(score, correct, failure message or None)."""
        return self.grade_one(completion, answer)[:3]

    def grade_one(self, completion: str, answer: str) -> tuple[float, bool, str | None, str | None]:
        """(score, correct, failure message or None, the answer the scorer's ``judge`` judged or None)."""
        try:
            return self._run(completion, answer)
        except _ScorerTimeout:
            return self.incorrect_score, False, f"{TIMEOUT_PREFIX} {self.timeout:g} s", None
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - the timer itself failed: still one counted failure
            return self.incorrect_score, False, f"{type(e).__name__}: {_text(e)}", None

    def _score(self, completion: str, answer: str) -> tuple[float, bool, str | None, str | None]:
        """Call the scorer (its ``judge`` where it has one) and interpret its result; runs under the timer (a hang
        in the result's own __bool__/__float__/__repr__ is cut too). Only a KeyboardInterrupt or our timeout
        escapes."""
        if self.judge is None:
            return (*self._verdict(completion, answer, self.scorer), None)
        judged: list = [None]

        def verdict(c: str, a: str) -> object:
            out = self.judge(c, a)  # type: ignore[misc]
            if not (isinstance(out, tuple) and len(out) == 2 and (out[1] is None or isinstance(out[1], str))):
                raise TypeError(f"judge returned {_text(out, 60)}; expected (verdict, answer: str or None)")
            judged[0] = None if out[1] is None else str.__str__(out[1])  # a plain str (no user __eq__/__hash__)
            return out[0]

        score, ok, err = self._verdict(completion, answer, verdict)
        return score, ok, err, judged[0] if err is None else None

    def _verdict(self, completion: str, answer: str, scorer: Callable) -> tuple[float, bool, str | None]:
        try:
            value = scorer(completion, answer)
            if isinstance(value, bool) or (type(value).__module__ == "numpy"
                                           and type(value).__name__ in ("bool_", "bool")):  # numpy 1 / 2
                return (self.correct_score, True, None) if value else (self.incorrect_score, False, None)
            if isinstance(value, numbers.Real):
                try:
                    score = float(value)
                except OverflowError:
                    return self.incorrect_score, False, f"scorer returned {_text(value, 40)} " \
                                                        f"({type(value).__name__}), too large for a float"
                if math.isfinite(score):
                    return score, score >= self.correct_score, None
            return self.incorrect_score, False, f"scorer returned {_text(value, 60)} ({type(value).__name__}); " \
                                                f"expected bool or a finite float"
        except (KeyboardInterrupt, _ScorerTimeout):
            raise
        except BaseException as e:  # noqa: BLE001 - SystemExit too: user code cannot end a run
            return self.incorrect_score, False, f"{type(e).__name__}: {_text(e)}"

    def _run(self, completion: str, answer: str) -> tuple[float, bool, str | None, str | None]:
        global _outer_timer_active, _warned_no_timeout
        if self.timeout is None:
            return self._score(completion, answer)
        if threading.current_thread() is not threading.main_thread():
            if not _warned_no_timeout:
                log.warning("reward %s called off the main thread: per-item timeout disabled", self.name)
                _warned_no_timeout = True
            return self._score(completion, answer)

        state = {"inside": True}

        def on_alarm(signum: int, frame: object) -> None:
            if state["inside"]:  # raise only while the scorer runs, never in our cleanup code
                raise _ScorerTimeout()

        old_handler = signal.signal(signal.SIGALRM, on_alarm)
        # Interval re-fires the alarm in case the scorer catches the first one with a bare except.
        old_timer = signal.setitimer(signal.ITIMER_REAL, self.timeout, 0.05)
        t0 = time.monotonic()
        _outer_timer_active = True
        try:
            try:
                return self._score(completion, answer)
            finally:
                state["inside"] = False
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            _outer_timer_active = False
            signal.signal(signal.SIGALRM, old_handler)
            if old_timer[0] > 0:  # re-arm an outer timer (e.g. pytest-timeout) we displaced
                signal.setitimer(signal.ITIMER_REAL, max(old_timer[0] - (time.monotonic() - t0), 1e-3),
                                 old_timer[1])


def _import_scorer(spec: str) -> Scorer:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward {spec!r}: expected 'module:function' or one of {BUILTIN_SPECS}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - ImportError or an error raised while importing it
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} "
                         f"({type(e).__name__}: {e})") from e
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {attr!r} is a {type(fn).__name__}, not callable; expected "
                         f"fn(completion: str, ground_truth: str) -> float | bool")
    return fn  # type: ignore[return-value]


def load_reward(spec: str, **kwargs: object) -> RewardFn:
    """Build a RewardFn from "math" (= lenient, the paper's reward), "math-strict", "math-lenient" or a
    user "module:function". kwargs go to RewardFn (correct_score, incorrect_score, timeout). A user's reward is
    graded in worker processes (:mod:`cegppo.data.reward_pool`: it cannot end, hang or change the run); the
    built-in graders, our own code, run in-process, where they are faster."""
    if spec in ("math", "math-lenient"):
        scorer: Scorer = math_lenient
    elif spec == "math-strict":
        scorer = math_strict
    elif ":" in spec:
        from cegppo.data.reward_pool import PooledRewardFn

        kwargs.setdefault("name", spec)
        return PooledRewardFn(spec, _import_scorer(spec), **kwargs)  # type: ignore[arg-type]
    else:
        raise ValueError(f"unknown reward {spec!r}; expected one of {BUILTIN_SPECS} or 'module:function'")
    kwargs.setdefault("name", spec)
    return RewardFn(scorer, **kwargs)  # type: ignore[arg-type]
