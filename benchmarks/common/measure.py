"""What two scripts measure the same way: the problems one RL step trains on (``step_throughput.py`` feeds them to
both systems, ``roofline.py`` counts their prompt tokens) and torch's peak CPU allocation during a call
(``logits_memory.py``, ``objectives.py``); and the resident set per phase of a step (``step_throughput.py``)."""

from __future__ import annotations

import os
import time


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


class PhaseRSS:
    """Where the peak memory is reached: a thread samples the resident set every 20 ms and keeps the highest value
    seen in each phase the worker is in (``phase`` is set by the worker's timing wrappers). ``heap=True`` (glibc):
    at each phase's peak it also reads ``mallinfo2``, how much of the heap malloc has handed out (in use) and how
    much it keeps free but resident (what allocator fragmentation costs)."""

    def __init__(self, heap: bool = False) -> None:
        import threading

        self.phase, self.peak, self.heap = "load", {}, {}
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.mallinfo2 = _mallinfo2() if heap else None
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * self.page / 2 ** 30
            phase = self.phase
            if rss > self.peak.get(phase, 0.0):
                self.peak[phase] = rss
                if self.mallinfo2 is not None:
                    m = self.mallinfo2()
                    self.heap[phase] = {"in_use": (m.uordblks + m.hblkhd) / 2 ** 30, "free": m.fordblks / 2 ** 30}
            time.sleep(0.02)

    def result(self) -> dict:
        out = {"phase_peak_rss_gib": {k: round(v, 3) for k, v in self.peak.items()}}
        if self.mallinfo2 is not None:
            out["phase_heap_gib"] = {k: {a: round(b, 3) for a, b in v.items()} for k, v in self.heap.items()}
        return out


def _mallinfo2():
    """glibc's ``mallinfo2`` (2.33+) through ctypes: the heap's bytes in use and free, over every arena."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]

    fn = ctypes.CDLL("libc.so.6").mallinfo2
    fn.restype = MallInfo2
    return fn
