"""The stability map (issue 40, part 1): where each method holds as the step grows.

    python benchmarks/stability_map.py --quick                       # tiny model, 2 cells: checks the pipeline
    python benchmarks/stability_map.py --device cuda --parallel 16 --budget-s 240 --out DIR
    python benchmarks/stability_map.py --from-json A/stability_map.json B/stability_map.json --out benchmarks/results
        # report only, from the records of one or more runs of the map (merged; a cell run twice keeps its newest)

Every cell (method x learning rate x seed) is one run of the entropy benchmark's setting (SmolLM2-135M on the
additions a + b, temperature 1.0, 16 prompts x 8 samples, <= 40 new tokens, 4 AdamW mini-batches per step, warm-up
0, no weight decay, 10 steps; benchmarks/common/entropy.py), in its own process (``--parallel`` at a time), and
leaves a record: per step the rollout reward, accuracy, entropy, truncation share, the last mini-batch's
KL(old||new) and clip-region shares, each token quadrant's first-order entropy change (from 3b0dee5 on), the
collapse guard's findings; the held-out accuracy before and after; the wall time; and how it was made (commit,
machine with its load at the start and the end, precision, overrides). Records are kept in ``stability_map.json``
as they finish (``--restore`` continues from one); cells not started when ``--budget-s`` runs out are left for a
later run and listed in the report.

Collapse, fixed before any run: a run *collapses* when the collapse guard (cegppo.algorithm.collapse, default
bounds) names a failure at any step, or its final held-out accuracy is below 0.2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cegppo.algorithm.diagnostics import QUADRANTS
from common import RESULTS, command, load_now, provenance, provenance_line, write_results
from common.entropy import (METHODS, cell_key as key, first, mean_sem, per_step, pm, trainer_overrides,
                            write_problems)

COLLAPSE_ACCURACY = 0.2  # final held-out accuracy below this: collapsed (with the guard's findings)
MIN_SEEDS = 3  # per cell; the report lists the cells with fewer as provisional
KEEP = ("reward/mean", "reward/accuracy", "entropy", "response_length/mean", "response_length/clip_ratio",
        "mb_last/ppo_kl", "mb_last/clip/low_frac", "mb_last/clip/high_frac", "grad_norm", "collapse/flag",
        "train/kl_stopped_at", *(f"quadrant/{q}/dH" for q in QUADRANTS), "dH/predicted")  # dH: which quadrant moves entropy


def sizes(args) -> dict:
    if args.quick:
        return dict(model="tiny", precision="fp32", rollout_dtype="float32", steps=2, prompts=2, n=4, max_new_tokens=16,
                    max_prompt_tokens=160, eval_n=4, dynamic_sampling=False)
    return dict(model="smollm2-135m-instruct", precision="fp32", rollout_dtype="float32", steps=args.steps,
                prompts=16, n=8, max_new_tokens=40, max_prompt_tokens=96, eval_n=32, dynamic_sampling=True)


def worker(cell: dict, sz: dict, device: str, data_dir: Path, run_dir: Path, threads: int) -> dict:
    """One cell: train, evaluate before and after, return its record."""
    from cegppo.config import load_config
    from cegppo.engine.trainer import Trainer
    from cegppo.io import read_jsonl
    from cegppo.recipes import held_out_eval, log_eval, train_loop

    from cegppo.engine.provenance import commit_label, machine

    objective, hparams, extra = METHODS[cell["method"]]
    made = dict(commit=commit_label(), machine=machine(), precision=sz["precision"], overrides=extra)  # per record
    conf = dict(objective=objective, hparams=hparams, extra=[*extra, f"model.device={device}", f"train.threads={threads}"])
    ns = argparse.Namespace(temperature=1.0, lr=cell["lr"])
    t0 = time.perf_counter()
    findings = []
    with Trainer(load_config(None, trainer_overrides(conf, cell["seed"], sz, ns, data_dir, run_dir)),
                 overwrite=True) as tr:
        base = log_eval(tr, "base", held_out_eval(tr))["accuracy"]
        train_loop(tr, on_step=lambda t, row: findings.extend(f"step {row['step']}: {f}" for f in t.collapse))
        final = log_eval(tr, "final", held_out_eval(tr))["accuracy"]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    first_flag = next((r["step"] for r in rows if r.get("collapse/flag")), None)
    return dict(cell, steps=per_step(rows, KEEP), base_accuracy=base, final_accuracy=final,
                guard=findings, guard_first_step=first_flag, collapsed=collapsed(findings, final),
                wall_s=time.perf_counter() - t0, provenance=dict(made, load_1min_end=load_now()))


def replay_guard(steps: dict[str, list], target_kl: float = 0.0) -> list[str]:
    """The collapse guard's findings on a record's per-step metrics (as the trainer would log them now), so that every
    record is judged by the same, current rule when the report is built. Records made before ``train/kl_stopped_at``
    was kept: a KL-stopped step is the one whose last mini-batch's KL passed ``target_kl`` (the stop's own test)."""
    from cegppo.algorithm.collapse import CollapseGuard

    guard, found = CollapseGuard(), []
    for i in range(len(steps["entropy"])):
        row = {k: v[i] for k, v in steps.items()}
        if "train/kl_stopped_at" not in steps and target_kl and (row.get("mb_last/ppo_kl") or 0) > target_kl:
            row["train/kl_stopped_at"] = -1  # stopped, at a mini-batch the record does not name
        found += [f"step {i + 1}: {f}" for f in guard.check(row)]
    return found


def target_kl(method: str) -> float:
    return next((float(x.split("=")[1]) for x in METHODS[method][2] if x.startswith("train.target_kl=")), 0.0)


def collapsed(guard_findings: list[str], final_accuracy: float) -> bool:
    """The map's collapse definition, fixed before any run (module docstring)."""
    return bool(guard_findings) or final_accuracy < COLLAPSE_ACCURACY


