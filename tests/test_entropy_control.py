"""The entropy autopilot (cegppo.algorithm.entropy_control), driven by synthetic entropy signals; its config;
and the trainer with the controller on (control/* logged every step, kill/resume equivalence)."""

from __future__ import annotations

import json
import math
import random

import pytest

from cegppo.recipes import train_loop
from cegppo.algorithm.entropy_control import EntropyControlConfig, EntropyController
from cegppo.config import ConfigError, load_config, save_config


def controller(**kw) -> EntropyController:
    kw.setdefault("target_mode", "absolute")
    kw.setdefault("target", 1.0)
    return EntropyController(EntropyControlConfig(enabled=True, **kw), beta1=0.75, beta2=1.0)


def drive(ctl: EntropyController, signal) -> list[dict]:
    return [ctl.update(h) for h in signal]


def test_entropy_above_target_raises_beta1_and_below_lowers_it():
    up = drive(controller(), [1.1] * 5)
    assert all(b["beta1"] > a["beta1"] for a, b in zip(up, up[1:])) and up[0]["beta1"] > 0.75
    down = drive(controller(), [0.9] * 5)
    assert all(b["beta1"] < a["beta1"] for a, b in zip(down, down[1:])) and down[0]["beta1"] < 0.75
    assert {r["beta2"] for r in up + down} == {1.0}  # beta2 stays put unless move_beta2
    assert up[-1]["control/error"] == pytest.approx(0.1) and down[-1]["control/error"] == pytest.approx(-0.1)
    assert all(r["control/beta1"] == r["beta1"] and r["control/target"] == 1.0 for r in up + down)


def test_on_target_nothing_moves():
    out = drive(controller(), [1.0] * 10)
    assert {(r["beta1"], r["beta2"], r["control/error"], r["control/integral"]) for r in out} == {(0.75, 1.0, 0.0, 0.0)}


def test_inside_the_band_no_integration_outside_it_integrates():
    inside = controller(band=0.05, kp=0.0, ki=1.0)
    drive(inside, [1.04] * 20)
    assert inside.integral == 0.0 and inside.beta1 == 0.75
    outside = controller(band=0.05, kp=0.0, ki=1.0)
    drive(outside, [1.06] * 3)
    assert outside.integral == pytest.approx(0.18) and outside.beta1 == pytest.approx(0.75 + 0.18)


def test_bounds_are_respected():
    ctl = controller(beta1_min=0.25, beta1_max=1.5)
    hi = drive(ctl, [3.0] * 50)
    assert max(r["beta1"] for r in hi) == 1.5 and hi[-1]["beta1"] == 1.5
    lo = drive(ctl, [0.1] * 80)
    assert min(r["beta1"] for r in lo) == 0.25 and lo[-1]["beta1"] == 0.25
    assert all(0.25 <= r["beta1"] <= 1.5 for r in hi + lo)


@pytest.mark.parametrize("ema", [1.0, 0.3])
def test_no_windup_leaves_the_bound_as_soon_as_the_error_changes_sign(ema):
    ctl = controller(ema=ema, beta1_max=1.5)
    sat = drive(ctl, [2.0] * 300)  # long saturation at beta1_max
    assert sat[-1]["beta1"] == 1.5
    assert ctl.cfg.ki * ctl.integral <= 1.5 - 0.75 + 1e-12  # the integral term alone never exceeds the range
    after = drive(ctl, [0.8] * 30)
    flip = next(i for i, r in enumerate(after) if r["control/error"] < 0)
    # at the latest on the first step with the error reversed, beta1 is off the bound (a wound-up integral would
    # hold it there for as many steps as it had saturated); with smoothing it leaves even earlier, as kp * e falls
    assert after[flip]["beta1"] < 1.5
    assert all(r["beta1"] < 1.5 for r in after[flip:])
    assert after[-1]["beta1"] < 0.75  # and it goes on to the other side of the start (entropy below target)


def test_beta2_moves_only_when_enabled_and_beta1_saturated():
    off = drive(controller(beta1_max=1.0), [1.5] * 40)
    assert {r["beta2"] for r in off} == {1.0}
    on = drive(controller(beta1_max=1.0, move_beta2=True, beta2_min=0.5), [1.5] * 40)
    for r in on:  # while beta1 has room, beta2 stays; once beta1 is at its bound, beta2 goes DOWN (assumed sign)
        assert r["beta2"] == 1.0 if r["beta1"] < 1.0 else r["beta2"] <= 1.0
    assert on[-1]["beta1"] == 1.0 and on[-1]["beta2"] == 0.5
    first = next(i for i, r in enumerate(on) if r["beta2"] < 1.0)
    assert on[first]["beta1"] == 1.0
    low = drive(controller(beta1_min=0.5, move_beta2=True, beta2_max=1.5), [0.5] * 40)  # too little entropy
    assert low[-1]["beta1"] == 0.5 and low[-1]["beta2"] == 1.5


