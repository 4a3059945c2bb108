"""The collapse guard: from the metrics one RL step already computes, name a run's failure as it starts.

Gradient-preserving clipping (CE-GPPO's beta1 branch above all) keeps pushing tokens that PPO's clip would stop, so
at a large step it gives up part of PPO's trust region (docs/algorithm.md §12). The guard watches what goes wrong
then, each rule one named failure with its evidence:

- ``trust region``: KL(old || new) of the step's last mini-batch (``mb_last/ppo_kl``) or its beta1-region share
  (``mb_last/clip/low_frac``, negative-advantage tokens pushed below ``1 - eps_low``) past a bound (not when
  ``train.target_kl`` stopped the step at that mini-batch: its update was refused);
- ``responses at the cap``: the share of responses cut at ``rollout.max_new_tokens`` past a bound and risen well
  above its lowest so far (a base model may start at the cap; a run that learned to stop and then runs back to it
  has collapsed);
- ``no learning signal``: after the first steps, ``algorithm.overlong_filter`` left (almost) no response in the loss
  (``overlong/in_loss_frac``): every response is cut at the cap, so nothing teaches the policy to stop;
- ``entropy exploding`` / ``entropy collapsing``: the rollouts' entropy against the first step's;
- ``reward collapsing``: accuracy near zero after the first steps, or the mean reward far below its best so far.

:class:`CollapseGuard` keeps the little history it needs (first entropy, best reward) as a plain dict, so the
trainer checkpoints it and the TRL / verl adapters can run the same rules on their own metric names.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class CollapseBounds:
    """Where each rule fires (fitted on recorded runs: tests/fixtures/collapse_runs.json, docs/algorithm.md §12)."""

    kl: float = 0.5  # nats/token, KL(old || new) over the step's last mini-batch
    beta1_share: float = 0.4  # share of tokens in the beta1 region in the step's last mini-batch
    truncated: float = 0.5  # share of responses cut at the token cap ...
    truncated_rise: float = 0.3  # ... that has also risen this much above its lowest so far
    min_in_loss: float = 0.05  # share of responses the overlong filter leaves in the loss, after the warm-up steps
    entropy_high: float = 3.0  # x the first step's entropy
    entropy_low: float = 0.02  # x the first step's entropy
    min_accuracy: float = 0.05  # rollout accuracy at or below this, from step `warmup_steps` + 1 on
    reward_drop: float = 0.5  # mean reward this far below its best so far
    warmup_steps: int = 2  # the reward rules wait this many steps (a run starts from any accuracy)


@dataclass
class CollapseGuard:
    """``guard.check(row)`` with one step's metrics row -> the failures it shows (empty when healthy)."""

    bounds: CollapseBounds = field(default_factory=CollapseBounds)
    state: dict[str, Any] = field(default_factory=dict)  # first_entropy, best_reward, steps

    def check(self, row: dict[str, Any]) -> list[str]:
        b, s = self.bounds, self.state
        s["steps"] = s.get("steps", 0) + 1
        out = []

        def value(key: str) -> float | None:
            v = row.get(key)
            return None if v is None or v != v else float(v)  # absent or NaN: the rule does not apply

        kl, low = value("mb_last/ppo_kl"), value("mb_last/clip/low_frac")
        if row.get("train/kl_stopped_at"):  # the KL early stop refused that mini-batch: the step stayed in bounds
            kl = low = None
        if kl is not None and kl > b.kl:
            out.append(f"trust region: KL(old||new) {kl:.3f} nats/token in the last mini-batch > {b.kl:g}")
        if low is not None and low > b.beta1_share:
            out.append(f"trust region: {100 * low:.1f}% of tokens in the beta1 region > {100 * b.beta1_share:g}%")
        cut = value("response_length/clip_ratio")
        if cut is not None:
            low = s["lowest_truncated"] = min(s.get("lowest_truncated", cut), cut)
            if cut > b.truncated and cut - low >= b.truncated_rise:
                out.append(f"responses at the cap: {100 * cut:.0f}% cut at the token limit > {100 * b.truncated:g}%, up "
                           f"from {100 * low:.0f}%")
        in_loss = value("overlong/in_loss_frac")
        if s["steps"] > b.warmup_steps and in_loss is not None and in_loss <= b.min_in_loss:
            out.append(f"no learning signal: the overlong filter left {100 * in_loss:.0f}% of responses in the loss "
                       f"(<= {100 * b.min_in_loss:g}%): they are cut at the token cap, and nothing teaches the policy "
                       f"to stop (raise rollout.max_new_tokens or turn algorithm.overlong_filter off)")
        h = value("entropy")
        if h is not None:
            h0 = s.setdefault("first_entropy", h)
            if h0 > 0 and h > b.entropy_high * h0:
                out.append(f"entropy exploding: {h:.3f} = {h / h0:.2f}x the first step's {h0:.3f}")
            if h0 > 0 and h < b.entropy_low * h0:
                out.append(f"entropy collapsing: {h:.4f} = {h / h0:.3f}x the first step's {h0:.3f}")
        acc, reward = value("reward/accuracy"), value("reward/mean")
        if s["steps"] > b.warmup_steps and acc is not None and acc <= b.min_accuracy:
            out.append(f"reward collapsing: rollout accuracy {acc:.3f} <= {b.min_accuracy:g}")
        if reward is not None:
            best = s.get("best_reward")
            if s["steps"] > b.warmup_steps and best is not None and best - reward >= b.reward_drop:
                out.append(f"reward collapsing: mean reward {reward:.3f}, {best - reward:.2f} below its best {best:.3f}")
            s["best_reward"] = reward if best is None else max(best, reward)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"bounds": asdict(self.bounds), **self.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = {k: v for k, v in state.items() if k != "bounds"}