def cells(args) -> list[dict]:
    methods = args.methods or (["GRPO", "CE-GPPO(0.75,1)"] if args.quick else list(METHODS))
    lrs = [1e-5] if args.quick else args.lrs
    return [dict(method=m, lr=lr, seed=s) for lr in lrs for m in methods for s in (args.seeds if not args.quick else [0])]


def run_all(args, out: Path) -> dict:
    sz = sizes(args)
    result = json.loads(args.restore.read_text()) if args.restore else {"runs": []}
    done = {key(r) for r in result["runs"]}
    todo = [c for c in cells(args) if key(c) not in done]
    work = Path(tempfile.mkdtemp(prefix="stability_map_"))
    data_dir = write_problems(work / "data")
    if not args.quick:  # convert the bundled model once, before processes race to do it
        from cegppo.engine.models import load_model
        load_model(sz["model"])
    running: list[tuple[subprocess.Popen, dict, Path]] = []
    t0 = time.monotonic()
    while todo or running:
        while todo and len(running) < args.parallel and time.monotonic() - t0 < args.budget_s:
            c = todo.pop(0)
            rec = work / f"{len(result['runs'])}_{len(running)}_{time.monotonic_ns()}.json"
            cmd = [sys.executable, __file__, "--worker", json.dumps(c), "--settings", json.dumps(sz),
                   "--device", args.device, "--data", str(data_dir), "--record", str(rec),
                   "--threads", str(1 if args.parallel > 1 else 0)]
            log = open(rec.with_suffix(".log"), "w")
            env = {**os.environ, "OMP_NUM_THREADS": "1"} if args.parallel > 1 else dict(os.environ)
            running.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), c, rec))
        if time.monotonic() - t0 >= args.budget_s:
            todo.clear()
        for p, c, rec in list(running):
            if p.poll() is None:
                continue
            running.remove((p, c, rec))
            if p.returncode == 0 and rec.exists():
                result["runs"].append(json.loads(rec.read_text()))
                r = result["runs"][-1]
                r["provenance"]["command"] = command(__file__)
                print(f"{key(c)}: acc {r['base_accuracy']:.3f} -> {r['final_accuracy']:.3f}, collapsed "
                      f"{r['collapsed']}, {r['wall_s']:.0f} s", flush=True)
                from cegppo.io import atomic_write_json
                atomic_write_json(out / "stability_map.json", result)  # every finished cell kept: --restore resumes
            else:
                print(f"{key(c)}: failed (rc {p.returncode}): {rec.with_suffix('.log').read_text()[-1500:]}", flush=True)
        time.sleep(0.5)
    result["pending"] = [key(c) for c in cells(args) if key(c) not in {key(r) for r in result["runs"]}]
    result.update(settings=dict(sz, temperature=1.0, mini_batches=4, device=args.device,
                                collapse=f"guard finding at any step, or final held-out accuracy < {COLLAPSE_ACCURACY}"),
                  **provenance(__file__, "fp32"))
    return result


