"""verl reward function for the CE-GPPO math recipe (``reward.custom_reward_function.path`` in
``examples/verl/ce_gppo_math.sh``, which passes this file's path; verl loads it by path in its reward workers).

+1 when math-verify finds the ground truth's answer in the full response, else -1, as the authors' scripts score it;
``acc`` is what ``algorithm.filter_groups.metric=acc`` reads through verl's ``dapo`` reward manager.
"""

from __future__ import annotations

from typing import Any

from math_verify import parse, verify


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> dict[str, Any]:
    """verl's custom reward signature; returns ``{"score": +1.0 or -1.0, "acc": bool}``."""
    gold = parse(ground_truth if "$" in ground_truth or "\\boxed" in ground_truth else f"${ground_truth}$")
    correct = bool(gold) and bool(verify(gold, parse(solution_str)))
    return {"score": 1.0 if correct else -1.0, "acc": correct}
