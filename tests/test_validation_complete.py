"""Issue 23, class 3: what validation accepts does not fail later. The schema-generated fuzz of every key is in
tests/test_fuzz.py (test_every_key_type_and_range); here the cases that need a run: the entropy autopilot with a
zero first entropy (ZeroDivisionError at step 1 and on --resume), optim.lr=1e30 (died in generation) and the
non-finite-weights stop (docs/reliability.md)."""

import json
import math

import pytest

from cegppo.algorithm.entropy_control import MIN_ENTROPY, EntropyControlConfig, EntropyController
from cegppo.cli import main
from cegppo.engine.trainer import Trainer, TrainingError
from cegppo.recipes import train_loop

SMALL = ("train.prompts_per_step=2", "train.mini_batches=1", "rollout.n=2", "rollout.max_new_tokens=8",
         "data.num_train=8", "data.num_test=0")
AUTOPILOT = ("algorithm.entropy_control.enabled=true", "algorithm.entropy_control.target=0.7")


def test_zero_first_entropy_sets_no_relative_target():
    c = EntropyController(EntropyControlConfig(enabled=True, target=0.7), beta1=0.75, beta2=1.0)
    for n in (1, 2):
        out = c.update(0.0)
        assert out["beta1"] == 0.75 and out["control/target_pending"] == n and "control/target" not in out
    saved = json.loads(json.dumps(c.state_dict()))
    out = c.update(2.0)  # the first positive entropy sets the target
    assert out["control/target"] == pytest.approx(1.4) and "control/target_pending" not in out
    assert all(math.isfinite(v) for v in out.values())
    resumed = EntropyController(EntropyControlConfig(enabled=True, target=0.7), beta1=0.75, beta2=1.0)
    resumed.load_state_dict(saved)
    assert resumed.update(2.0) == out
    tiny = EntropyController(EntropyControlConfig(enabled=True, target=1e-6), beta1=0.75, beta2=1.0)
    assert "control/target" not in tiny.update(MIN_ENTROPY)  # a target below MIN_ENTROPY is not set either


def test_autopilot_at_near_zero_temperature_trains_and_resumes(tiny_config, tmp_path):
    cfg = tiny_config(*SMALL, *AUTOPILOT, "rollout.temperature=1e-4", "train.steps=1", "train.save_every=1",
                      out=tmp_path / "run")
    with Trainer(cfg) as tr:
        (row,) = train_loop(tr)  # was: ZeroDivisionError
    assert row["entropy"] < MIN_ENTROPY and row["control/target_pending"] == 1 and row["control/beta1"] == 0.75
    with Trainer(tiny_config(*SMALL, *AUTOPILOT, "rollout.temperature=1e-4", "train.steps=2", out=tmp_path / "run"),
                 resume=True) as tr:
        (row,) = train_loop(tr)  # was: ZeroDivisionError on --resume
    assert row["step"] == 2 and row["control/target_pending"] == 2


def test_absurd_learning_rates_are_refused_before_the_model_loads(tmp_path, capsys):
    for key in ("optim.lr", "sft.lr"):
        assert main(["train", "tiny", f"{key}=1e30", f"output_dir={tmp_path / 'run'}"]) == 2
        (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("cegppo")]
        assert line.startswith("cegppo train: error: ") and f"{key} must be a finite number >= 0 and <= 1 (AdamW " \
            f"moves every weight by about lr per step" in line and line.endswith("got 1e+30")
    assert not (tmp_path / "run").exists()


def test_an_update_that_makes_the_weights_non_finite_stops_the_run(tiny_config, tmp_path):
    with Trainer(tiny_config(*SMALL, "train.steps=2", "train.save_every=0", out=tmp_path / "run")) as tr:
        for group in tr.optimizer.param_groups:  # past validation: what a code path could still do
            group["lr"] = math.inf
        with pytest.raises(TrainingError, match=r"step 1: the update made the weights non-finite \(optim.lr=inf\); "
                                                r"stopping. Last checkpoint: None"):
            train_loop(tr)
