"""Built-in synthetic tasks, deterministic from a seed, with disjoint train/test splits.

`arithmetic`: integer expressions and short word problems whose answer is one non-negative integer.
Difficulty 1..5:
  1  a + b, 1-2 digit numbers
  2  three 1-2 digit operands with + and -
  3  3-4 operands, 2-digit numbers, one small product; or a one-step word problem
  4  4 operands up to 3 digits with products; or a two-step word problem
  5  parenthesised expressions with 4-5 operands; or a three-step word problem

Split membership depends only on the problem's numbers and answer (hashed with sha1), so the same
problem can never appear in both splits, whatever the seed or difficulty.
"""

from __future__ import annotations

import hashlib
import random
from typing import Callable

from cegppo.data.problems import Problem
from cegppo.errors import ConfigError, show

SPLITS = ("train", "test")
DIFFICULTIES = range(1, 6)
INSTRUCTION = "Think step by step, then give the final answer as \\boxed{N}."

# A generated item: (question text, solution steps, answer, numbers used)
Item = tuple[str, list[str], int, list[int]]

_NAMES = ["Tom", "Ana", "Sam", "Mia", "Leo", "Ivy", "Max", "Zoe", "Ben", "Eva"]
_ITEMS = ["apple", "book", "pencil", "marble", "card", "shell", "sticker", "coin"]


def _split_of(numbers: list[int], answer: int) -> str:
    # Order-insensitive key: "17 + 25" and "25 + 17" (or the same numbers in a word problem) share a split.
    key = "arith|" + ",".join(map(str, sorted(numbers))) + "=" + str(answer)
    return "test" if int(hashlib.sha1(key.encode()).hexdigest(), 16) % 5 == 0 else "train"


# ----------------------------------------------------------------------------------------------------
# expressions


def _eval_steps(tokens: list[int | str]) -> tuple[int, list[str]]:
    """Evaluate a flat + - * expression with precedence, recording one step per operation."""
    steps: list[str] = []
    toks = list(tokens)
    i = 1
    while i < len(toks):  # products first
        if toks[i] == "*":
            a, b = toks[i - 1], toks[i + 1]
            r = a * b  # type: ignore[operator]
            steps.append(f"{a} * {b} = {r}")
            toks[i - 1:i + 2] = [r]
        else:
            i += 2
    acc = toks[0]
    for op, v in zip(toks[1::2], toks[2::2]):
        r = acc + v if op == "+" else acc - v  # type: ignore[operator]
        steps.append(f"{acc} {op} {v} = {r}")
        acc = r
    return int(acc), steps  # type: ignore[arg-type]


def _flat_expr(rng: random.Random, n_ops: int, hi: int, ops: str, max_mul: int) -> Item | None:
    nums = [rng.randint(1, hi)]
    toks: list[int | str] = [nums[0]]
    used_mul = False
    for _ in range(n_ops - 1):
        op = rng.choice(ops)
        if op == "*" and used_mul:
            op = "+"
        if op == "*":
            used_mul = True
            v = rng.randint(2, max_mul)
        else:
            v = rng.randint(1, hi)
        toks += [op, v]
        nums.append(v)
    value, steps = _eval_steps(toks)
    # Reject negative intermediate sums so every answer and step stays a non-negative integer.
    if value < 0 or any(s.split("= ")[1].startswith("-") for s in steps):
        return None
    return "What is " + " ".join(map(str, toks)) + "?", steps, value, nums


def _paren_expr(rng: random.Random) -> Item | None:
    a, b, c, d = rng.randint(2, 60), rng.randint(2, 60), rng.randint(2, 9), rng.randint(1, 99)
    form = rng.randrange(3)
    if form == 0:  # (a + b) * c - d
        s1 = a + b
        s2 = s1 * c
        ans = s2 - d
        text = f"({a} + {b}) * {c} - {d}"
        steps = [f"{a} + {b} = {s1}", f"{s1} * {c} = {s2}", f"{s2} - {d} = {ans}"]
    elif form == 1:  # (a - b) * c + d
        a, b = max(a, b), min(a, b)
        s1 = a - b
        s2 = s1 * c
        ans = s2 + d
        text = f"({a} - {b}) * {c} + {d}"
        steps = [f"{a} - {b} = {s1}", f"{s1} * {c} = {s2}", f"{s2} + {d} = {ans}"]
    else:  # a * c + (b + d) * 2
        s1, s2 = a * c, b + d
        s3 = s2 * 2
        ans = s1 + s3
        text = f"{a} * {c} + ({b} + {d}) * 2"
        steps = [f"{a} * {c} = {s1}", f"{b} + {d} = {s2}", f"{s2} * 2 = {s3}", f"{s1} + {s3} = {ans}"]
    if ans < 0:
        return None
    return f"What is {text}?", steps, ans, [a, b, c, d]


# ----------------------------------------------------------------------------------------------------
# word problems


