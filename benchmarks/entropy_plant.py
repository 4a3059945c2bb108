"""How well can any controller track an entropy target in the entropy_control regime? (issue 24)

    python benchmarks/entropy_plant.py                      # from benchmarks/results/entropy_control.json
    python benchmarks/entropy_plant.py --quick              # smoke test: 20 simulated runs per cell

The entropy controllers act once per RL step; the rollout entropy they see moves between steps by what the lever
did and by what the step's update and the next step's prompts and samples did on their own. This script measures
that from the committed runs, and from it bounds and simulates the controllers:

1. **The plant, fitted.** From the runs whose only lever is the entropy bonus (GRPO and the Skywork rule: the same
   objective, ``ppo_clip``), every step-to-step change is fitted as ``log H[t+1] - log H[t] = a + g * u[t] + r`` (``u``:
   the bonus coefficient applied at step t; least squares). ``a`` is the entropy's own drift per step, ``g`` the
   lever's gain, ``sd(r)`` what no lever explains; intervals by resampling the transitions (bootstrap).
2. **A floor for every controller.** Write ``r = w[t] + v[t+1] - v[t]``: ``w`` the policy's own unpredictable move,
   ``v`` the noise of one step's measurement (sd ``s_v``, measured on rollout batches of one policy). Even a
   controller that knew the state, ``a`` and ``g`` exactly cannot foresee ``w[t]`` or ``v[t+1]``, so each scored
   step errs by at least ``|w + v|``, and the tracking error, mean ``|H - T| / T`` (>= mean ``|log(H / T)|``), is at
   least ``sqrt(2 / pi) * sqrt(sd(r)^2 - s_v^2)`` for Gaussian noise. The split of ``sd(r)`` between ``w`` and
   ``v`` moves it only between ``sqrt(2/pi) sd(r) / sqrt 2`` (all measurement) and ``sqrt(2/pi) sd(r)`` (none).
   A lever that pushes both ways reaches it (:func:`oracle`); the bonus only raises entropy, so a bonus-only
   controller, even that oracle, scores above it (the oracle's row of the table).
3. **The controllers on the fitted plant.** The library's own ``AdaptiveEntropyBonus`` (Skywork's rule) and
   ``EntropyController`` (the autopilot's bonus lever at a few gains and smoothings) drive the fitted plant
   (Gaussian ``w`` and ``v``) for the benchmark's 10 steps, scored as the benchmark scores (steps > 5), at the fitted
   gain and drift and at half / twice them: the plant's gain varied about 4x across the measured runs.

It is a model of 27-odd transitions of one seed, not a measurement of a controller: its use is to say what the
benchmark's goal asks of the measurement (a floor) and to choose the bonus lever's gains before spending CPU-hours.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import statistics
from pathlib import Path

from common import RESULTS, in_checkout, provenance, provenance_line, quick_out, write_results
from common.entropy import TARGETS, tracking_error  # entropy_control.py's targets and its score

from cegppo.algorithm.entropy_control import (AdaptiveEntropyBonus, AdaptiveEntropyConfig,
                                              EntropyControlConfig, EntropyController)

STEPS = 10  # the committed benchmark's run length
ORACLE = "oracle: knows the state, a and g (bonus >= 0)"
MEASUREMENT_NOISE = 0.030  # sd / mean of one step's entropy, entropy_regime.md (6 batches), when the results have none
# the autopilot's bonus lever: (label, bonus_gain, ema); beta1 moves too, with an effect too small to model here
AUTOPILOTS = (("Autopilot + bonus, gain 0.1, ema 0.5", 0.1, 0.5), ("Autopilot + bonus, gain 0.03, ema 0.5", 0.03, 0.5),
              ("Autopilot + bonus, gain 0.03, ema 1", 0.03, 1.0), ("Autopilot + bonus, gain 0.05, ema 1", 0.05, 1.0))


def transitions(result: dict) -> list[tuple[float, float]]:
    """(bonus coefficient at step t, log H[t+1] / H[t]) of the runs whose only lever is the bonus."""
    out = []
    for r in result["runs"]:
        if r["objective"] != "ppo_clip":
            continue
        h, u = r["entropy"], r["entropy_coeff"]
        out += [(u[t] or 0.0, math.log(h[t + 1] / h[t])) for t in range(len(h) - 1)
                if h[t] is not None and h[t + 1] is not None]
    return out


def fit(points: list[tuple[float, float]]) -> dict:
    """Least squares ``y = a + g u``; the residual sd with 2 degrees of freedom spent."""
    us, ys = [p[0] for p in points], [p[1] for p in points]
    try:
        g, a = statistics.linear_regression(us, ys)
    except statistics.StatisticsError:  # a resample with one bonus value only: no gain to fit
        g, a = 0.0, statistics.fmean(ys)
    resid = [y - a - g * u for u, y in zip(us, ys)]
    return {"a": a, "g": g, "sd": math.sqrt(sum(r * r for r in resid) / max(len(points) - 2, 1)), "n": len(points)}


def bootstrap(points: list[tuple[float, float]], draws: int, rng: random.Random) -> dict:
    """2.5 / 97.5 percentiles of each fitted value over ``draws`` resamples of the transitions."""
    fits = [fit([rng.choice(points) for _ in points]) for _ in range(draws)]
    out = {}
    for key in ("a", "g", "sd"):
        vs = sorted(f[key] for f in fits)
        out[key] = [vs[int(0.025 * (draws - 1))], vs[int(0.975 * (draws - 1))]]
    return out


def floor(sd_resid: float, sd_measure: float) -> float:
    """The smallest expected tracking error of any controller on this plant (module docstring, item 2)."""
    return math.sqrt(2 / math.pi) * math.sqrt(max(sd_resid ** 2 - sd_measure ** 2, sd_resid ** 2 / 2))


def controller(kind: str, frac: float, gain: float = 0.0, ema: float = 1.0):
    """A fresh controller ``(measured entropy, true log-entropy) -> bonus coefficient``: the library's own rule at the
    benchmark's settings (it sees only the measurement)."""
    if kind == "none":
        return lambda h, x: 0.0
    if kind == "skywork":
        c = AdaptiveEntropyBonus(AdaptiveEntropyConfig(enabled=True, target=frac, target_mode="relative"))
    else:
        c = EntropyController(EntropyControlConfig(enabled=True, target=frac, bonus_gain=gain, ema=ema), 0.75, 1.0)
    return lambda h, x: c.update(h)["entropy_coeff"]


