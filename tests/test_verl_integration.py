"""CE-GPPO inside verl 0.9.x: plugin loading, equivalence with verl's ``vanilla`` loss, beta plumbing, metrics.

Runs against the real verl package on CPU (no mocks); skipped when verl is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest

pytest.importorskip("verl")

import torch  # noqa: E402
from verl.trainer.ppo.core_algos import get_policy_loss_fn  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

import cegppo.integrations.verl as cv  # noqa: E402

MODULE = "cegppo.integrations.verl"


# --------------------------------------------------------------------------------------------------------
# loading: fresh interpreters (what each Ray worker does)
# --------------------------------------------------------------------------------------------------------

_PROBE = textwrap.dedent(
    f"""
    import sys
    import verl
    loaded = {MODULE!r} in sys.modules
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn
    names = [n for n in ("ce_gppo", "gppo") if n in POLICY_LOSS_REGISTRY]
    mods = sorted({{get_policy_loss_fn(n).__module__ for n in names}})
    print("RESULT", loaded, ",".join(names), ",".join(mods))
    """
)


def _spawn(env_updates: dict[str, str | None], code: str = _PROBE) -> subprocess.Popen:
    env = dict(os.environ)
    for k, v in env_updates.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _result(proc: subprocess.Popen) -> tuple[str, str]:
    out, err = proc.communicate(timeout=900)  # `import verl` is slow on a busy 2-core machine
    assert proc.returncode == 0, f"subprocess failed:\n{out}\n{err}"
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT")][-1]
    return line, err


def test_fresh_interpreter_loading_paths():
    """Concurrent subprocesses (each `import verl` costs ~6 s of CPU): the entry point alone; the
    VERL_USE_EXTERNAL_MODULES path with entry points disabled; a broken plugin (must be loud)."""
    broken = "import sys; sys.modules['cegppo.algorithm.objectives'] = None\n" + _PROBE
    procs = {
        "entry_point": _spawn({"VERL_USE_EXTERNAL_MODULES": None, "VERL_USE_EXTERNAL_PLUGINS": None}),
        "env_module": _spawn({"VERL_USE_EXTERNAL_MODULES": MODULE, "VERL_USE_EXTERNAL_PLUGINS": "none"}),
        "broken": _spawn({"VERL_USE_EXTERNAL_MODULES": None, "VERL_USE_EXTERNAL_PLUGINS": None}, broken),
    }
    res = {k: _result(p) for k, p in procs.items()}
    ok = f"RESULT True ce_gppo,gppo {MODULE}"
    assert res["entry_point"][0] == ok, res["entry_point"]
    assert res["env_module"][0] == ok, res["env_module"]
    # verl swallows plugin errors at DEBUG level; ours must still be visible on stderr
    line, err = res["broken"]
    assert line.split()[:2] == ["RESULT", "False"] and "ce_gppo" not in line, line
    assert "could not load the verl plugin" in err and "ERROR" in err and "RuntimeWarning" in err, err


def test_check_and_idempotent_registration(monkeypatch):
    # trainer=False: the losses and plugin loading only; the test environment installs verl --no-deps, without the
    # trainers' extra modules (checked below and in the [verl] venv of .ci/check_extras.sh)
    cv.check(trainer=False)
    before = (get_policy_loss_fn("ce_gppo"), get_policy_loss_fn("gppo"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cv.register()
        cv.register()
    assert (get_policy_loss_fn("ce_gppo"), get_policy_loss_fn("gppo")) == before
    assert before == (cv.compute_policy_loss_ce_gppo, cv.compute_policy_loss_gppo)

    monkeypatch.setenv("VERL_USE_EXTERNAL_PLUGINS", "none")
    monkeypatch.delenv("VERL_USE_EXTERNAL_MODULES", raising=False)
    with pytest.raises(RuntimeError, match="will not load"):
        cv.check(trainer=False)
    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", MODULE)
    cv.check(trainer=False)

    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    monkeypatch.setitem(POLICY_LOSS_REGISTRY, "ce_gppo", get_policy_loss_fn("vanilla"))
    with pytest.raises(RuntimeError, match="ce_gppo"):
        cv.check(trainer=False)


@pytest.mark.parametrize("missing", sorted(cv.TRAINER_DEPENDENCIES))
def test_check_reports_a_missing_trainer_dependency_in_one_line(monkeypatch, missing):
    """`python -m verl.trainer.main_ppo` dies after Ray starts without transfer_queue (V1 trainer) or cachetools
    (legacy trainer); check() names the module, who needs it and the fix, on one line."""
    for module in cv.TRAINER_DEPENDENCIES:  # present for this test whatever the environment installs
        if module != missing:
            monkeypatch.setitem(sys.modules, module, sys.modules.get(module) or type(sys)(module))
    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` raises ImportError
    with pytest.raises(RuntimeError) as info:
        cv.check()
    lines = [ln for ln in str(info.value).splitlines() if missing in ln]
    assert len(lines) == 1, str(info.value)
    assert "verl's trainer cannot start" in lines[0] and "[verl-core]" in lines[0] and ".[verl]" in lines[0]
    assert cv.TRAINER_DEPENDENCIES[missing] in lines[0]
    cv.check(trainer=False)  # the losses themselves are fine


def test_check_passes_where_the_trainer_dependencies_are_installed():
    """In the [verl] install (.ci/check_extras.sh runs this file there) check() passes as a whole."""
    for module in cv.TRAINER_DEPENDENCIES:
        pytest.importorskip(module, reason=f"{module} is installed by the [verl] extra, not by the test environment")
    assert cv.trainer_problems() == []
    cv.check()


# --------------------------------------------------------------------------------------------------------
# numerics against verl's vanilla loss
# --------------------------------------------------------------------------------------------------------


def _config(eps_low=0.2, eps_high=0.2, c=10.0, policy_loss=None, global_batch_info=None) -> ActorConfig:
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, ppo_mini_batch_size=1,
                      clip_ratio_low=eps_low, clip_ratio_high=eps_high, clip_ratio_c=c,
                      policy_loss=policy_loss if policy_loss is not None else PolicyLossConfig())
    cfg.global_batch_info.update(global_batch_info or {})
    return cfg


def _inputs(seed: int, B: int = 12, T: int = 24):
    g = torch.Generator().manual_seed(seed)
    log_prob = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    old = log_prob + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    old[0, :6] = log_prob[0, :6] - 3.0  # ratio e^3 > clip_ratio_c: dual clip for A < 0
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    adv[0] = -1.0
    adv[1] = 0.0
    lengths = torch.randint(T // 3, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    weights = torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5
    return log_prob, old, adv, mask, weights


def _grad(fn, log_prob, old, adv, mask, cfg, agg="token-mean", weights=None):
    lp = log_prob.clone().requires_grad_(True)
    loss, metrics = fn(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, loss_agg_mode=agg,
                       config=cfg, rollout_is_weights=weights)
    loss.backward()
    return lp.grad, loss.detach(), metrics


@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.2, 0.28)])
@pytest.mark.parametrize("c", [3.0, 10.0])
def test_beta_zero_gradient_equals_vanilla(eps, c):
    zero = cv.CEGPPOPolicyLossConfig(loss_mode="ce_gppo", beta1=0.0, beta2=0.0)
    vanilla = get_policy_loss_fn("vanilla")
    ours = get_policy_loss_fn("ce_gppo")
    for seed in range(4):
        log_prob, old, adv, mask, weights = _inputs(seed)
        n = int(mask.sum())
        for gbi, agg, w in [
            ({}, "token-mean", None),
            # a micro-batch of a larger mini-batch: verl passes the global token count / batch size
            ({"dp_size": 1, "batch_num_tokens": 3 * n, "global_batch_size": 40, "loss_scale_factor": None},
             "token-mean", weights),
            ({"dp_size": 2, "batch_num_tokens": 3 * n, "global_batch_size": 40, "loss_scale_factor": None},
             "seq-mean-token-mean", None),
            ({}, "seq-mean-token-sum-norm", weights),
        ]:
            g_ref, _, m_ref = _grad(vanilla, log_prob, old, adv, mask, _config(*eps, c, global_batch_info=gbi),
                                    agg, w)
            g, _, m = _grad(ours, log_prob, old, adv, mask, _config(*eps, c, zero, gbi), agg, w)
            torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-15)
            # verl's metrics, same names and values as vanilla's (python floats)
            for k in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
                assert isinstance(m[k], float)
                assert m[k] == pytest.approx(m_ref[k], abs=1e-6), k
        # the comparison covers every region
        assert m["actor/clip/low_frac"] > 0 and m["actor/clip/high_frac"] > 0 and m["actor/clip/dual_frac"] > 0
        assert m["actor/pg_clipfrac"] == pytest.approx(m["actor/clip/low_frac"] + m["actor/clip/high_frac"])


def test_metric_keys():
    log_prob, old, adv, mask, _ = _inputs(0)
    for name in cv.LOSS_NAMES:
        _, loss, m = _grad(get_policy_loss_fn(name), log_prob, old, adv, mask,
                           _config(policy_loss=cv.CEGPPOPolicyLossConfig(loss_mode=name)))
        assert set(m) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/clip/low_frac",
                          "actor/clip/high_frac", "actor/clip/dual_frac"}
        assert all(isinstance(v, float) for v in m.values())
        assert torch.isfinite(loss)


@pytest.mark.parametrize("name,beta1,beta2", [("ce_gppo", 0.5, 1.0), ("ce_gppo", 0.75, 1.3), ("gppo", 1.0, 1.0)])
def test_betas_reach_the_loss(name, beta1, beta2):
    """Out-of-clip tokens get gradient -A * beta * (1 -+ eps) / N; every other token the vanilla gradient."""
    eps_low, eps_high, c = 0.2, 0.28, 10.0
    # for gppo the betas in the config are ignored: GPPO is beta1 = beta2 = 1
    pl = cv.CEGPPOPolicyLossConfig(loss_mode=name, **({} if name == "gppo" else dict(beta1=beta1, beta2=beta2)))
    log_prob, old, adv, mask, _ = _inputs(7)
    n = mask.sum()
    g, _, _ = _grad(get_policy_loss_fn(name), log_prob, old, adv, mask, _config(eps_low, eps_high, c, pl))
    g_ref, _, _ = _grad(get_policy_loss_fn("vanilla"), log_prob, old, adv, mask, _config(eps_low, eps_high, c))
    ratio = (log_prob - old).exp()
    low = (adv < 0) & (ratio < 1 - eps_low) & mask
    high = (adv > 0) & (ratio > 1 + eps_high) & mask
    assert low.any() and high.any()
    torch.testing.assert_close(g[low], -adv[low] * beta1 * (1 - eps_low) / n)
    torch.testing.assert_close(g[high], -adv[high] * beta2 * (1 + eps_high) / n)
    assert (g_ref[low | high] == 0).all()
    torch.testing.assert_close(g[~(low | high)], g_ref[~(low | high)])


def test_missing_betas_warn_and_use_defaults(monkeypatch):
    monkeypatch.setattr(cv, "_warned_default_betas", False)
    log_prob, old, adv, mask, _ = _inputs(3)
    with pytest.warns(UserWarning, match="CEGPPOPolicyLossConfig"):
        g, _, _ = _grad(cv.compute_policy_loss_ce_gppo, log_prob, old, adv, mask,
                        _config(policy_loss=PolicyLossConfig(loss_mode="ce_gppo")))
    g75, _, _ = _grad(cv.compute_policy_loss_ce_gppo, log_prob, old, adv, mask,
                      _config(policy_loss=cv.CEGPPOPolicyLossConfig(beta1=0.75, beta2=1.0)))
    torch.testing.assert_close(g, g75)


def test_policy_loss_config_validation():
    with pytest.raises(ValueError, match="beta1"):
        cv.CEGPPOPolicyLossConfig(loss_mode="ce_gppo", beta1=-0.1)
    with pytest.warns(UserWarning, match="loss_mode=ce_gppo"):
        cv.CEGPPOPolicyLossConfig(loss_mode="vanilla", beta1=0.5)  # forgot loss_mode


def test_hydra_target_instantiation():
    """The Hydra path verl takes (`_target_` override plus `+beta1`); needs hydra-core, which verl's minimal
    --no-deps install does not include."""
    pytest.importorskip("hydra")
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    cfg = OmegaConf.create({
        "_target_": "verl.workers.config.ActorConfig", "strategy": "fsdp", "rollout_n": 1,
        "ppo_micro_batch_size_per_gpu": 1, "ppo_mini_batch_size": 1, "clip_ratio_c": 10.0,
        "policy_loss": {"_target_": f"{MODULE}.CEGPPOPolicyLossConfig", "loss_mode": "ce_gppo", "beta1": 0.5},
    })
    actor = omega_conf_to_dataclass(cfg)
    assert isinstance(actor.policy_loss, cv.CEGPPOPolicyLossConfig)
    assert (actor.policy_loss.beta1, actor.policy_loss.beta2) == (0.5, 1.0)
