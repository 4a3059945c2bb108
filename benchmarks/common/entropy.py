"""The entropy benchmarks' shared task and setting: the additions a + b of ``reproduce_entropy.py`` (its problems and
splits), and the setting of ``entropy_control.py`` (its targets, the uncontrolled GRPO baseline, its sizes and their
flags, the trainer overrides of one run, the measurement noise of the starting policy, the tracking error it scores),
which ``entropy_regime.py`` searches over and ``entropy_plant.py`` scores simulated runs with.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from pathlib import Path

from cegppo.data.problems import Problem
from cegppo.io import atomic_write_text

PROMPT = "What is {a} + {b}? Think step by step."
TARGETS = {"hold": 1.0, "up": 1.2}  # target name -> fraction of the first measured entropy
CLIP = {"eps_low": 0.2, "eps_high": 0.2, "clip_ratio_c": 10.0}
GRPO = dict(label="GRPO", objective="ppo_clip", hparams=CLIP, extra=[], target=None)  # the uncontrolled baseline
CE75 = dict(CLIP, beta1=0.75, beta2=1.0)
# label -> (objective, hparams, extra overrides) of stability_map's and small_steps' methods: issue 40's list, then
# issue 39's stabilisers
METHODS = {
    "GRPO": ("ppo_clip", CLIP, []),
    "CE-GPPO(0.75,1)": ("ce_gppo", CE75, []),
    "CE-GPPO(0.75,1)+ERC": ("ce_gppo", CE75, ["algorithm.erc=true"]),
    "CE-GPPO(0.75,1)+KL-stop": ("ce_gppo", CE75, ["train.target_kl=0.1"]),
    "CE-GPPO(0.75,1)+KL-stop+overlong": ("ce_gppo", CE75, ["train.target_kl=0.1", "algorithm.overlong_filter=true"]),
    "SAPO": ("sapo", {}, []),
    "DAPO": ("dapo", {}, []),
    "CE-GPPO(0.5,1)": ("ce_gppo", dict(CLIP, beta1=0.5, beta2=1.0), []),
    "GPPO": ("gppo", {}, []),
    "CISPO": ("cispo", {}, []),
}


def cell_key(c: dict) -> str:
    """One run of a method x learning rate x seed grid (stability_map, small_steps): its key in the records."""
    return f"{c['method']}|{c['lr']:g}|{c['seed']}"


def per_step(rows: list[dict], keys: tuple[str, ...]) -> dict[str, list]:
    """``{key: [its value at each metrics row, None where absent]}``: what a record keeps of a run's steps."""
    return {k: [r.get(k) for r in rows] for k in keys}