def _word(rng: random.Random, n_steps: int) -> Item | None:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    if n_steps == 1:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        ans = a * b
        q = f"A box holds {a} {item}s. How many {item}s are in {b} boxes?"
        return q, [f"{a} * {b} = {ans}"], ans, [a, b]
    if n_steps == 2:
        if rng.random() < 0.5:
            a, b, c = rng.randint(5, 60), rng.randint(2, 9), rng.randint(2, 12)
            s1 = b * c
            ans = a + s1
            q = (f"{name} has {a} {item}s and buys {b} bags with {c} {item}s in each bag. "
                 f"How many {item}s does {name} have now?")
            return q, [f"{b} * {c} = {s1}", f"{a} + {s1} = {ans}"], ans, [a, b, c]
        a, b, c = rng.randint(10, 99), rng.randint(2, 50), rng.randint(1, 40)
        s1 = a + b
        ans = s1 - c
        q = (f"{name} has {a} {item}s, finds {b} more, then gives {c} away. "
             f"How many {item}s does {name} have now?")
        return q, [f"{a} + {b} = {s1}", f"{s1} - {c} = {ans}"], ans, [a, b, c]
    a, b, c, d = rng.randint(2, 20), rng.randint(2, 9), rng.randint(1, 50), rng.randint(1, 30)
    s1 = a * b
    s2 = s1 + c
    ans = s2 - d
    if ans < 0:
        return None
    q = (f"{name} reads {a} pages a day for {b} days, then reads {c} more pages. "
         f"{d} of those pages were pictures. How many pages of text did {name} read?")
    return q, [f"{a} * {b} = {s1}", f"{s1} + {c} = {s2}", f"{s2} - {d} = {ans}"], ans, [a, b, c, d]


def _arith_item(rng: random.Random, difficulty: int) -> Item | None:
    if difficulty == 1:
        return _flat_expr(rng, 2, 99, "+", 0)
    if difficulty == 2:
        return _flat_expr(rng, 3, 99, "+-", 0)
    if difficulty == 3:
        if rng.random() < 0.25:
            return _word(rng, 1)
        return _flat_expr(rng, rng.choice((3, 4)), 99, "+-*", 9)
    if difficulty == 4:
        if rng.random() < 0.5:
            return _word(rng, 2)
        return _flat_expr(rng, 4, 999, "+-*", 12)
    if rng.random() < 0.5:
        return _word(rng, 3)
    return _paren_expr(rng) if rng.random() < 0.6 else _flat_expr(rng, 5, 999, "+-*", 20)


def _solution(steps: list[str], answer: int) -> str:
    return "\n".join(steps) + f"\nThe answer is \\boxed{{{answer}}}."


def arithmetic(split: str, n: int, seed: int = 0, difficulty: int = 1) -> list[Problem]:
    """n unique arithmetic problems from `split`, deterministic in (split, n, seed, difficulty)."""
    # str seeds are hashed with sha512 by random.Random: stable across processes (unlike hash()).
    rng = random.Random(f"arithmetic|{split}|{seed}|{difficulty}")
    out: list[Problem] = []
    seen: set[str] = set()
    misses, max_misses = 0, 20_000  # consecutive draws without a new problem: the space is exhausted
    while len(out) < n:
        item = _arith_item(rng, difficulty)
        if item is None or item[0] in seen or _split_of(item[3], item[2]) != split:
            misses += 1
            if misses > max_misses:
                raise ValueError(f"arithmetic: found only {len(out)} unique {split} problems at difficulty "
                                 f"{difficulty} ({max_misses} draws in a row gave nothing new); "
                                 f"ask for fewer than {n}")
            continue
        misses = 0
        question, steps, answer, numbers = item
        seen.add(question)
        pid = "arith-d%d-%s" % (difficulty, hashlib.sha1(question.encode()).hexdigest()[:10])
        out.append(Problem(id=pid, messages=[{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                           answer=str(answer), solution=_solution(steps, answer), data_source="arithmetic"))
    return out


TASKS: dict[str, Callable[..., list[Problem]]] = {"arithmetic": arithmetic}


def check_task(task: str | None, key: str = "data.task") -> None:
    """The config's task name against this registry (config itself imports no data module): a one-line
    ConfigError for a name that is not a built-in task. Run before any data, model or run file is touched."""
    if task is not None and task not in TASKS:
        raise ConfigError(f"{key} must be null or one of {sorted(TASKS)}, got {show(task)}")


def make_task(name: str, split: str, n: int, seed: int = 0, difficulty: int = 1) -> list[Problem]:
    """Generate `n` problems of built-in task `name` from `split` ("train" or "test")."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(sorted(TASKS))}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if isinstance(difficulty, bool) or not isinstance(difficulty, int) or difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be an int in 1..5, got {difficulty!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    return TASKS[name](split, n, seed=seed, difficulty=difficulty)
