"""What two scripts measure the same way: the problems one RL step trains on (``step_throughput.py`` feeds them to
both systems, ``roofline.py`` counts their prompt tokens) and torch's peak CPU allocation during a call
(``logits_memory.py``, ``objectives.py``)."""

from __future__ import annotations


def problems_in_order(s: dict) -> list:
    """The problems cegppo's trainer takes, step by step, for this seed (so TRL can be fed the same ones)."""
    from cegppo.config import load_config
    from cegppo.engine.components import DataOrder, load_splits

    cfg = load_config(None, [f"train.seed={s['seed']}"])
    train, _ = load_splits(cfg)
    return DataOrder(train, s["seed"]).take(0, s["prompts"] * (s["warmup"] + s["steps"]))


def peak_bytes_cpu(fn) -> tuple[int, object]:
    """Peak extra CPU memory allocated by torch during ``fn``, and ``fn``'s result.

    Replays the profiler's raw allocation records (one ``[memory]`` record per allocation or free, in time
    order). Summing ``cpu_memory_usage`` over ``prof.events()`` instead would count an allocation once for
    every op it is nested in (``aten::linear`` > ``aten::matmul`` > ``aten::mm``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    cur = peak = 0
    for e in sorted(records, key=lambda e: e.start_ns()):
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak, out
