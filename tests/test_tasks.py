import subprocess
import sys

import pytest

from cegppo.data.rewards import math_reward
from cegppo.data.tasks import TASKS, make_task


def test_registry_makes_what_it_names_and_refuses_what_it_does_not():
    """Every registered task builds problems through make_task; an unknown name is refused there and by the
    config check that runs before a run starts (check_task), naming the key."""
    from cegppo.data.tasks import check_task
    from cegppo.errors import ConfigError

    for name in TASKS:
        problems = make_task(name, "test", 3, seed=0)
        assert len(problems) == 3 and all(p.answer and p.messages for p in problems)
        check_task(name)
    check_task(None)  # no task: data.train_path is used
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        make_task("nope", "test", 3)
    with pytest.raises(ConfigError, match=r"data.task must be null or one of \['arithmetic'\], got 'nope'"):
        check_task("nope")


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4, 5])
def test_deterministic_and_unique(difficulty):
    a = make_task("arithmetic", "train", 50, seed=3, difficulty=difficulty)
    b = make_task("arithmetic", "train", 50, seed=3, difficulty=difficulty)
    assert a == b
    assert len({p.id for p in a}) == 50
    c = make_task("arithmetic", "train", 50, seed=4, difficulty=difficulty)
    assert [p.id for p in a] != [p.id for p in c]


def test_deterministic_across_processes():
    code = ("from cegppo.data.tasks import make_task;"
            "print([p.id for p in make_task('arithmetic','test',20,seed=1,difficulty=3)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str([p.id for p in make_task("arithmetic", "test", 20, seed=1, difficulty=3)])


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4, 5])
def test_splits_disjoint(difficulty):
    train = make_task("arithmetic", "train", 1000, seed=0, difficulty=difficulty)
    test = make_task("arithmetic", "test", 200, seed=0, difficulty=difficulty)
    assert not {p.prompt_text for p in train} & {p.prompt_text for p in test}
    # different seeds draw different samples, still never from the other split
    train2 = make_task("arithmetic", "train", 1000, seed=7, difficulty=difficulty)
    assert not {p.prompt_text for p in train2} & {p.prompt_text for p in test}


def test_commutative_twins_share_split():
    train = {p.prompt_text for p in make_task("arithmetic", "train", 3000, difficulty=1)}
    test = make_task("arithmetic", "test", 300, difficulty=1)
    for p in test:
        a, b = p.prompt_text.split("?")[0].removeprefix("What is ").split(" + ")
        assert p.prompt_text.replace(f"{a} + {b}", f"{b} + {a}") not in train


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4, 5])
def test_problem_fields_and_solutions_are_correct(difficulty):
    for p in make_task("arithmetic", "train", 40, difficulty=difficulty):
        assert p.data_source == "arithmetic"
        assert p.messages[0]["role"] == "user" and "\\boxed{N}" in p.messages[0]["content"]
        assert int(p.answer) >= 0
        assert p.solution.endswith(f"\\boxed{{{p.answer}}}.")
        assert math_reward(p.solution, p.answer, mode="strict")
        # every step is arithmetically right (steps are "a op b = c" over non-negative ints)
        for step in p.solution.splitlines()[:-1]:
            lhs, rhs = step.split(" = ")
            a, op, b = lhs.split(" ")
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == int(rhs)


def test_difficulty_knob():
    d1 = make_task("arithmetic", "train", 100, difficulty=1)
    assert all(p.prompt_text.count("+") == 1 and "*" not in p.prompt_text for p in d1)
    assert all(len(p.solution.splitlines()) == 2 for p in d1)
    assert all(int(x) <= 99 for p in d1 for x in p.prompt_text.split("?")[0][8:].split(" + "))
    steps = {d: sum(len(p.solution.splitlines()) for p in make_task("arithmetic", "train", 100, difficulty=d))
             for d in range(1, 6)}
    assert steps[1] < steps[2] < steps[3] < steps[5]
    d5 = make_task("arithmetic", "train", 100, difficulty=5)
    assert any("(" in p.prompt_text for p in d5) and any("How many" in p.prompt_text for p in d5)


def test_prompt_is_short():
    for d in range(1, 6):
        assert max(len(p.messages[0]["content"]) for p in make_task("arithmetic", "train", 50, difficulty=d)) < 260


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="nope"), "unknown task"),
    (dict(split="valid"), "unknown split"),
    (dict(difficulty=0), "difficulty"),
    (dict(difficulty=6), "difficulty"),
    (dict(n=0), "n must be"),
])
def test_errors(kwargs, match):
    args = dict(name="arithmetic", split="train", n=5, difficulty=1) | kwargs
    with pytest.raises(ValueError, match=match):
        make_task(**args)


def test_too_many_requested():
    with pytest.raises(ValueError, match="found only"):
        make_task("arithmetic", "test", 5000, difficulty=1)
