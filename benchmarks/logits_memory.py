"""Peak memory of the RL step's log-prob/entropy pass: full logits (today's path) against the fused LM head.

    python benchmarks/logits_memory.py [--tokens 512] [--vocab 49152 151936] [--precision fp32] [--device cpu]
    python benchmarks/logits_memory.py --quick    # smoke test: 32 tokens, D 64, V 1024, into runs/logits_memory_quick

For N response tokens with hidden size D (576, SmolLM2-135M) and each vocabulary V, forward + backward of
``sum(w1 * log_prob + w2 * entropy)`` (collision term on, as the trainer's update pass asks for it):

* ``full logits``: ``logits = F.linear(hidden, W)`` (what the model's ``lm_head`` computes), then
  :func:`cegppo.algorithm.logprobs.token_stats` -- the trainer's path with ``model.fused_lm_head=false``;
* ``fused head``: :func:`cegppo.algorithm.logprobs.linear_token_stats` on ``hidden`` and ``W`` -- the path with
  ``model.fused_lm_head=true``; the ``[N, V]`` logits never exist, a chunk of rows does.

Peak memory is the highest total of the allocations torch makes during the call, from the profiler's raw
allocation records on CPU (:func:`peak_bytes_cpu`) or ``torch.cuda.max_memory_allocated`` on CUDA,
so it counts the gradients of ``hidden`` and ``W`` (``[V, D]`` float32, the same in both paths) but not the
inputs. Each path runs once; the two runs' log-probs, entropies and gradients are compared and the largest
differences printed. Writes ``logits_memory.json`` to ``--out`` (default benchmarks/results) with the commit, the
command, the date and the machine. ``--precision bf16-autocast`` runs both under ``torch.autocast(bfloat16)`` as the
trainer's default precision does (bf16 matmuls are several times slower than fp32 on a CPU without AVX-512
BF16, so keep ``--tokens`` small there).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from cegppo.algorithm.logprobs import DEFAULT_CHUNK_ROWS, fused_chunk_rows, linear_token_stats, token_stats

from common import RESULTS, provenance, quick_out
from common.measure import peak_bytes_cpu

VOCABS = (49152, 151936)  # SmolLM2, Qwen2.5


def peak_bytes_cuda(fn) -> tuple[int, object]:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512, help="response tokens N in the micro-batch")
    ap.add_argument("--hidden", type=int, default=576, help="hidden size D (576 = SmolLM2-135M)")
    ap.add_argument("--vocab", type=int, nargs="+", default=list(VOCABS))
    ap.add_argument("--precision", choices=("fp32", "bf16-autocast"), default="fp32")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="32 tokens, hidden 64, vocab 1024: a smoke test")
    ap.add_argument("--out", type=Path, help=f"results directory (default {RESULTS}; --quick: runs/logits_memory_quick)")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.hidden, args.vocab = 32, 64, [1024]
    out_dir = args.out or (quick_out("logits_memory") if args.quick else RESULTS)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev, N, D = torch.device(args.device), args.tokens, args.hidden
    peak_bytes = peak_bytes_cuda if dev.type == "cuda" else peak_bytes_cpu
    amp = (torch.autocast(dev.type, dtype=torch.bfloat16) if args.precision == "bf16-autocast"
           else contextlib.nullcontext())

    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {args.device}, "
          f"{torch.get_num_threads()} threads; N = {N:,} tokens, D = {D}, {args.precision}, "
          f"T = {args.temperature}; log-prob + entropy + collision, forward + backward\n")
    header = (f"| {'vocab':>7s} | {'path':11s} | {'chunk rows':>10s} | {'peak MiB':>9s} | {'vs full':>7s} | "
              f"{'[N,V] MiB':>9s} | {'s':>6s} |")
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    rows = []
    for V in args.vocab:
        g = torch.Generator().manual_seed(V)
        hidden0 = torch.randn(N, D, generator=g).to(dev)
        weight0 = (torch.randn(V, D, generator=g) * 0.05).to(dev)  # logits of std ~1.2
        tokens = torch.randint(0, V, (N,), generator=g).to(dev)
        w1, w2 = torch.randn(N, generator=g).to(dev), torch.rand(N, generator=g).to(dev)

        def run(fused: bool, n: int = N):
            def step():
                h = hidden0[:n].detach().requires_grad_(True)
                w = weight0.detach().requires_grad_(True)
                with amp:
                    if fused:
                        lp, H, C = linear_token_stats(h, w, None, tokens[:n], args.temperature, collision=True)
                    else:
                        lp, H, C = token_stats(F.linear(h, w), tokens[:n], args.temperature, DEFAULT_CHUNK_ROWS,
                                               collision=True)
                (lp * w1[:n] + H * w2[:n]).sum().backward()
                return lp.detach(), H.detach(), C, h.grad, w.grad

            return step

        res = {}
        for fused in (False, True):  # warm-up on 4 rows: one-off allocations of the kernels are not counted
            run(fused, 4)()
        for name, fused in (("full logits", False), ("fused head", True)):
            t0 = time.perf_counter()
            peak, out = peak_bytes(run(fused))
            res[name] = (peak, time.perf_counter() - t0, out)
        (p_full, _, o_full), (_, _, o_fused) = res["full logits"], res["fused head"]
        diffs = {
            "log_prob_max_abs": float((o_fused[0] - o_full[0]).abs().max()),
            "entropy_max_abs": float((o_fused[1] - o_full[1]).abs().max()),
            "collision_max_abs": float((o_fused[2] - o_full[2]).abs().max()),
            "grad_hidden_max_rel": float((o_fused[3] - o_full[3]).abs().max() / o_full[3].abs().max()),
            "grad_weight_max_rel": float((o_fused[4] - o_full[4]).abs().max() / o_full[4].abs().max()),
        }
        logits_mib = N * V * (2 if args.precision == "bf16-autocast" else 4) / 2**20
        for name, chunk in (("full logits", min(N, DEFAULT_CHUNK_ROWS)), ("fused head", min(N, fused_chunk_rows(V)))):
            peak, secs, _ = res[name]
            print(f"| {V:7,d} | {name:11s} | {chunk:10d} | {peak / 2**20:9.1f} | {peak / p_full:6.2f}x | "
                  f"{logits_mib:9.1f} | {secs:6.1f} |")
            rows.append({"vocab": V, "path": name, "chunk_rows": chunk, "peak_mib": peak / 2**20,
                         "peak_vs_full": peak / p_full, "logits_mib": logits_mib, "seconds": secs})
        rows[-1]["max_differences_vs_full"] = diffs
        print("|         | fused - full: " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    print(f"\n[N,V] MiB: the size of one [N, V] logits tensor in the matmul dtype; weight-gradient [V, D] float32 "
          f"is counted in both paths ({D * 4 * max(args.vocab) / 2**20:.0f} MiB at V = {max(args.vocab):,}).")

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "logits_memory.json").write_text(json.dumps({
        **provenance("logits_memory.py", args.precision), "quick": args.quick,
        "torch": torch.__version__, "device": args.device, "threads": torch.get_num_threads(), "tokens": N,
        "hidden": D, "precision": args.precision, "temperature": args.temperature,
        "peak_memory": "torch profiler raw [memory] records replayed in time order (CPU) / "
                       "torch.cuda.max_memory_allocated (CUDA); allocations during the call, inputs not counted",
        "rows": rows,
    }, indent=2) + "\n")
    print(f"results: {out_dir / 'logits_memory.json'}")


if __name__ == "__main__":
    main()
