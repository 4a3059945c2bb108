"""Many small steps (issue 40, part 2): the paper's entropy claim at our scale.

    python benchmarks/small_steps.py --quick                                  # tiny model: checks the pipeline
    python benchmarks/small_steps.py --pilot --lrs 2e-5 1e-5 5e-6 --out runs/small_steps
    python benchmarks/small_steps.py --lr LR --seeds 0 1 2 --out runs/small_steps   # the four methods at LR
    OMP_NUM_THREADS=1 python benchmarks/small_steps.py --lr LR --seeds 1 --out runs/small_steps &  # two cores:
    OMP_NUM_THREADS=1 python benchmarks/small_steps.py --lr LR --seeds 2 --out runs/small_steps    # one seed each
    python benchmarks/small_steps.py --from-json runs/small_steps/small_steps.json --out benchmarks/results

The paper (CE-GPPO, Su et al.) trains with many small steps and reports that GRPO's entropy collapses, DAPO's
rises, and CE-GPPO's holds, and that CE-GPPO ends more accurate. Here: SmolLM2-135M on additions a + b with
operands in ``[--lo, --hi]`` (harder than the map's 2..12, so that the task is not learnt by step 20), temperature
1.0, 8 prompts x 8 samples, <= 40 new tokens, 4 AdamW mini-batches per step, warm-up 0, fp32, 60 steps, held-out
accuracy (64 problems) at steps 0, 20, 40 and 60.

Every run checkpoints every 10 steps into ``--out/runs/<run>``; a killed benchmark is run again with the same
arguments and continues: finished runs are kept in ``--out/small_steps.json``, an unfinished one resumes from its
newest checkpoint. Each record keeps how it was made (commit, machine and load, per session it ran in). Two
benchmarks may share one ``--out`` to use two cores (``OMP_NUM_THREADS=1`` each, disjoint ``--seeds``): the records
file is merged under a lock, never overwritten with one process's view.

The rules, fixed before any run (entropy of run r at step t: H_t; start S = mean of H_1..H_3; rolling R_t = mean of
H over steps t-4..t; per method the ratios are averaged over seeds, with their SE):

- **pilot** (GRPO, seed 0, from the largest learning rate down; the first that qualifies is the answer): the
  last mini-batch's beta-region share (low + high clip fractions) averages <= 3 % over the run, min_t R_t / S <= 0.70
  within the steps, and the rollout accuracy of step 20 is < 0.9 (not saturated). A run whose first 10 steps already
  average a share > 3 % is stopped there (too large a step).
- **GRPO falls**: R_last / S <= 0.70. **DAPO rises**: R_last / S >= 1.30.
- **CE-GPPO holds**: max over t >= 5 of |R_t / S - 1| <= 0.15, while GRPO falls or DAPO rises.
- **CE-GPPO beats**: its held-out accuracy at the last step exceeds the better baseline's (GRPO, DAPO) by more than
  their combined SE (sqrt(SE_a^2 + SE_b^2)).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from common import RESULTS, command, load_now, provenance, provenance_line, write_results
from common.entropy import METHODS, cell_key as key, mean_sem, per_step, pm, trainer_overrides, write_problems

PAPER_METHODS = ("GRPO", "DAPO", "CE-GPPO(0.5,1)", "CE-GPPO(0.75,1)")
SHARE_MAX, FALL, RISE, HOLD, SATURATED = 0.03, 0.70, 1.30, 0.15, 0.9
MIN_SEEDS = 3  # per method; with fewer, the report marks every verdict provisional
KEEP = ("entropy", "reward/mean", "reward/accuracy", "mb_last/clip/low_frac", "mb_last/clip/high_frac",
        "mb_last/ppo_kl", "response_length/mean", "response_length/clip_ratio", "time/step_s")


class Stop(Exception):
    """A pilot run stopped early (its reason)."""


def sizes(args) -> dict:
    if args.quick:
        return dict(model="tiny", precision="fp32", rollout_dtype="float32", steps=6, prompts=2, n=4,
                    max_new_tokens=12, max_prompt_tokens=160, eval_n=4, dynamic_sampling=False, every=3, save=2,
                    lo=2, hi=12)
    return dict(model="smollm2-135m-instruct", precision="fp32", rollout_dtype="float32", steps=args.steps,
                prompts=8, n=8, max_new_tokens=40, max_prompt_tokens=96, eval_n=64, dynamic_sampling=True,
                every=args.steps // 3, save=10, lo=args.lo, hi=args.hi)


# ---- the rules (pure functions of records; tests/test_small_steps.py checks them on records of known answer) ----

def measured(entropy: list[float | None]) -> list[float]:
    """The steps that measured an entropy (a step that made no update logs none)."""
    return [v for v in entropy if v is not None]


def start(entropy: list[float | None]) -> float:
    """S: the mean of the first three measured entropies."""
    return statistics.fmean(measured(entropy)[:3])


def ratios(entropy: list[float | None]) -> list[float]:
    """R_t / S for t = 5.. (see the module docstring); empty when fewer than 5 steps measured an entropy."""
    h = measured(entropy)
    if len(h) < 5:
        return []
    s = start(h)
    return [statistics.fmean(h[t - 4:t + 1]) / s for t in range(4, len(h))]


def ratio_at(entropy: list[float | None], step: int) -> float:
    """R_step / S on the steps' own numbering (steps without an entropy skipped inside the window); NaN when the
    run has no entropy in that window. Descriptive only: no verdict reads it."""
    window = measured(entropy[max(step - 5, 0):step])
    if len(measured(entropy)) < 3 or not window:
        return float("nan")
    return statistics.fmean(window) / start(entropy)


def first_eval_step(runs: list[dict]) -> int | None:
    """The earliest evaluated step after 0 (20 at 60 steps): the task is not yet saturated there."""
    return min((int(k) for r in runs for k in r.get("evals", {}) if int(k) > 0), default=None)


def beta_share(r: dict, upto: int | None = None) -> float:
    lo, hi = r["steps"]["mb_last/clip/low_frac"][:upto], r["steps"]["mb_last/clip/high_frac"][:upto]
    vals = [(a or 0.0) + (b or 0.0) for a, b in zip(lo, hi)]
    return statistics.fmean(vals) if vals else float("nan")


def pilot_verdict(r: dict) -> dict:
    """Whether a GRPO pilot run qualifies its learning rate, with the three measured criteria."""
    rs = ratios(r["steps"]["entropy"])
    acc = r["steps"]["reward/accuracy"]
    acc20 = acc[19] if len(acc) >= 20 else None
    out = dict(beta_share=beta_share(r), min_ratio=min(rs) if rs else float("nan"), accuracy_step20=acc20,
               stopped=r.get("stopped"))
    out["qualifies"] = (not r.get("stopped") and out["beta_share"] <= SHARE_MAX and out["min_ratio"] <= FALL
                        and acc20 is not None and acc20 < SATURATED)
    return out


def method_stats(runs: list[dict], method: str) -> dict:
    """Per method over seeds: the final entropy ratio, the largest deviation of R_t / S from 1, and the final
    held-out accuracy, each mean ± SE; the mean entropy curve with its SE band."""
    rs = [r for r in runs if r["method"] == method and not r.get("stopped")]
    per = [ratios(r["steps"]["entropy"]) for r in rs]
    per = [p for p in per if p]
    last_eval = [r["evals"][max(r["evals"], key=int)] for r in rs if r.get("evals")]
    steps = min((len(r["steps"]["entropy"]) for r in rs), default=0)
    curve = [mean_sem([r["steps"]["entropy"][t] for r in rs if r["steps"]["entropy"][t] is not None])
             for t in range(steps)]
    mid = first_eval_step(rs)
    at_mid = [x for x in (ratio_at(r["steps"]["entropy"], mid) for r in rs) if not math.isnan(x)] if mid else []
    length = [r["steps"]["response_length/mean"] for r in rs]
    return dict(method=method, seeds=len(rs), final_ratio=mean_sem([p[-1] for p in per]),
                max_dev=mean_sem([max(abs(x - 1) for x in p) for p in per]), accuracy=mean_sem(last_eval),
                curve=curve, mid_step=mid, mid_ratio=mean_sem(at_mid),
                length_first=mean_sem([statistics.fmean(v for v in x[:3] if v is not None) for x in length]),
                length_last=mean_sem([statistics.fmean(v for v in x[-5:] if v is not None) for x in length]))


def verdicts(runs: list[dict]) -> dict[str, dict]:
    """The four verdicts of the module docstring, each {met: bool, why: text}."""
    st = {m: method_stats(runs, m) for m in PAPER_METHODS}
    grpo, dapo = st["GRPO"], st["DAPO"]
    falls = grpo["seeds"] > 0 and grpo["final_ratio"][0] <= FALL
    rises = dapo["seeds"] > 0 and dapo["final_ratio"][0] >= RISE
    out = {"GRPO falls": dict(met=falls, why=f"R_last/S {pm(grpo['final_ratio'])} (<= {FALL} to meet)"),
           "DAPO rises": dict(met=rises, why=f"R_last/S {pm(dapo['final_ratio'])} (>= {RISE} to meet)")}
    better = max((grpo, dapo), key=lambda s: s["accuracy"][0] if s["seeds"] else -1)
    # A baseline at held-out 1.000 leaves no room above it: say so rather than let "NOT MET" read as a loss.
    ceiling = "; cannot be met on this task: the better baseline is at the ceiling" if better["seeds"] and \
        better["accuracy"][0] >= 1.0 else ""
    for m in PAPER_METHODS[2:]:
        s = st[m]
        holds = s["seeds"] > 0 and s["max_dev"][0] <= HOLD and (falls or rises)
        out[f"{m} holds"] = dict(met=holds, why=f"max |R_t/S - 1| {pm(s['max_dev'])} (<= {HOLD}, while GRPO falls "
                                                 f"or DAPO rises: {falls or rises})")
        se = math.hypot(_z(s["accuracy"][1]), _z(better["accuracy"][1]))
        gap = s["accuracy"][0] - better["accuracy"][0]
        out[f"{m} beats"] = dict(met=s["seeds"] > 1 and better["seeds"] > 1 and gap > se,
                                 why=f"held-out {pm(s['accuracy'])} vs {better['method']} {pm(better['accuracy'])}: "
                                     f"gap {gap:+.3f}, combined SE {se:.3f}{ceiling}")
    return out


def _z(x: float) -> float:
    return 0.0 if math.isnan(x) else x


# ---- running ----

def run_one(cell: dict, sz: dict, out: Path, data_dir: Path, device: str, pilot: bool) -> dict:
    """Train one run to its end (or a pilot's early stop), resuming from its newest checkpoint; its record."""
    from cegppo.config import load_config
    from cegppo.engine import checkpoint as ckpt
    from cegppo.engine.provenance import commit_label, machine
    from cegppo.engine.trainer import Trainer
    from cegppo.io import atomic_write_json, read_jsonl
    from cegppo.recipes import held_out_eval, log_eval, train_loop

    objective, hparams, extra = METHODS[cell["method"]]
    run_dir = out / "runs" / f"{cell['method']}-lr{cell['lr']:g}-seed{cell['seed']}".replace(",", "_")
    extra = [*extra, f"model.device={device}", f"train.save_every={sz['save']}", "train.keep_checkpoints=1",
             f"eval.every={sz['every']}"]
    ns = argparse.Namespace(temperature=1.0, lr=cell["lr"])
    cfg = load_config(None, trainer_overrides(dict(objective=objective, hparams=hparams, extra=extra), cell["seed"],
                                              sz, ns, data_dir, run_dir))
    resume = ckpt.latest_valid_checkpoint(run_dir / "checkpoints") is not None
    sessions_file = run_dir.parent / f"{run_dir.name}.sessions.json"  # beside the run: the trainer owns its dir
    sessions = json.loads(sessions_file.read_text()) if resume and sessions_file.exists() else []
    session = dict(commit=commit_label(), machine=machine(), precision=sz["precision"], overrides=METHODS[cell[
        "method"]][2], command=command(__file__))
    stopped = None

    def watch(tr, row) -> None:
        if pilot and row["step"] == 10:
            share = beta_share(dict(steps=per_step(read_jsonl(tr.run.metrics), KEEP)))
            if share > SHARE_MAX:
                raise Stop(f"beta-region share {share:.3f} > {SHARE_MAX} over the first 10 steps: too large a step")

    with Trainer(cfg, resume=resume, overwrite=not resume) as tr:
        session["from_step"] = tr.state["step"]
        atomic_write_json(sessions_file, [*sessions, session])  # kept if this session is killed too
        if not resume:
            log_eval(tr, "periodic", held_out_eval(tr))
            tr.save()  # step 0 with its eval: a resume never repeats it
        try:
            train_loop(tr, on_step=watch)
        except Stop as e:
            stopped = str(e)
    session["load_1min_end"] = load_now()
    atomic_write_json(sessions_file, [*sessions, session])
    rows = read_jsonl(run_dir / "metrics.jsonl")
    evals = {str(r["step"]): r["accuracy"] for r in read_jsonl(run_dir / "eval.jsonl") if r.get("tag") == "periodic"}
    return dict(cell, steps=per_step(rows, KEEP), evals=evals, stopped=stopped, sessions=[*sessions, session])


def records_lock(records: Path):
    """The lock every writer of the records file holds while it reads and rewrites it."""
    from filelock import FileLock

    return FileLock(str(records) + ".lock")


def keep_record(records: Path, part: str, rec: dict, header: dict) -> dict:
    """Add one finished record to the records file and return the file's whole content. The file is re-read under
    a lock, so that two benchmarks sharing one ``--out`` (each with its own ``--seeds``) keep each other's records."""
    from cegppo.io import atomic_write_json

    with records_lock(records):
        result = json.loads(records.read_text()) if records.exists() else {"pilot": [], "runs": []}
        result[part] = [r for r in result[part] if key(r) != key(rec)] + [rec]
        result.update(header)
        atomic_write_json(records, result)
    return result


def run(args, out: Path) -> dict:
    sz = sizes(args)
    records = out / "small_steps.json"
    result = json.loads(records.read_text()) if records.exists() else {"pilot": [], "runs": []}
    data_dir = write_problems(out / "data", sz["lo"], sz["hi"])  # deterministic: the same files on every resume

    def keep(part: str, rec: dict) -> None:
        nonlocal result
        result = keep_record(records, part, rec, dict(settings=dict(sz, temperature=1.0, mini_batches=4,
                                                                     device=args.device),
                                                      **provenance(__file__, sz["precision"])))

    if args.pilot:
        for lr in sorted(args.lrs, reverse=True):
            cell = dict(method="GRPO", lr=lr, seed=0)
            rec = next((r for r in result["pilot"] if key(r) == key(cell)), None)
            if rec is None:
                rec = run_one(cell, sz, out, data_dir, args.device, pilot=True)
                keep("pilot", rec)
            v = pilot_verdict(rec)
            print(f"pilot lr {lr:g}: {v}", flush=True)
            if v["qualifies"]:
                break
    else:
        methods = args.methods or (["GRPO", "CE-GPPO(0.75,1)"] if args.quick else list(PAPER_METHODS))
        for seed in args.seeds:  # seeds outermost: a session cut short leaves whole seeds of every method
            for m in methods:
                cell = dict(method=m, lr=args.lr, seed=seed)
                if any(key(r) == key(cell) for r in result["runs"]):
                    continue
                reuse = next((r for r in result["pilot"] if key(r) == key(cell) and not r.get("stopped")), None)
                keep("runs", reuse or run_one(cell, sz, out, data_dir, args.device, pilot=False))
                print(f"{key(cell)}: held-out {result['runs'][-1]['evals']}", flush=True)
    return result


# ---- the report ----

def report(result: dict) -> str:
    lines = ["# Many small steps: the paper's entropy claim at our scale\n",
             f"Generated by `{result['command']}`. Do not edit by hand; `--from-json` regenerates it.\n",
             provenance_line(result) + "\n", made_with(result) + "\n",
             f"Setting: {json.dumps(result['settings'])}.\n",
             "The rules, fixed before any run" + __doc__.split("The rules, fixed before any run")[1]]
    if result["pilot"]:
        lines += ["## Pilot (GRPO, seed 0)\n", "| lr | steps run | beta-region share | min R_t/S | rollout accuracy "
                  "at step 20 | held-out | stopped | qualifies |", "|---|---|---|---|---|---|---|---|"]
        for r in sorted(result["pilot"], key=lambda r: -r["lr"]):
            v = pilot_verdict(r)
            lines.append(f"| {r['lr']:g} | {len(r['steps']['entropy'])} | {v['beta_share']:.3f} | {v['min_ratio']:.3f}"
                         f" | {v['accuracy_step20']} | {r['evals']} | {r.get('stopped') or ''} | {v['qualifies']} |")
        ok = [r["lr"] for r in result["pilot"] if pilot_verdict(r)["qualifies"]]
        lines.append(f"\nLargest qualifying learning rate: {max(ok):g}\n" if ok else
                     "\nNo learning rate tried qualifies (yet).\n")
    if result["runs"]:
        lines += ["## Methods\n", "| method | seeds | R_last/S | max \\|R_t/S - 1\\| | held-out accuracy, last step "
                  "| R/S at the first evaluated step | response length, steps 1-3 -> last 5 |", "|---|---|---|---|---|---|---|"]
        for m in PAPER_METHODS:
            s = method_stats(result["runs"], m)
            if s["seeds"]:
                lines.append(f"| {m} | {s['seeds']} | {pm(s['final_ratio'])} | {pm(s['max_dev'])} | "
                             f"{pm(s['accuracy'])} | {pm(s['mid_ratio'])} (step {s['mid_step']}) | "
                             f"{pm(s['length_first'], 1)} -> {pm(s['length_last'], 1)} |")
        lines += ["\nThe last two columns are descriptive (no verdict reads them): the entropy ratio where the task is "
                  "not yet saturated, and the responses' length in tokens (the cap is the setting's max_new_tokens; "
                  "answer-only responses are shorter), since a run's entropy is a mean over the tokens it generated."]
        lines += ["\nHeld-out accuracy at each evaluated step (mean ± SE over seeds; no verdict reads the earlier "
                  "steps, they show where the methods part before the task saturates):\n"] + held_out_table(result["runs"])
        seeds = {m: method_stats(result["runs"], m)["seeds"] for m in PAPER_METHODS}
        short = min(seeds.values()) < MIN_SEEDS
        lines += ["\n## Verdicts\n"] + ([f"**Provisional**: the rules ask for >= {MIN_SEEDS} seeds per method; these "
                                          f"stand on {', '.join(f'{m} {n}' for m, n in seeds.items())}.\n"]
                                         if short else [])
        lines += [f"- {name}: **{'MET' if v['met'] else 'NOT MET'}{' (provisional)' if short else ''}** ({v['why']})"
                  for name, v in verdicts(result["runs"]).items()]
    return "\n".join(lines) + "\n"


def held_out_table(runs: list[dict]) -> list[str]:
    """Held-out accuracy per method at every evaluated step, mean ± SE over the method's finished seeds."""
    done = [r for r in runs if not r.get("stopped") and r.get("evals")]
    at = sorted({int(k) for r in done for k in r["evals"]})
    lines = ["| method | " + " | ".join(f"step {t}" for t in at) + " |", "|---" * (len(at) + 1) + "|"]
    for m in PAPER_METHODS:
        rs = [r for r in done if r["method"] == m]
        if rs:
            cells = [pm(mean_sem([r["evals"][str(t)] for r in rs if str(t) in r["evals"]])) for t in at]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def made_with(result: dict) -> str:
    sessions = [s for r in result["pilot"] + result["runs"] for s in r.get("sessions", [])]
    cpus = sorted({f"{s['machine']['cpu']} ({s['machine']['isa']})" for s in sessions})
    loads = [s["machine"]["load_1min"] for s in sessions] + [s.get("load_1min_end") for s in sessions]
    loads = [x for x in loads if x is not None]
    return (f"Runs made at {', '.join(sorted({s['commit'] for s in sessions}))} on {', '.join(cpus)}, in "
            f"{len(sessions)} session(s); 1-minute load {min(loads, default=0):g}-{max(loads, default=0):g} at the "
            f"sessions' starts and ends (each record keeps its own).")


def plot(result: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in PAPER_METHODS:
        curve = method_stats(result["runs"], m)["curve"]
        if curve:
            mean = [c[0] for c in curve]
            se = [_z(c[1]) for c in curve]
            xs = range(1, len(mean) + 1)
            ax.plot(xs, mean, label=m)
            ax.fill_between(xs, [a - b for a, b in zip(mean, se)], [a + b for a, b in zip(mean, se)], alpha=0.2)
    for r in result["pilot"]:  # the pilot's GRPO runs, one per learning rate
        ax.plot(range(1, len(r["steps"]["entropy"]) + 1), r["steps"]["entropy"], ls=":",
                label=f"pilot: GRPO lr {r['lr']:g}, seed {r['seed']}")
    ax.set_xlabel("step")
    ax.set_ylabel("rollout token entropy (mean ± SE over seeds)")
    # A step whose groups were all solved makes no update and logs no entropy: later points average fewer seeds.
    ax.set_title("steps without an update are left out of the mean", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "small_steps.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pilot", action="store_true", help="GRPO, seed 0, at each of --lrs from the largest down")
    ap.add_argument("--lrs", type=float, nargs="+", default=[2e-5, 1e-5, 5e-6])
    ap.add_argument("--lr", type=float, help="the methods' learning rate (the pilot's answer)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--methods", nargs="+", choices=PAPER_METHODS)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lo", type=int, default=10, help="smallest operand")
    ap.add_argument("--hi", type=int, default=49, help="largest operand")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--from-json", type=Path, help="only rebuild the report from these records")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.lrs, args.lr, args.seeds = [1e-4], args.lr or 1e-4, [0]
    if not (args.pilot or args.from_json or args.lr):
        ap.error("give --pilot, --lr LR (the pilot's answer) or --from-json")
    out = args.out or (Path("runs/small_steps_quick") if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        result = dict(json.loads(args.from_json.read_text()), **provenance(__file__, "fp32"))
        plot(result, out)
        write_results(out, "small_steps", result, report(result))
        return
    result = run(args, out)
    records = out / "small_steps.json"
    with records_lock(records):  # the report from the file as it is now: a benchmark beside this one wrote to it too
        result = json.loads(records.read_text()) if records.exists() else result
        plot(result, out)
        write_results(out, "small_steps", result, report(result))


if __name__ == "__main__":
    sys.exit(main())
