"""The quickstart's figures as a distribution: ``cegppo train`` (examples/quickstart.yaml, exactly as a user runs it)
with several values of ``train.seed`` (sampling, data order, warm-start batches; the held-out problems stay the
same), then mean, standard deviation and range of the held-out accuracy at each stage, the wall time and the
peak RSS, with the machine (CPU model and ISA, precision, load) and the commit.

    python benchmarks/quickstart_seeds.py                      # seeds 0 1 2, ~25 min each on a 2-core AVX2 CPU
    python benchmarks/quickstart_seeds.py --quick              # seconds: the tiny model, 2 steps, into runs/
    python benchmarks/quickstart_seeds.py --from-json benchmarks/results/quickstart_seeds.json   # re-render
    python benchmarks/quickstart_seeds.py --name warmstart_fp32 --set train.steps=0 --set model.precision=fp32
        # a variant: the overrides apply to every seed; results in <name>.{json,md}, runs in runs/<name>/seedN

Each seed runs as its own ``cegppo train`` process in ``runs/quickstart-seeds/seedN``; a seed whose run finished is
reused (``--rerun`` trains it again), so an interrupted benchmark resumes where it stopped, and seeds run as separate
``cegppo train`` commands can be collected. Each run's commit is recorded beside the commit that collected them.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from common import RESULTS, ROOT, in_checkout, load_now, spread, write_results
from common import command as results_command

STAGES = ("base", "warm-start", "final")
QUICK = ["sft.steps=2", "train.steps=2", "data.num_train=32", "data.num_test=8", "eval.num_problems=8",
         "rollout.n=4", "train.prompts_per_step=2", "train.save_every=0", "rollout.max_new_tokens=16"]


def command(config: str, seed: int, out: Path, extra: list[str]) -> list[str]:
    """The run's command, with ``out`` relative to the repository (results files record no machine paths)."""
    return [sys.executable, "-m", "cegppo.cli", "train", config, f"train.seed={seed}",
            f"output_dir={in_checkout(out)}", "logging.progress=false", *extra]


def relative(record: dict) -> dict:
    """A run's provenance with the checkout's path made relative (for runs recorded before :func:`command` did)."""
    prov = dict(record.get("provenance") or {})
    # this checkout's path, or another clone's (a seed run from a fresh clone): relative to the repository
    prov["command"] = re.sub(r"^\S*?/(src/cegppo/)", r"\1", prov.get("command", "").replace(str(ROOT) + "/", ""))
    return {**record, "provenance": prov}


def load_file(out: Path) -> Path:
    """Where a run's load samples go: beside its directory (the run directory holds only the run's own files)."""
    return out.parent / f"{out.name}.load.json"