def addition_problems(lo: int, hi: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """All a + b with a, b in [lo, hi], split 3:1 into train / held-out by a seeded shuffle (disjoint)."""
    pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    random.Random(seed).shuffle(pairs)
    probs = [Problem(id=f"{a}+{b}", messages=[{"role": "user", "content": PROMPT.format(a=a, b=b)}],
                     answer=str(a + b), data_source="addition") for a, b in pairs]
    cut = len(probs) * 3 // 4
    return probs[:cut], probs[cut:]


def mean_sem(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return float("nan"), float("nan")
    m = statistics.fmean(xs)
    return m, (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan"))


def pm(ms: tuple[float, float], digits: int = 3) -> str:
    """``mean ± SE`` as a report prints it; a single run has no SE and says so, no run at all prints "-"."""
    if math.isnan(ms[0]):
        return "-"
    return f"{ms[0]:.{digits}f} ± {ms[1]:.{digits}f}" if not math.isnan(ms[1]) else f"{ms[0]:.{digits}f} (one seed)"


def sizes(args) -> dict:
    if args.quick:  # the tiny char-level model: checks the pipeline, measures nothing
        return dict(model="tiny", precision="fp32", rollout_dtype="float32", steps=2, seeds=[0], prompts=2, n=4,
                    max_new_tokens=16, max_prompt_tokens=160, eval_n=4, dynamic_sampling=False)
    fp32 = args.precision == "fp32"  # pinned: runs comparable across CPU kinds (bf16 only where native)
    return dict(model=args.model, precision="fp32" if fp32 else "auto", rollout_dtype="float32" if fp32 else "auto",
                steps=args.steps,
                seeds=getattr(args, "seeds", [0]), prompts=args.prompts, n=args.n, max_new_tokens=args.max_new_tokens,
                max_prompt_tokens=96, eval_n=32, dynamic_sampling=True)


def add_size_arguments(ap: argparse.ArgumentParser) -> None:
    """The setting's flags, shared with ``entropy_regime.py`` (defaults: the setting of issue 15's runs)."""
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling and training temperature")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per RL step")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--precision", choices=("auto", "fp32"), default="auto",
                    help="auto: bf16 autocast where the CPU has native bf16; fp32: fp32 everywhere (as the AVX2 runs)")


def write_problems(data_dir: Path, lo: int = 2, hi: int = 12) -> Path:
    """The additions of ``reproduce_entropy.py`` (its seed-0 split; operands in [lo, hi], by default its 2..12) as
    train / test JSONL in ``data_dir``."""
    data_dir.mkdir(parents=True, exist_ok=True)
    train, heldout = addition_problems(lo, hi, 0)
    for name, probs in (("train", train), ("test", heldout)):
        atomic_write_text(data_dir / f"{name}.jsonl", "".join(
            json.dumps({"id": p.id, "question": p.messages[0]["content"], "answer": p.answer}) + "\n" for p in probs))
    return data_dir


def trainer_overrides(conf: dict, seed: int, sz: dict, args, data_dir: Path, run_dir: Path) -> list[str]:
    return [
        f"output_dir={run_dir}", f"model.name={sz['model']}", f"model.precision={sz['precision']}",
        f"model.rollout_dtype={sz['rollout_dtype']}",
        f"data.train_path={data_dir / 'train.jsonl'}", f"data.test_path={data_dir / 'test.jsonl'}", "data.task=null",
        f"data.num_test={sz['eval_n']}", f"rollout.n={sz['n']}", f"rollout.temperature={args.temperature}",
        f"rollout.max_new_tokens={sz['max_new_tokens']}", f"rollout.max_prompt_tokens={sz['max_prompt_tokens']}",
        "reward.fn=math-lenient", f"algorithm.objective={conf['objective']}",
        "algorithm.hparams=" + json.dumps(conf["hparams"]),
        f"algorithm.dynamic_sampling={str(sz['dynamic_sampling']).lower()}", f"optim.lr={args.lr}",
        "optim.warmup_steps=0", "optim.weight_decay=0.0", f"train.steps={sz['steps']}",
        f"train.prompts_per_step={sz['prompts']}", "train.mini_batches=4", "train.micro_batch_size=16",
        "train.save_every=0", f"train.seed={seed}", f"eval.num_problems={sz['eval_n']}", "eval.every=0",
        f"eval.max_new_tokens={sz['max_new_tokens']}", "logging.progress=false", *conf["extra"],
    ]


def run_name(label: str, seed: int) -> str:
    return f"{label.replace(' ', '_').replace('%', 'pct')}-seed{seed}"


def measure_noise(conf: dict, seed: int, sz: dict, args, data_dir: Path, runs_dir: Path, commit: str) -> dict:
    """The token-mean entropy of ``--noise-batches`` rollout batches of the starting policy (as the trainer measures
    it for the autopilot: every kept response, before any update), each batch from new prompts and samples."""
    import torch

    from cegppo.config import load_config
    from cegppo.engine.trainer import Trainer, entropy_mean

    t0 = time.perf_counter()
    tr = Trainer(load_config(None, trainer_overrides(conf, seed, sz, args, data_dir, runs_dir / f"noise-seed{seed}")),
                 overwrite=True)
    entropies = []
    for step in range(1, args.noise_batches + 1):
        exp, _ = tr.collect(step)
        if exp is not None:  # dynamic sampling kept some groups
            entropies.append(entropy_mean(tr.old_log_probs(exp, skip=torch.empty(0, dtype=torch.long))))
    tr.close()
    mean = statistics.fmean(entropies)
    sd = statistics.stdev(entropies) if len(entropies) > 1 else math.nan
    rec = dict(seed=seed, entropies=entropies, mean=mean, sd=sd, floor=math.sqrt(2 / math.pi) * sd / mean,
               commit=commit, wall_s=time.perf_counter() - t0)
    print(f"noise: {len(entropies)} rollout batches of the starting policy, H = {mean:.4f} +- sd {sd:.4f} "
          f"({sd / mean:.1%}); a perfect tracker scores ~{rec['floor']:.3f}", flush=True)
    return rec


def first(values: list) -> float:
    return next((v for v in values if v is not None), float("nan"))


def tracking_error(rec: dict, frac: float) -> float:
    """Mean |H - T| / T over the steps of the second half that measured an entropy, T = frac x first entropy."""
    target = frac * first(rec["entropy"])
    n = max(rec["steps"]) if rec["steps"] else 0
    devs = [abs(h - target) / target for s, h in zip(rec["steps"], rec["entropy"]) if h is not None and s > n / 2]
    return sum(devs) / len(devs) if devs else float("nan")
