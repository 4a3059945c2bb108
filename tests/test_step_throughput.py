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