class LoadSampler(threading.Thread):
    """The 1-minute load average every ``interval_s`` while a run trains, saved to :func:`load_file` as it goes:
    what says whether the run's wall time is the quickstart's duration (the run alone on the machine) or not."""

    def __init__(self, path: Path, interval_s: float = 15.0):
        super().__init__(daemon=True)
        path.parent.mkdir(parents=True, exist_ok=True)  # its first sample comes before the run makes its directory
        self.path, self.interval_s, self.stop = path, interval_s, threading.Event()
        self.record = {"interval_s": interval_s, "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "samples": []}

    def run(self) -> None:
        from cegppo.io import atomic_write_json

        t0 = time.monotonic()
        while True:
            self.record["samples"].append([round(time.monotonic() - t0, 1), load_now()])
            atomic_write_json(self.path, self.record)
            if self.stop.wait(self.interval_s):
                return


def run_load(out: Path, cores: int) -> dict | None:
    """The load a run trained under, from its samples (None: not sampled): max and mean of the 1-minute load,
    whether the samples began with the run, and ``alone``: a mean of at most cores + 0.5 and a max of at most
    1.5 x cores (one training process alone keeps the 1-minute load near the core count: 1.9-2.3 on 2 cores; a
    one-thread job beside it brought it to 2.5-2.8)."""
    path = load_file(out)
    if not path.is_file():
        return None
    rec = json.loads(path.read_text())
    loads = [x for _, x in rec["samples"]]
    run = out / "run.json"
    started = json.loads(run.read_text()).get("started") if run.is_file() else None
    late = (datetime.fromisoformat(rec["since"]) - datetime.fromisoformat(started)).total_seconds() if started else None
    return {"since": rec["since"], "samples": len(loads), "max": max(loads), "mean": statistics.fmean(loads),
            "sampled_from_start_s": late,
            "alone": statistics.fmean(loads) <= cores + 0.5 and max(loads) <= 1.5 * cores}


def run_seed(config: str, seed: int, out: Path, extra: list[str], rerun: bool) -> dict:
    """One seed's summary.json: a finished run is reused (its own provenance names the commit it ran at) unless
    ``rerun``; else it is trained from scratch, its load sampled (:class:`LoadSampler`)."""
    summary = out / "summary.json"
    if summary.is_file() and not rerun:
        done = json.loads(summary.read_text())
        print(f"seed {seed}: reusing {in_checkout(out)} (finished at "
              f"{run_commit(done)})", flush=True)
        return done
    cmd = command(config, seed, out, extra) + (["--overwrite"] if out.exists() else [])
    print(f"seed {seed}: {shlex.join(cmd[1:])}", flush=True)
    sampler = LoadSampler(load_file(out))
    sampler.start()
    try:
        subprocess.run(cmd, check=True, cwd=ROOT)
    finally:
        sampler.stop.set()
        sampler.join()
    return json.loads(summary.read_text())


def run_commit(summary: dict) -> str:
    """The short commit a run's summary records, ``-dirty`` when its tree had uncommitted changes."""
    prov = summary.get("provenance") or {}
    return (prov.get("commit") or "unknown")[:7] + ("-dirty" if prov.get("uncommitted_changes") else "")


def summarize(runs: list[dict]) -> dict:
    """Accuracy per stage, wall time and peak RSS over the seeds; ``duration_alone_min``: the wall time of the runs
    that had the machine to themselves (:func:`run_load`), the one duration figure the docs may quote."""
    acc = {stage: spread([r["heldout_accuracy"][stage] for r in runs]) for stage in STAGES
           if all(stage in r["heldout_accuracy"] for r in runs)}
    alone = [r["wall_time_s"] / 60 for r in runs if (r.get("load") or {}).get("alone")]
    return {"heldout_accuracy": acc, "wall_min": spread([r["wall_time_s"] / 60 for r in runs]),
            "peak_rss_gib": spread([r["peak_rss_mb"] / 1024 for r in runs]),
            "duration_alone_min": spread(alone) if alone else None}


def report(result: dict) -> str:
    m, s = result["machine"], result["summary"]
    lines = [f"# Quickstart over {len(result['seeds'])} seeds", "",
             f"`{result['command']}` at commit {result['commit']}, {result['date']}; the runs "
             f"(`{result.get('run_command', '')}`) at {', '.join(result.get('run_commits', [result['commit']]))}.",
             f"Machine: {m['cpu']} ({m['isa']}, {m['cores']} cores), precision {result['precision']}, "
             f"1-min load {result['load_before']} at the start of this command / {result['load_after']} at its end "
             f"(wall times are comparable only where the runs had the machine to themselves; see the notes).", "",
             *[f"- {n}" for n in result.get("notes", [])], "",
             "| held-out strict accuracy | " + " | ".join(f"seed {x}" for x in result["seeds"]) + " | mean ± sd |",
             "|---|" + "---|" * (len(result["seeds"]) + 1)]
    for stage, a in sorted(s["heldout_accuracy"].items(), key=lambda kv: STAGES.index(kv[0])):  # JSON sorts keys
        lines.append(f"| {stage} | " + " | ".join(f"{v:.3f}" for v in a["values"]) + f" | {a['mean']:.3f} ± {a['sd']:.3f} |")
    for key, label, fmt in (("wall_min", "wall time (min)", "{:.1f}"), ("peak_rss_gib", "peak RSS (GiB)", "{:.2f}")):
        a = s[key]
        lines.append(f"| {label} | " + " | ".join(fmt.format(v) for v in a["values"])
                     + f" | {fmt.format(a['mean'])} ± {fmt.format(a['sd'])} |")
    loads = [r.get("load") for r in result["runs"]]
    lines.append("| 1-min load during the run: max / mean | " + " | ".join(
        "not sampled" if x is None else f"{x['max']:.1f} / {x['mean']:.1f}" for x in loads) + " | |")
    d = s.get("duration_alone_min")
    alone = [seed for seed, x in zip(result["seeds"], loads) if x and x["alone"]]
    lines += ["", f"Duration alone on the machine (runs whose sampled 1-min load averaged <= {m['cores']} + 0.5 and "
              f"stayed <= 1.5 x {m['cores']}: "
              f"seeds {', '.join(map(str, alone))}): {d['mean']:.1f} min (range {d['min']:.1f}-{d['max']:.1f})."
              if d else "No run's load was sampled and low throughout: no wall time here is the quickstart's duration."]
    late = [f"seed {seed} from {x['sampled_from_start_s']:.0f} s after it started" for seed, x in zip(result["seeds"], loads)
            if x and (x["sampled_from_start_s"] or 0) > 60]
    if late:
        lines.append(f"Load sampled late: {'; '.join(late)}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--config", default="quickstart")
    ap.add_argument("--quick", action="store_true", help="the tiny model for a few steps (a smoke test), into runs/")
    ap.add_argument("--out", type=Path, help="results directory (default benchmarks/results; --quick: runs/)")
    ap.add_argument("--runs-dir", type=Path, help="where the seeds' runs go (default runs/quickstart-seeds[-quick])")
    ap.add_argument("--rerun", type=int, nargs="*", metavar="SEED",
                    help="train these seeds again (no SEED: every seed), even where a finished run exists")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every seed's run (e.g. train.steps=0 model.precision=fp32)")
    ap.add_argument("--name", default="quickstart_seeds",
                    help="the results files' name and (unless --runs-dir) the runs' directory under runs/")
    ap.add_argument("--note", action="append", default=[], help="a line for the report (e.g. what else ran)")
    ap.add_argument("--from-json", type=Path, help="re-render the report of a results file")
    args = ap.parse_args()
    from cegppo.engine.provenance import commit_label, machine
    from cegppo.io import atomic_write_json, atomic_write_text

    if args.from_json:
        result = json.loads(args.from_json.read_text())
        result["runs"] = [relative(r) for r in result["runs"]]
        atomic_write_json(args.from_json, result)  # the report's name is the file's
        atomic_write_text(args.from_json.with_suffix(".md"), report(result))
        return
    config, extra = ("tiny", QUICK + args.set) if args.quick else (args.config, args.set)
    out = args.out or (ROOT / "runs" / "quickstart_seeds_quick" if args.quick else RESULTS)
    default_runs = "quickstart-seeds" if args.name == "quickstart_seeds" else args.name
    runs_dir = args.runs_dir or ROOT / "runs" / (f"{default_runs}-quick" if args.quick else default_runs)
    load_before, t0 = load_now(), time.perf_counter()
    rerun = set(args.seeds if args.rerun == [] else args.rerun or [])
    runs = [run_seed(config, seed, runs_dir / f"seed{seed}", extra, seed in rerun) for seed in args.seeds]
    cores = machine()["cores"]
    for seed, r in zip(args.seeds, runs):
        r["load"] = run_load(runs_dir / f"seed{seed}", cores)
    precisions = {json.dumps(r["precision"], sort_keys=True) for r in runs}
    result = dict(command=results_command("quickstart_seeds.py"),
                  run_command=shlex.join(["cegppo", "train", config, "train.seed=SEED", *extra]),
                  commit=commit_label(), run_commits=[run_commit(r) for r in runs], notes=args.note,
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  machine=machine(), load_before=load_before, load_after=load_now(),
                  precision=" / ".join(sorted(precisions)), seeds=args.seeds, wall_s=time.perf_counter() - t0,
                  runs=[relative({k: r[k] for k in ("heldout_accuracy", "wall_time_s", "peak_rss_mb", "entropy_first",
                                             "entropy_last", "precision", "provenance", "load")}) for r in runs])
    result["summary"] = summarize(runs)
    write_results(out, args.name, result, report(result))


if __name__ == "__main__":
    main()
