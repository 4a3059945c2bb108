"""The quickstart's supervised warm-start under each precision, over seeds: held-out strict accuracy after it (the
quickstart's eval: 64 problems, greedy, generated in fp32) and the held-out NLL of the test problems' reference
solutions (teacher-forced, fp32: the warm-start's own objective on problems it never saw, far less noisy than 64
greedy answers).

    python benchmarks/precision_warmstart.py                   # fp32 and bf16 (emulated), seeds 0 1 2
    python benchmarks/precision_warmstart.py --modes fp32 'bf16 (emulated), fp32 head' --seeds 0
    python benchmarks/precision_warmstart.py --quick           # smoke test: the tiny model, into runs/

Each run is the product's path: a :class:`~cegppo.engine.trainer.Trainer` on ``examples/quickstart.yaml`` with
``train.seed=SEED`` (fp32 master weights, ``model.rollout_dtype=float32``), then :func:`cegppo.recipes.warm_start`
inside the mode's context (:func:`common.bf16_rounding.precision_context`), then :func:`cegppo.recipes.held_out_eval`.
In ``fp32`` it is exactly the warm-start of ``cegppo train quickstart train.seed=SEED``, so its accuracy must equal
the quickstart's "warm-start" figure for that seed (benchmarks/results/quickstart_seeds.json): a check that this
script measures the product. ``bf16-autocast`` is ``model.precision=bf16-autocast`` itself; on a CPU without native
bf16 its kernels are far slower than fp32 (precision_gradients.md), so there the ``bf16 (emulated)`` modes stand in
for it (same rounding, fp32 speed; see common/bf16_rounding.py). Runs go to ``runs/precision_warmstart/``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path

import torch

from cegppo.engine.model_forward import sequence_token_stats
from cegppo.algorithm.objectives import aggregate
from cegppo.cli import _resolve_config
from cegppo.config import load_config
from cegppo.engine.sft import sft_batch
from cegppo.engine.trainer import Trainer
from cegppo.recipes import held_out_eval, warm_start

from common import RESULTS, ROOT, provenance, provenance_line, quick_out, spread, write_results
from common.bf16_rounding import EMULATED, precision_context

QUICK = ["model.name=tiny", "sft.steps=3", "sft.batch_size=4", "data.num_train=64", "data.num_test=4",
         "eval.num_problems=4", "eval.max_new_tokens=8"]


@torch.no_grad()
def reference_nll(trainer: Trainer, rows: int = 16) -> float:
    """Token-mean NLL of the held-out problems' reference solutions under the trainer's policy, in fp32."""
    total = tokens = 0.0
    problems = trainer.test_problems[: trainer.cfg.eval.num_problems or None]
    for s in range(0, len(problems), rows):
        ids, attn, mask = (x.to(trainer.device) for x in sft_batch(trainer.tokenizer, problems[s : s + rows]))
        lp, _, _ = sequence_token_stats(trainer.model, ids, attn, mask.shape[1])
        total += float(aggregate(-lp, mask, "token-sum"))
        tokens += float(mask.sum())
    return total / tokens


def run(config: str, mode: str, seed: int, runs_dir: Path, extra: list[str]) -> dict:
    slug = re.sub(r"[^a-z0-9]+", "-", mode.lower()).strip("-")
    cfg = load_config(_resolve_config(config), [
        f"train.seed={seed}", f"output_dir={runs_dir / f'{slug}-seed{seed}'}", "logging.progress=false",
        "train.save_every=0", "model.rollout_dtype=float32",
        f"model.precision={'bf16-autocast' if mode == 'bf16-autocast' else 'fp32'}", *extra])
    t0 = time.perf_counter()
    with Trainer(cfg, overwrite=True) as trainer:
        with precision_context(trainer.model, "fp32" if mode == "bf16-autocast" else mode):  # autocast: the trainer's
            losses = warm_start(trainer)
        sft_s = time.perf_counter() - t0
        accuracy = held_out_eval(trainer).headline("avg@k")
        nll = reference_nll(trainer)
    row = {"mode": mode, "seed": seed, "accuracy": accuracy, "reference_nll": nll, "sft_losses": losses,
           "setup_and_sft_s": sft_s, "wall_s": time.perf_counter() - t0}
    print(f"{mode:28s} seed {seed}: accuracy {accuracy:.3f}, reference NLL {nll:.4f}, last SFT loss {losses[-1]:.4f} "
          f"({row['wall_s']:.0f} s)", flush=True)
    return row


def report(result: dict) -> str:
    seeds = result["seeds"]
    lines = ["# The quickstart's warm-start by precision", "", f"`{result['command']}`", "", provenance_line(result), "",
             result["setup"], "", "| mode | " + " | ".join(f"seed {s}: accuracy / NLL" for s in seeds)
             + " | accuracy mean ± sd | reference NLL mean ± sd | s per run |", "|---|" + "---|" * (len(seeds) + 3)]
    for mode, s in result["summary"].items():
        rows = [r for r in result["runs"] if r["mode"] == mode]
        lines.append(f"| {mode} | " + " | ".join(f"{r['accuracy']:.3f} / {r['reference_nll']:.4f}" for r in rows)
                     + f" | {s['accuracy']['mean']:.3f} ± {s['accuracy']['sd']:.3f} | {s['reference_nll']['mean']:.4f} "
                     f"± {s['reference_nll']['sd']:.4f} | {statistics.fmean(r['wall_s'] for r in rows):.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="quickstart")
    ap.add_argument("--modes", nargs="+", default=["fp32", EMULATED[0]],
                    choices=["fp32", "bf16-autocast", *EMULATED])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--quick", action="store_true", help="the tiny model, 3 steps, 4 problems: a smoke test")
    ap.add_argument("--out", type=Path, help=f"results directory (default {RESULTS}; --quick: runs/precision_warmstart_quick)")
    args = ap.parse_args()
    if args.quick:
        args.seeds = args.seeds[:1]
    out_dir = args.out or (quick_out("precision_warmstart") if args.quick else RESULTS)
    runs_dir = out_dir / "runs" if args.quick else ROOT / "runs" / "precision_warmstart"
    prov = provenance("precision_warmstart.py", ", ".join(args.modes) + " (fp32 master weights, fp32 generation)")
    extra = QUICK if args.quick else []
    runs = [run(args.config, mode, seed, runs_dir, extra) for mode in args.modes for seed in args.seeds]
    summary = {mode: {k: spread([r[k] for r in runs if r["mode"] == mode]) for k in ("accuracy", "reference_nll")}
               for mode in args.modes}
    setup = (f"Config `{args.config}`{' + ' + ' '.join(extra) if extra else ''}: the supervised warm-start, then the "
             "held-out eval (strict accuracy, greedy) and the reference solutions' NLL on the same held-out problems.")
    result = {**prov, "setup": setup, "seeds": args.seeds, "runs": runs, "summary": summary}
    write_results(out_dir, "precision_warmstart", result, report(result))


if __name__ == "__main__":
    main()