def test_bonus_lever_raises_an_entropy_bonus_only_below_target_and_within_its_cap():
    assert {r["entropy_coeff"] for r in drive(controller(), [0.5] * 20)} == {0.0}  # off by default
    # the cap (0.06) sits above the first step's bonus, so the rule, the growth and the cap are each visible
    low = drive(controller(bonus_gain=0.1, bonus_max=0.06), [0.9] * 30)
    coeffs = [r["entropy_coeff"] for r in low]
    assert coeffs[0] == pytest.approx(0.1 * (3.0 * 0.1 + 1.0 * 0.1))  # -gain * s, s = kp e + ki I, I = e after one step
    assert coeffs[1] == pytest.approx(0.1 * (3.0 * 0.1 + 1.0 * 0.2))  # the integral grew by e
    assert coeffs[0] < coeffs[1] < coeffs[2] == pytest.approx(0.06)  # strictly up until the cap
    assert coeffs[3:] == [0.06] * 27 and low[-1]["beta1"] == 0.0  # held at the cap, beta1 at its bound too
    assert all(r["control/entropy_coeff"] == r["entropy_coeff"] for r in low)
    high = drive(controller(bonus_gain=0.1), [1.2] * 10)
    assert {r["entropy_coeff"] for r in high} == {0.0} and high[-1]["beta1"] > 0.75  # above target: beta1 only


def test_bonus_lever_has_no_windup():
    ctl = controller(bonus_gain=0.1, bonus_max=0.05)  # the signal may go down to -0.5 (bonus 0.05 at s = -0.5)
    drive(ctl, [0.2] * 300)
    assert ctl.entropy_coeff == 0.05 and ctl.cfg.ki * ctl.integral >= -0.75 - 1e-12
    after = drive(ctl, [1.3] * 10)
    flip = next(i for i, r in enumerate(after) if r["control/error"] > 0)
    assert after[flip]["entropy_coeff"] < 0.05  # off the cap as soon as the error reverses
    assert after[-1]["entropy_coeff"] == 0.0 and after[-1]["beta1"] > 0.75


def test_relative_target_is_a_fraction_of_the_first_measurement():
    ctl = controller(target_mode="relative", target=0.7)
    assert "control/target" not in ctl.metrics()
    r = ctl.update(2.0)
    assert r["control/target"] == pytest.approx(1.4) and r["control/error"] == pytest.approx(2.0 / 1.4 - 1)
    assert ctl.update(1.0)["control/target"] == pytest.approx(1.4)  # fixed after the first step


def test_missing_measurement_changes_nothing():
    ctl = controller()
    before = ctl.update(1.5)
    for h in (None, float("nan"), float("inf")):
        assert ctl.update(h) == before


def test_smoothing_is_an_ema():
    ctl = controller(ema=0.25)
    ctl.update(1.0)
    ctl.update(2.0)
    assert ctl.metrics()["control/entropy_smoothed"] == pytest.approx(0.75 * 1.0 + 0.25 * 2.0)


def test_state_dict_round_trip_resumes_exactly():
    rng = random.Random(0)
    signal = [1.2 + 0.3 * math.sin(i / 3) + rng.gauss(0, 0.05) for i in range(40)] + [None] + [0.6] * 19
    cfg = dict(target_mode="relative", target=0.8, move_beta2=True, beta1_max=1.2, ema=0.4, bonus_gain=0.2)
    full = drive(controller(**cfg), signal)
    first = controller(**cfg)
    drive(first, signal[:25])
    state = json.loads(json.dumps(first.state_dict()))  # as in trainer_state.json
    resumed = controller(**cfg)
    resumed.load_state_dict(state)
    assert drive(resumed, signal[25:]) == full[25:]  # exact, not approximately
    assert max(r["entropy_coeff"] for r in full) > 0  # the bonus lever was part of what resumed


# ---------------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------------


def test_config_loads_validates_and_round_trips(tmp_path):
    cfg = load_config(None, ["algorithm.entropy_control.enabled=true", "algorithm.entropy_control.target=0.7",
                             "algorithm.entropy_control.kp=2"])
    ec = cfg.algorithm.entropy_control
    assert isinstance(ec, EntropyControlConfig) and ec.enabled and ec.target == 0.7 and ec.kp == 2.0
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml").algorithm.entropy_control == ec
    assert load_config(None).algorithm.entropy_control.enabled is False