def merge(files: list[Path]) -> dict:
    """The records of several ``stability_map.json`` files as one result (for ``--collect``). A record made before
    records kept their own provenance takes its file's (commit, machine, precision); a cell found twice keeps the
    record of the later file. Files measured in different settings are refused (one line naming both)."""
    merged: dict[str, dict] = {}
    settings, first = None, None
    for f in files:
        part = json.loads(f.read_text())
        s = {k: v for k, v in part["settings"].items() if k != "device"}
        if settings is None:
            settings, first = s, f
        elif s != settings:
            sys.exit(f"stability_map: {f} was measured in another setting than {first}: "
                     f"{ {k: v for k, v in s.items() if settings.get(k) != v} }")
        for r in part["runs"]:
            made = r.setdefault("provenance", dict(commit=part["commit"], machine=part["machine"],
                                                   precision=part["precision"], overrides=METHODS[r["method"]][2]))
            made.setdefault("command", part["command"])
            merged[key(r)] = r
    return dict(json.loads(files[-1].read_text()), runs=list(merged.values()), pending=[])


def made_with(runs: list[dict]) -> str:
    """One line of how the records were made: their commits, CPUs and the load they ran under."""
    commits = sorted({r["provenance"]["commit"] for r in runs if "provenance" in r})
    cpus = sorted({f"{r['provenance']['machine']['cpu']} ({r['provenance']['machine']['isa']})" for r in runs
                   if "provenance" in r})
    loads = [r["provenance"]["machine"]["load_1min"] for r in runs if "provenance" in r]
    load = f", 1-minute load at start {min(loads):g}-{max(loads):g}" if loads else ""
    commands = sorted({r["provenance"]["command"] for r in runs if "command" in r.get("provenance", {})})
    return (f"Records made at {', '.join(commits)} on {', '.join(cpus)}{load} (each record keeps its own), by "
            + "; ".join(f"`{c}`" for c in commands) + ".")


def judge(runs: list[dict]) -> None:
    """Each record's guard findings and collapse verdict, from its steps under the current guard."""
    for r in runs:
        r["guard"] = replay_guard(r["steps"], target_kl(r["method"]))
        r["collapsed"] = collapsed(r["guard"], r["final_accuracy"])


def _last(key: str, r: dict) -> float:
    vals = [v for v in r["steps"][key] if v is not None]
    return vals[-1] if vals else float("nan")


def _mean(key: str, r: dict) -> float:
    vals = [v for v in r["steps"][key] if v is not None]
    return sum(vals) / len(vals) if vals else float("nan")