def oracle(frac: float, a: float, g: float, two_sided: bool):
    """A fresh controller that sees the true log-entropy and knows ``a`` and ``g``: it puts the next step on target
    in expectation. With ``two_sided`` it may apply a negative bonus and reaches the floor; a bonus (>= 0) can only
    raise entropy, so above the target it waits for the drift, as every bonus-only controller must."""
    first: list[float] = []

    def act(h: float, x: float) -> float:
        first.append(h)
        u = (math.log(frac * first[0]) - x - a) / g
        return u if two_sided else max(u, 0.0)
    return act


def simulate(make, frac: float, a: float, g: float, sd_w: float, sd_v: float, rng: random.Random) -> float:
    """One run of ``STEPS`` on the plant with the controller ``make()``; its tracking error as the benchmark scores
    it (:func:`common.entropy.tracking_error`)."""
    x, act, seen = math.log(1.6), make(), []
    for _ in range(STEPS):
        seen.append(math.exp(x + rng.gauss(0, sd_v)))
        x += a + g * act(seen[-1], x) + rng.gauss(0, sd_w)
    return tracking_error({"steps": list(range(1, STEPS + 1)), "entropy": seen}, frac)


def measured_noise(result: dict) -> tuple[float, str]:
    if result.get("noise"):
        n = result["noise"][0]
        return n["sd"] / n["mean"], f"measured in the results file ({len(n['entropies'])} batches)"
    return MEASUREMENT_NOISE, "entropy_regime.md's 3.0% (the results file measured none)"


