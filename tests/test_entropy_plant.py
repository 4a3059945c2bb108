"""benchmarks/entropy_plant.py's two statistics: the plant fit recovers a known plant, and its floor is what a
controller that knows the state exactly reaches (and none goes below it): the bound quoted against issue 24's goal."""

from __future__ import annotations

import math
import random
import statistics

import entropy_plant as plant  # benchmarks/ (tests/conftest.py)


def test_fit_recovers_drift_gain_and_residual():
    rng = random.Random(0)
    a, g, sd = -0.04, 6.0, 0.05
    points = [(u, a + g * u + rng.gauss(0, sd)) for u in (rng.uniform(0, 0.05) for _ in range(4000))]
    f = plant.fit(points)
    assert abs(f["a"] - a) < 0.005 and abs(f["g"] - g) < 0.3 and abs(f["sd"] - sd) < 0.003 and f["n"] == 4000


def test_floor_is_reached_by_an_oracle_and_beaten_by_none():
    """An oracle that sees the true log-entropy and knows a and g sets the next step on target in expectation; what
    is left is the policy's move w and the measurement's v, the floor (a lever both ways; the bonus alone, which
    only raises entropy, does worse). With about the noise split of the fitted plant."""
    rng = random.Random(1)
    a, g, sd_w, sd_v = -0.04, 6.0, 0.06, 0.03
    sd_resid = math.sqrt(sd_w ** 2 + 2 * sd_v ** 2)  # r = w + v[t+1] - v[t]: what the fit sees

    floor = plant.floor(sd_resid, sd_v)
    assert abs(floor - math.sqrt(2 / math.pi) * math.hypot(sd_w, sd_v)) < 1e-12
    for frac in plant.TARGETS.values():
        reached = statistics.fmean(plant.simulate(lambda: plant.oracle(frac, a, g, True), frac, a, g, sd_w, sd_v, rng)
                                   for _ in range(4000))
        assert floor <= reached <= 1.05 * floor, (frac, floor, reached)
        bonus_only = statistics.fmean(plant.simulate(lambda: plant.oracle(frac, a, g, False), frac, a, g, sd_w, sd_v,
                                                     rng) for _ in range(4000))
        assert bonus_only > reached
    # the controllers the script compares, on the same plant, score above it
    for make in (lambda: plant.controller("skywork", 1.0), lambda: plant.controller("autopilot", 1.0, 0.03, 1.0)):
        scored = statistics.fmean(plant.simulate(make, 1.0, a, g, sd_w, sd_v, rng) for _ in range(1000))
        assert scored > floor