@pytest.mark.parametrize("overrides,match", [
    (["algorithm.objective=grpo"], "only"),
    (["algorithm.objective=clip_cov"], "only"),
    (["algorithm.entropy_control.target=0"], "target"),
    (["algorithm.entropy_control.target_mode=fraction"], "target_mode"),
    (["algorithm.entropy_control.band=1.5"], "band"),
    (["algorithm.entropy_control.ema=0"], "ema"),
    (["algorithm.entropy_control.kp=-1"], "kp"),
    (["algorithm.entropy_control.bonus_gain=-0.1"], "bonus_gain"),
    (["algorithm.entropy_control.bonus_max=inf"], "bonus_max"),
    (["algorithm.entropy_control.beta1_max=0.5"], "beta1_min / beta1_max"),  # below the starting beta1 0.75
    (["algorithm.entropy_control.beta1_max=20"], "beta1_max / beta2_max"),  # beta1 (1 - eps_low) >= clip_ratio_c
    (["algorithm.entropy_control.bogus=1"], "unknown config key"),
])
def test_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["algorithm.entropy_control.enabled=true"] + overrides)


def test_disabled_controller_is_not_validated_against_the_objective():
    assert load_config(None, ["algorithm.objective=grpo"]).algorithm.entropy_control.enabled is False


# ---------------------------------------------------------------------------------------------------------
# trainer
# ---------------------------------------------------------------------------------------------------------

CONTROL = ["algorithm.entropy_control.enabled=true", "algorithm.entropy_control.target=0.9",
           "algorithm.entropy_control.band=0.0", "algorithm.entropy_control.kp=5", "algorithm.entropy_control.ki=2"]


def test_trainer_logs_control_each_step_and_resumes_exactly(tiny_config, tmp_path):
    from cegppo.engine.trainer import Trainer
    from cegppo.io import read_jsonl

    with Trainer(tiny_config("train.steps=4", "train.save_every=2", *CONTROL, out=tmp_path / "full")) as full:
        full_rows = train_loop(full)
        for r in full_rows:
            for key in ("control/beta1", "control/beta2", "control/target", "control/error"):
                assert key in r, key
        assert full_rows[0]["control/target"] == pytest.approx(0.9 * full_rows[0]["entropy"])
        assert len({r["control/beta1"] for r in full_rows}) > 1  # the controller moved beta1 ...
        assert full.objective.hparams["beta1"] == full_rows[-1]["control/beta1"]  # ... and the objective follows it
    with Trainer(tiny_config("train.steps=2", "train.save_every=2", *CONTROL, out=tmp_path / "part")) as part:
        train_loop(part)
    with Trainer(tiny_config("train.steps=4", "train.save_every=2", *CONTROL, out=tmp_path / "part"),
                 resume=True) as resumed:
        assert resumed.controller.updates == 2 and resumed.controller.beta1 == full_rows[1]["control/beta1"]
        train_loop(resumed)
    rows = read_jsonl(tmp_path / "part" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for a, b in zip(rows, full_rows):
        for k in ("reward/mean", "entropy", "pg_loss", "grad_norm", "clip/low_frac", "control/beta1",
                  "control/target", "control/error"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k


def test_trainer_applies_the_bonus_lever_in_its_loss(tiny_config, tmp_path, monkeypatch):
    """Entropy far below the target: the controller's bonus is on, and every loss pass gets it on top of the
    configured bonus."""
    import cegppo.engine.trainer as trainer_module

    seen = []
    entropy_coeff = trainer_module.Trainer.entropy_coeff

    def recording_entropy_coeff(self):  # called once per loss pass, in the loss expression of Trainer.update
        seen.append(entropy_coeff(self))
        return seen[-1]

    monkeypatch.setattr(trainer_module.Trainer, "entropy_coeff", recording_entropy_coeff)
    lever = ["algorithm.entropy_control.enabled=true", "algorithm.entropy_control.target_mode=absolute",
             "algorithm.entropy_control.target=50", "algorithm.entropy_control.bonus_gain=0.1",
             "algorithm.entropy_control.bonus_max=0.02", "algorithm.entropy_coeff=0.001"]
    with trainer_module.Trainer(tiny_config("train.steps=1", *lever, out=tmp_path / "bonus")) as tr:
        rows = train_loop(tr)
        assert rows[0]["control/entropy_coeff"] == 0.02 and tr.controller.entropy_coeff == 0.02
    assert seen and all(c == pytest.approx(0.021) for c in seen)
