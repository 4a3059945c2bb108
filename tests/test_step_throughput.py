"""benchmarks/step_throughput.py: a TRL variant measures the same work as the TRL arm (its micro-batch changes how
the step is cut, not what it trains on), and a bad override is refused in one line."""

from __future__ import annotations

import argparse

import pytest

import step_throughput as st  # benchmarks/ (tests/conftest.py)

WORK = dict(prompts=8, n=8, max_new_tokens=64, mini_batches=2, micro_batch=16, warmup=1, steps=2, lr=1e-6,
            temperature=1.0, beta1=0.75, beta2=1.0, eps=0.2, seed=0, device="cpu", bf16=False)


@pytest.mark.parametrize("micro", [16, 32, 8])
def test_a_trl_variant_keeps_the_work_of_a_step(micro):
    kw = st.trl_args(WORK, [f"per_device_train_batch_size={micro}", "gradient_checkpointing=false"])
    samples = WORK["prompts"] * WORK["n"]
    assert kw["per_device_train_batch_size"] == micro and kw["gradient_checkpointing"] is False
    assert kw["per_device_train_batch_size"] * kw["steps_per_generation"] == samples  # one generation per step
    assert kw["steps_per_generation"] // kw["gradient_accumulation_steps"] == WORK["mini_batches"]  # optimizer steps
    assert kw["max_steps"] == WORK["mini_batches"] * (WORK["warmup"] + WORK["steps"])


def test_the_default_trl_arm_is_unchanged():
    kw = st.trl_args(WORK, [])
    assert (kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"], kw["steps_per_generation"]) == (16, 2, 4)
    assert "gradient_checkpointing" not in kw  # TRL's own default


@pytest.mark.parametrize("bad, match", [("no_such_field=1", "CEGPPOConfig field"), ("bf16", "KEY=VALUE"),
                                        ("per_device_train_batch_size=24", "does not divide")])
def test_a_bad_trl_override_is_refused_in_one_line(bad, match):
    with pytest.raises(SystemExit, match=match):
        st.trl_args(WORK, [bad])


def test_trl_variants_are_labelled_and_run_as_trl():
    args = argparse.Namespace(variant=None, trl_variant=["mb32=per_device_train_batch_size=32 gradient_checkpointing=false"],
                              baseline=None, python=None, only=None)
    v = st.systems(args)[-1]
    assert v == dict(label="trl[mb32]", kind="trl", overrides=["per_device_train_batch_size=32",
                                                                "gradient_checkpointing=false"], rev=None)


def _run(system: str, step_s: float, rss: float) -> dict:
    step = dict(step_s=step_s, generate_s=step_s / 4, old_logp_s=step_s / 8, update_s=step_s / 2, generated_tokens=3000,
                trained_tokens=3000, mean_response_length=50.0)
    return dict(system=system, steps=[dict(step, step_s=999.0), step], peak_rss_gib=rss)  # the first is the warm-up


def test_cegppo_is_compared_with_the_fastest_trl_arm_and_the_goal_names_only_cegppo_arms():
    runs = [_run("cegppo", 60.0, 3.0), _run("trl", 120.0, 5.0), _run("trl[nockpt]", 90.0, 6.0)]
    summ = st.summarize(runs, warmup=1)
    assert st.fastest_trl(summ) == "trl[nockpt]"
    vs = summ["cegppo"]["vs_trl"]
    assert vs["against"] == "trl[nockpt]" and vs["trained_tok_s"] == pytest.approx(1.5) and vs["peak_rss"] == pytest.approx(0.5)
    assert summ["trl"]["vs_trl"]["against"] == "trl[nockpt]" and "vs_trl" not in summ["trl[nockpt]"]
    text = st.report(dict(settings=dict(WORK, model="m", rounds=1), summary=summ, command="c", commit="x", torch="t",
                          threads=2, load_before=0.0, wall_s=60.0, machine={}, date="d", precision="fp32",
                          systems=[dict(label="trl[nockpt]", kind="trl", overrides=["gradient_checkpointing=false"], rev=None)]))
    assert "| against trl[nockpt] |" in text and "Goal of issue 43" in text
    goal = next(line for line in text.splitlines() if line.startswith("Goal of issue 43"))
    assert "cegppo MET" in goal and "trl NOT MET" not in goal and "trl MET" not in goal
    assert "`trl[nockpt]` = TRL with `gradient_checkpointing=false`" in text


def _report(summ: dict, rounds: int) -> str:
    return st.report(dict(settings=dict(WORK, model="m", rounds=rounds), summary=summ, command="c", commit="x",
                          torch="t", threads=2, load_before=0.0, wall_s=60.0, machine={}, date="d", precision="fp32"))


def test_the_goal_is_judged_in_every_round_not_only_over_the_run():
    # round 0: cegppo 2.0x the TRL arm; round 1: 1.2x; over the run the pooled ratio is above 1.5x
    runs = [dict(_run("cegppo", 50.0, 3.0), round=0), dict(_run("trl", 100.0, 5.0), round=0),
            dict(_run("trl", 60.0, 5.0), round=1), dict(_run("cegppo", 50.0, 3.0), round=1)]
    runs.append(dict(_run("trl[mb32]", 100.0, 5.0), round=0))  # a slower second arm: trl is the fastest
    summ = st.summarize(runs, warmup=1)
    vs = summ["cegppo"]["vs_trl"]
    assert vs["against"] == "trl" and vs["trained_tok_s_rounds"] == pytest.approx([2.0, 1.2])
    assert vs["trained_tok_s"] == pytest.approx(1.6)
    text = _report(summ, rounds=2)
    assert "**1.60x** (2.00, 1.20 by round)" in text
    goal = next(line for line in text.splitlines() if line.startswith("Goal of issue 43"))
    assert "cegppo NOT MET" in goal and "not judged" not in goal


def test_against_a_single_trl_arm_the_goal_is_not_judged():
    summ = st.summarize([_run("cegppo", 50.0, 3.0), _run("trl", 100.0, 5.0)], warmup=1)
    text = _report(summ, rounds=1)
    assert "the only TRL configuration in this run" in text
    goal = next(line for line in text.splitlines() if line.startswith("Goal of issue 43"))
    assert "cegppo MET against the only TRL arm run" in goal and "not judged" in goal