def report(res: dict) -> str:
    f, ci, fl = res["fit"], res["fit_interval"], res["floor"]
    lines = ["# The entropy plant of the entropy_control regime: a floor and the controllers on a fitted model", "",
             f"Generated by `{res['command']}` from `{res['source']}`. Do not edit by hand.", "",
             provenance_line(res), "",
             f"Fitted on {f['n']} step-to-step transitions of the ppo_clip runs (GRPO and the Skywork rule): "
             f"`log H[t+1] / H[t] = a + g u[t] + r` with drift a = {f['a']:+.4f} ({ci['a'][0]:+.4f} .. "
             f"{ci['a'][1]:+.4f}), bonus gain g = {f['g']:.2f} ({ci['g'][0]:.2f} .. {ci['g'][1]:.2f}) per unit "
             f"coefficient, residual sd {f['sd']:.4f} ({ci['sd'][0]:.4f} .. {ci['sd'][1]:.4f}); 95% bootstrap "
             f"intervals. Measurement noise of one step: {res['measurement_noise']:.4f}, {res['measurement_source']}.", "",
             f"**Floor** for any controller's tracking error: {fl['value']:.3f} (interval {fl['interval'][0]:.3f} .. "
             f"{fl['interval'][1]:.3f} from the residual sd's; {fl['all_measurement']:.3f} if the whole residual were "
             "measurement noise, the lowest any split gives).", ""]
    if res["measured"]:
        lines += ["Measured tracking errors in the source (a controller against its own target):", ""]
        lines += [f"- {m['label']} seed {m['seed']}: {m['tracking']:.3f}" for m in res["measured"]]
        lines += [""]
    lines += [f"## Simulated tracking error ({res['sims']} runs per cell; mean)", "",
              "| controller | " + " | ".join(f"{c['target']}, g x{c['gain_x']:g}, a x{c['drift_x']:g}"
                                            for c in res["cells"]) + " |",
              "|---|" + "---|" * len(res["cells"])]
    for label in res["controllers"]:
        lines.append(f"| {label} | " + " | ".join(f"{c['tracking'][label]:.3f}" for c in res["cells"]) + " |")
    return "\n".join(lines + ["", *[f"- {n}" for n in res["notes"]], ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", type=Path, default=RESULTS / "entropy_control.json")
    ap.add_argument("--sims", type=int, default=500, help="simulated runs per controller and cell")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--note", action="append")
    ap.add_argument("--quick", action="store_true", help="20 simulated runs per cell: a smoke test")
    args = ap.parse_args()
    sims = 20 if args.quick else args.sims
    src = json.loads(args.source.read_text())
    rng = random.Random(args.seed)
    points = transitions(src)
    f, sv, src_note = fit(points), *measured_noise(src)
    interval = bootstrap(points, 200 if args.quick else 2000, rng)
    sd_w = math.sqrt(max(f["sd"] ** 2 - 2 * sv ** 2, 0.0))  # r = w + v[t+1] - v[t]
    kinds = {"no controller (GRPO)": ("none", 0.0, 1.0), "Skywork rule (delta 0.005)": ("skywork", 0.0, 1.0),
             **{label: ("autopilot", gain, ema) for label, gain, ema in AUTOPILOTS}}
    cells = []
    for target, frac in TARGETS.items():
        for gain_x, drift_x in ((1, 1), (0.5, 1), (2, 1), (1, 2)):
            a, g = f["a"] * drift_x, f["g"] * gain_x
            makers = {label: functools.partial(controller, kind, frac, gain, ema)
                      for label, (kind, gain, ema) in kinds.items()}
            makers[ORACLE] = functools.partial(oracle, frac, a, g, False)
            track = {label: statistics.fmean(simulate(mk, frac, a, g, sd_w, sv, rng) for _ in range(sims))
                     for label, mk in makers.items()}
            cells.append(dict(target=target, gain_x=gain_x, drift_x=drift_x, tracking=track))
    measured = [dict(label=r["label"], seed=r["seed"], tracking=r["tracking"][r["target"]]) for r in src["runs"]
                if r.get("target") and r.get("tracking", {}).get(r["target"]) is not None]
    res = dict(**provenance("entropy_plant.py", "fp64 (pure Python)"), source=str(in_checkout(args.source.resolve())),
               source_commit=src.get("commit"), fit=f, fit_interval=interval, measurement_noise=sv,
               measurement_source=src_note, sd_w=sd_w, sims=sims, controllers=[*kinds, ORACLE], cells=cells,
               measured=measured, notes=list(args.note or []),
               floor=dict(value=floor(f["sd"], sv), interval=[floor(s, sv) for s in interval["sd"]],
                          all_measurement=math.sqrt(2 / math.pi) * f["sd"] / math.sqrt(2)))
    write_results(args.out or (quick_out("entropy_plant") if args.quick else RESULTS), "entropy_plant", res,
                  report(res))


if __name__ == "__main__":
    main()
