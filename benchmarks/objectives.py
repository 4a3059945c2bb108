"""Forward + backward time and peak memory of each objective, against the formulations it replaces.

    python benchmarks/objectives.py [--batch 64] [--tokens 8192] [--repeats 20]

Rows: every registered objective (``cegppo.objectives``), the authors'-shape boolean-mask CE-GPPO
(``cegppo.reference.ce_gppo_masked``), the plain ``torch.where`` + autograd CE-GPPO (``ce_gppo_where``), and
the memory-bandwidth floor: the bytes a fused loss must move (read log_prob, old_log_prob, mask and the
advantages; write the gradient; read the upstream gradient) divided by the copy bandwidth measured in the
same process on tensors of the same size. All timings are medians in the same process, reported as ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

import torch

from cegppo import reference
from cegppo.objectives import OBJECTIVES, get_objective


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_bytes(fn) -> int:
    """Peak extra CPU memory allocated by torch during ``fn`` (profiler memory stats)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cur = peak = 0
    events = sorted(
        (e for e in prof.events() if e.cpu_memory_usage != 0), key=lambda e: e.time_range.start
    )
    for e in events:
        cur += e.cpu_memory_usage
        peak = max(peak, cur)
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd fused row")
    args = ap.parse_args()
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
            loss, _ = obj(lp, old, adv, mask, agg="token-mean", num_tokens=n_tok)
            loss.backward()
            return lp.grad

        return step

    rows: list[tuple[str, callable]] = []
    for name in OBJECTIVES:
        rows.append((name, run_objective(get_objective(name))))
    if not args.no_compile:
        t0 = time.perf_counter()
        fused = run_objective(get_objective("ce_gppo", compile=True))
        fused()
        print(f"compiled ce_gppo in {time.perf_counter() - t0:.1f} s (one-off)")
        rows.append(("ce_gppo [compile=True, fused]", fused))
    rows.append(("ce_gppo [boolean-mask, authors' shape]", run(lambda lp: reference.ce_gppo_masked(lp, old, adv))))
    rows.append(("ce_gppo [torch.where + autograd]", run(lambda lp: reference.ce_gppo_where(lp, old, adv))))

    # memory-bandwidth floor: a loss must read lp, old and mask, write its gradient and (fwd->bwd) carry one
    # saved tensor (adv is [B]): 5 passes of B*T fp32. Copy bandwidth is measured on a buffer of that total size.
    floor_bytes = 5 * B * T * 4 + B * 4
    src = torch.randn(floor_bytes // 8)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), args.repeats * 10)
    copy_bw = 2 * src.numel() * 4 / copy_s  # bytes read + written per second
    floor_s = floor_bytes / copy_bw

    results = {name: timed(fn, args.repeats) for name, fn in rows}
    mem = {name: peak_bytes(fn) for name, fn in rows}
    ours = results.get("ce_gppo [compile=True, fused]", results["ce_gppo"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, B x T = {B} x {T} = {B*T:,} tokens")
    print(f"copy bandwidth {copy_bw/1e9:.1f} GB/s -> floor {floor_bytes/1e6:.1f} MB = {floor_s*1e3:.2f} ms\n")
    print(f"| {'objective (fwd+bwd, token-mean)':42s} | {'ms':>8s} | {'vs fastest':>10s} | {'vs floor':>8s} | {'peak MB':>8s} |")
    print(f"|{'-'*44}|{'-'*10}|{'-'*12}|{'-'*10}|{'-'*10}|")
    for name, _ in rows:
        t = results[name]
        print(f"| {name:42s} | {t*1e3:8.2f} | {t/ours:9.2f}x | {t/floor_s:7.2f}x | {mem[name]/2**20:8.1f} |")
    print(f"| {'memory-bandwidth floor':42s} | {floor_s*1e3:8.2f} | {floor_s/ours:9.2f}x | {1.0:7.2f}x | {'':>8s} |")
    masked = results["ce_gppo [boolean-mask, authors' shape]"]
    where = results["ce_gppo [torch.where + autograd]"]
    for label, t in (("eager", results["ce_gppo"]), ("compiled", results.get("ce_gppo [compile=True, fused]"))):
        if t is not None:
            print(f"ce_gppo ({label}): {masked/t:.1f}x faster than boolean-mask, {where/t:.1f}x faster than "
                  f"torch.where+autograd, {t/floor_s:.2f}x the bandwidth floor")


if __name__ == "__main__":
    main()
