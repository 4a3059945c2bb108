"""Forward + backward time and peak memory of each objective, against the formulations it replaces.

    python benchmarks/objectives.py [--batch 64] [--tokens 8192] [--repeats 20]
    python benchmarks/objectives.py --quick     # smoke test: 4 x 256 tokens, 3 rounds, into runs/objectives_quick

Rows: every registered objective through :func:`cegppo.algorithm.policy_loss.policy_loss` (loss, token-mean
and region metrics, as the trainer calls it) and through ``token_loss`` alone; the authors'-shape boolean-mask
CE-GPPO (``tests/reference.py: ce_gppo_masked``); the plain ``torch.where`` + autograd CE-GPPO
(``ce_gppo_where``: what ``ce_gppo`` would be without its closed-form gradient); and
the memory-bandwidth floor: the bytes any forward + backward of the loss must move (read log_prob,
old_log_prob, the mask and the [B] advantages; write the [B, T] gradient: 4 passes of B x T fp32) divided by
the copy bandwidth, timed as a copy of that many bytes. All rows and the floor are timed round-robin in
the same process (medians per call) and reported as ratios, so the machine's drifts hit them alike. Writes
``objectives.json`` to ``--out`` (default benchmarks/results) with the commit, the command, the date and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from cegppo.algorithm.objectives import OBJECTIVES, get_objective
from cegppo.algorithm.policy_loss import aggregator, policy_loss

FLOOR = "memory-bandwidth floor"
from common import RESULTS, provenance, quick_out, tests_module
from common.measure import peak_bytes_cpu

reference = tests_module("reference")  # tests/reference.py: the reference formulations


def time_interleaved(fns: dict[str, callable], rounds: int, batch_seconds: float = 0.005) -> dict[str, float]:
    """Median seconds per call of each function, measured round-robin: every round times a short batch of
    calls of each function in turn, so drifts of the machine's speed hit every row (and the floor) alike."""
    per_batch = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()  # warm-up, and a first estimate of the call's cost
        per_batch[name] = max(1, int(batch_seconds / max(time.perf_counter() - t0, 1e-7)))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(per_batch[name]):
                fn()
            times[name].append((time.perf_counter() - t0) / per_batch[name])
    return {name: statistics.median(v) for name, v in times.items()}


def peak_bytes(fn) -> int:
    """Peak extra CPU memory allocated by torch during ``fn`` (the profiler's allocation records, replayed)."""
    return peak_bytes_cpu(fn)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=20, help="timing rounds (each a ~5 ms batch of calls per row)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="4 x 256 tokens, 3 rounds: a smoke test")
    ap.add_argument("--out", type=Path, help=f"results directory (default {RESULTS}; --quick: runs/objectives_quick)")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.tokens, args.repeats = 4, 256, 3
    out_dir = args.out or (quick_out("objectives") if args.quick else RESULTS)
    if args.threads:
        torch.set_num_threads(args.threads)
    B, T = args.batch, args.tokens
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(B, T, generator=g) * 3
    lp0 = old + torch.randn(B, T, generator=g) * 0.3  # ~30% of tokens out of a 0.2 clip interval
    adv = torch.randn(B, generator=g)
    mask = (torch.rand(B, T, generator=g) < 0.9).float()
    n_tok = mask.sum()

    def run(token_loss):
        def step():
            lp = lp0.detach().requires_grad_(True)
            loss = (token_loss(lp) * mask).sum() / n_tok
            loss.backward()
            return lp.grad

        return step

    def run_objective(obj):
        def step():
            lp = lp0.detach().requires_grad_(True)
            loss, _ = policy_loss(obj, lp, old, adv, mask, reduce=aggregator(num_tokens=n_tok))
            loss.backward()
            return lp.grad

        return step

    rows: list[tuple[str, callable]] = []
    for name in OBJECTIVES:
        rows.append((name, run_objective(get_objective(name))))
    rows.append(("ce_gppo [token_loss only]", run(lambda lp: get_objective("ce_gppo").token_loss(lp, old, adv, mask))))
    rows.append(("ce_gppo [boolean-mask, authors' shape]", run(lambda lp: reference.ce_gppo_masked(lp, old, adv))))
    rows.append(("ce_gppo [torch.where + autograd]", run(lambda lp: reference.ce_gppo_where(lp, old, adv))))

    # memory-bandwidth floor: read lp, old and mask, write the gradient (4 passes of B*T fp32) and read adv [B];
    # timed as a copy of that many bytes (half read, half written), in the same rounds as the rows
    floor_bytes = 4 * B * T * 4 + B * 4
    src = torch.randn(floor_bytes // 8)
    dst = torch.empty_like(src)
    results = time_interleaved({**dict(rows), FLOOR: lambda: dst.copy_(src)}, args.repeats)
    floor_s = results[FLOOR]
    copy_bw = floor_bytes / floor_s

    mem = {name: peak_bytes(fn) for name, fn in rows}
    ours = results["ce_gppo [token_loss only]"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, B x T = {B} x {T} = {B*T:,} tokens")
    print(f"copy bandwidth {copy_bw/1e9:.1f} GB/s -> floor {floor_bytes/1e6:.1f} MB = {floor_s*1e3:.2f} ms\n")
    print(f"| {'objective (fwd+bwd, token-mean)':42s} | {'ms':>8s} | {'vs ours':>8s} | {'vs floor':>8s} | {'peak MB':>8s} |")
    print(f"|{'-'*44}|{'-'*10}|{'-'*10}|{'-'*10}|{'-'*10}|")
    for name, _ in rows:
        t = results[name]
        print(f"| {name:42s} | {t*1e3:8.2f} | {t/ours:7.2f}x | {t/floor_s:7.2f}x | {mem[name]/2**20:8.1f} |")
    print(f"| {FLOOR:42s} | {floor_s*1e3:8.2f} | {floor_s/ours:7.2f}x | {1.0:7.2f}x | {'':>8s} |")
    masked = results["ce_gppo [boolean-mask, authors' shape]"]
    where = results["ce_gppo [torch.where + autograd]"]
    print(f"ce_gppo token loss (closed-form gradient): {masked/ours:.1f}x faster than boolean-mask, {where/ours:.1f}x "
          f"faster and {mem['ce_gppo [torch.where + autograd]'] / max(mem['ce_gppo [token_loss only]'], 1):.1f}x less "
          f"peak memory than torch.where+autograd, {ours/floor_s:.1f}x the bandwidth floor")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "objectives.json").write_text(json.dumps({
        **provenance("objectives.py", "fp32"), "quick": args.quick, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "load_average_1min": os.getloadavg()[0], "batch": B, "tokens": T,
        "floor_ms": floor_s * 1e3,
        "rows": {name: {"ms": results[name] * 1e3, "peak_mb": mem[name] / 2**20} for name, _ in rows},
    }, indent=2) + "\n")
    print(f"results: {out_dir / 'objectives.json'}")


if __name__ == "__main__":
    main()