def _sum(key: str, r: dict) -> float:
    return sum(v for v in r["steps"][key] if v is not None)


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (lr, method): seeds, collapses, and means over seeds (± SE for accuracy, KL and region shares)."""
    out = []
    for lr in sorted({r["lr"] for r in runs}):
        for m in METHODS:
            rs = [r for r in runs if r["method"] == m and r["lr"] == lr]
            if rs:
                out.append(dict(method=m, lr=lr, seeds=len(rs), collapsed=sum(r["collapsed"] for r in rs),
                                acc=mean_sem([r["final_accuracy"] for r in rs]),
                                kl=mean_sem([_mean("mb_last/ppo_kl", r) for r in rs]),
                                beta1_share=mean_sem([_mean("mb_last/clip/low_frac", r) for r in rs]),
                                beta2_share=mean_sem([_mean("mb_last/clip/high_frac", r) for r in rs]),
                                entropy=(mean_sem([r["steps"]["entropy"][0] or 0 for r in rs])[0],
                                         mean_sem([_last("entropy", r) for r in rs])[0]),
                                length=mean_sem([_last("response_length/mean", r) for r in rs])[0],
                                wall=mean_sem([r["wall_s"] for r in rs])[0]))
    return out


def entropy_by_quadrant(runs: list[dict]) -> list[str]:
    """The report's table of which token quadrant moved entropy: each quadrant's first-order entropy change (the
    trainer's ``quadrant/<Q>/dH``, a unit step on the logits) summed over a run's steps, mean over seeds, beside the
    entropy the rollouts measured (last - first). Only records that keep ``dH`` (made from 3b0dee5 on)."""
    keyed = [r for r in runs if "dH/predicted" in r["steps"]]
    if not keyed:
        return []
    lines = ["\nWhere entropy moved, by token quadrant (PA/NA: advantage positive / negative; HP/LP: the sampled token's "
             "probability >= / < 0.5 under pi_old): each quadrant's first-order entropy change (`quadrant/<Q>/dH`, for "
             "a unit step on the logits, so its scale is not the lr's; its sign and share are the point) summed over "
             "the run's steps, mean over the seeds whose records keep it; the last column is the entropy the rollouts "
             "measured, last step - first:\n",
             "| method | lr | seeds | " + " | ".join(f"{q} dH" for q in QUADRANTS) + " | sum | entropy last - first |",
             "|---|---|---|" + "---|" * (len(QUADRANTS) + 2)]
    for lr in sorted({r["lr"] for r in keyed}):
        for m in METHODS:
            rs = [r for r in keyed if r["method"] == m and r["lr"] == lr]
            if rs:
                dh = [mean_sem([_sum(f"quadrant/{q}/dH", r) for r in rs])[0] for q in QUADRANTS]
                moved = mean_sem([_last("entropy", r) - first(r["steps"]["entropy"]) for r in rs])[0]
                lines.append(f"| {m} | {lr:g} | {len(rs)} | " + " | ".join(f"{v:+.3f}" for v in dh)
                             + f" | {mean_sem([_sum('dH/predicted', r) for r in rs])[0]:+.3f} | {moved:+.2f} |")
    return lines


def report(result: dict) -> str:
    summary = summarize(result["runs"])
    lines = [f"# Stability map: collapse and accuracy as the step grows\n",
             f"Generated by `{result['command']}`. Do not edit by hand; `--collect` regenerates it.\n",
             provenance_line(result) + "\n", made_with(result["runs"]) + "\n",
             f"Setting: {json.dumps(result['settings'])}.\n",
             f"Collapse (fixed before the runs): {result['settings']['collapse']}.\n",
             "| method | lr | seeds | collapsed | held-out accuracy (mean ± SE) | KL(old‖new), last mini-batch, mean over "
             "steps | beta1 / beta2-region share, last mini-batch | entropy first -> last | final length | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['method']} | {s['lr']:g} | {s['seeds']} | {s['collapsed']}/{s['seeds']} | "
                     f"{pm(s['acc'])} | {s['kl'][0]:.3f} | {s['beta1_share'][0]:.3f} / "
                     f"{s['beta2_share'][0]:.3f} | {s['entropy'][0]:.2f} -> {s['entropy'][1]:.2f} | {s['length']:.1f} | "
                     f"{s['wall']:.0f} |")
    lines += ["\nThe step sizes, measured (GRPO's cells: its clip keeps PPO's trust region, so its last mini-batch's KL and "
              "region shares measure the step itself; all cells for comparison):\n",
              "| lr | GRPO seeds | GRPO KL(old‖new) | GRPO beta1 / beta2-region share | all cells | all cells' KL |",
              "|---|---|---|---|---|---|"]
    none = dict(seeds=0, kl=(float("nan"),) * 2, beta1_share=(float("nan"),) * 2, beta2_share=(float("nan"),) * 2)
    for lr in sorted({s["lr"] for s in summary}):
        g = next((s for s in summary if s["method"] == "GRPO" and s["lr"] == lr), none)  # its summary row
        every = [r for r in result["runs"] if r["lr"] == lr]
        lines.append(f"| {lr:g} | {g['seeds']} | {pm(g['kl'], 4)} | {g['beta1_share'][0]:.3f} / "
                     f"{g['beta2_share'][0]:.3f} | {len(every)} | "
                     f"{mean_sem([_mean('mb_last/ppo_kl', r) for r in every])[0]:.4f} |")
    lines.append("\nLargest learning rate with no collapse at any seed (among those run):\n")
    for m in METHODS:
        rows = [s for s in summary if s["method"] == m]
        if rows:
            ok = [s["lr"] for s in rows if s["collapsed"] == 0]
            lines.append(f"- {m}: {max(ok):g}" if ok else f"- {m}: none of {[s['lr'] for s in rows]}")
    few = [f"{s['method']} at {s['lr']:g} ({s['seeds']})" for s in summary if s["seeds"] < MIN_SEEDS]
    if few:
        lines.append(f"\nProvisional, fewer than {MIN_SEEDS} seeds (seeds run): {', '.join(few)}.")
    if result.get("pending"):
        lines.append(f"\nNot run (budget): {len(result['pending'])} cells: {', '.join(result['pending'])}.")
    lines += entropy_by_quadrant(result["runs"])
    guard = [f"- {r['method']} lr {r['lr']:g} seed {r['seed']}: {r['guard'][0]} (held-out accuracy "
             f"{r['base_accuracy']:.3f} -> {r['final_accuracy']:.3f})" for r in result["runs"] if r["guard"]]
    if guard:  # the final accuracy beside each finding: a run flagged on the way may still end well
        lines += ["\nThe collapse guard's first finding per flagged run, with the run's held-out accuracy before and "
                  "after:\n", *guard]
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize(result["runs"])
    if not summary:
        return
    methods = [m for m in METHODS if any(s["method"] == m for s in summary)]
    lrs = sorted({s["lr"] for s in summary})
    fig, ax = plt.subplots(figsize=(1.6 * len(lrs) + 3, 0.5 * len(methods) + 1.5))
    grid = [[float("nan")] * len(lrs) for _ in methods]
    for s in summary:
        i, j = methods.index(s["method"]), lrs.index(s["lr"])
        grid[i][j] = s["collapsed"] / s["seeds"]
        ax.text(j, i, f"{s['acc'][0]:.2f}\n{s['collapsed']}/{s['seeds']}", ha="center", va="center", fontsize=8)
    for i, row in enumerate(grid):  # a cell not run is said so, not left blank like a safe one
        for j, v in enumerate(row):
            if math.isnan(v):
                ax.text(j, i, "not run", ha="center", va="center", fontsize=7, color="grey")
    im = ax.imshow(grid, cmap="Reds", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
    ax.set_yticks(range(len(methods)), methods)
    ax.set_xlabel("learning rate (4 mini-batches per step)")
    ax.set_title("held-out accuracy, collapsed/seeds", fontsize=9)
    fig.colorbar(im, label="collapse rate over seeds")
    fig.tight_layout()
    fig.savefig(out / "stability_map.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lrs", type=float, nargs="+", default=[3e-6, 1e-5, 5e-5])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--methods", nargs="+", choices=list(METHODS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--parallel", type=int, default=1, help="cells run at a time, each its own process")
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="start no cell after this many seconds")
    ap.add_argument("--restore", type=Path, help="a stability_map.json whose runs are kept (resume)")
    ap.add_argument("--collect", "--from-json", type=Path, nargs="+",
                    help="only rebuild the report from these stability_map.json files (records merged)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--settings", help=argparse.SUPPRESS)
    ap.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--record", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        cell = json.loads(args.worker)
        rec = worker(cell, json.loads(args.settings), args.device, args.data, args.record.with_suffix(".run"),
                     args.threads)
        args.record.write_text(json.dumps(rec))
        return
    out = args.out or (Path("runs/stability_map_quick") if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(merge(args.collect), **provenance(__file__, "fp32")) if args.collect else run_all(args, out)
    judge(result["runs"])
    plot(result, out)
    write_results(out, "stability_map", result, report(result))


if __name__ == "__main__":
    main()
