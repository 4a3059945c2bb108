"""The paper's entropy mechanism, measured where it can be (issue 5: a per-update design, since whole CPU runs are too short and too noisy to show it).

    python benchmarks/reproduce_entropy.py                 # CPU scale: part A (K=20 batches) + part B (short runs)
    python benchmarks/reproduce_entropy.py --part A --max-minutes 25       # part A, as many batches as fit in 25 min
    python benchmarks/reproduce_entropy.py --quick         # a smoke test: the tiny model, 2 batches, into runs/
    python benchmarks/reproduce_entropy.py --part B --scale gpu            # full trajectories, sized for one big GPU

Part A - per-update entropy response. One real-vocabulary policy with real entropy (SmolLM2-135M-Instruct,
logits / 0.7 for sampling *and* training, free-form "think step by step" answers graded leniently). For each
of K rollout batches, every objective updates the *same* starting weights on the *same* batch with the same
mini-batch split (4 mini-batches of AdamW, lr 1.5e-5, so that a measurable share of tokens leaves the
clip interval), then the entropy change is measured on a fixed held-out set of teacher-forced responses. The
paired difference dH(objective) - dH(GRPO) isolates what the out-of-clip tokens do. Next to it: the first-order
prediction summed from our per-quadrant dH diagnostics over the update's optimizer steps.

Part B - trajectories: GRPO, DAPO, CE-GPPO (0.5, 1) and (0.75, 1) trained from the same start with the trainer,
entropy / reward / held-out accuracy per step. On CPU this is a short run and is reported as one.

Precision (``--precision auto``): bf16 autocast where bf16 is fast (AVX512-BF16 / AMX / a GPU), else fp32 (bf16
is emulated, several times slower, on AVX2-only CPUs). Writes entropy_dynamics.{json,md} and PNG plots to ``--out``
(default benchmarks/results; ``--quick``: runs/reproduce_entropy_quick), all generated here, with the commit, the
command, the date and the machine (CPU model and ISA, precision, load).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from cegppo.algorithm.advantages import group_advantages
from cegppo.io import atomic_write_json, atomic_write_text
from cegppo.engine.model_forward import sequence_token_stats
from cegppo.engine.models import load_model
from cegppo.engine.precision import fast_bf16
from cegppo.algorithm.objectives import get_objective
from cegppo.algorithm.policy_loss import entropy_metrics, policy_loss
from cegppo.data.rewards import load_reward
from cegppo.engine.rollout import HFGenerator, RolloutBatch, Sampling

from common import RESULTS, in_checkout, load_now, provenance, provenance_line, quick_out, settings
from common.entropy import addition_problems, mean_sem  # the additions task, shared with entropy_control.py

QUICK_OUT = quick_out("reproduce_entropy")

# (label, objective, hparams); GPPO is CE-GPPO with beta1 = beta2 = 1 and is reported from that cell
OBJECTIVES_A = [("GRPO", "ppo_clip", dict(eps_low=0.2, eps_high=0.2, clip_ratio_c=10.0)),
                ("DAPO", "ppo_clip", dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=10.0))] + [
    (f"CE-GPPO({b1},{b2})", "ce_gppo", dict(eps_low=0.2, eps_high=0.2, beta1=b1, beta2=b2, clip_ratio_c=10.0))
    for b1 in (0.0, 0.5, 1.0) for b2 in (0.5, 1.0)
]


def objectives_a(args) -> list[tuple[str, str, dict]]:
    """Part A's grid, or the cells named by ``--objectives`` (GRPO always: every contrast is paired against it)."""
    if not getattr(args, "objectives", None):
        return OBJECTIVES_A
    unknown = set(args.objectives) - {label for label, _, _ in OBJECTIVES_A}
    if unknown:
        sys.exit(f"--objectives: unknown {sorted(unknown)}; choose from {[label for label, _, _ in OBJECTIVES_A]}")
    return [o for o in OBJECTIVES_A if o[0] == "GRPO" or o[0] in args.objectives]


BF16 = False  # set by main() from --precision: bf16 autocast over fp32 weights, else fp32 throughout


def autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16) if BF16 else contextlib.nullcontext()


@torch.no_grad()
def mean_entropy(model, batch: RolloutBatch, temperature: float, micro: int = 16) -> float:
    """Token-mean entropy (full vocabulary, temperature-scaled) of the policy on teacher-forced responses."""
    tot, cnt = 0.0, 0.0
    for rows in torch.arange(len(batch.texts)).split(micro):
        with autocast():
            _, ent, _ = sequence_token_stats(model, batch.input_ids[rows], batch.attention_mask[rows],
                                             batch.response_len, temperature)
        m = batch.response_mask[rows].float()
        tot += float((ent * m).sum())
        cnt += float(m.sum())
    return tot / cnt


def update(model, theta0, objective, batch, old_lp, adv, args) -> dict:
    """Reset to theta0, run epochs x mini-batches of AdamW with ``objective``; return diagnostics."""
    model.load_state_dict(theta0)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    mask = batch.response_mask.float()
    p_old = old_lp.exp()
    stats = dict(tokens=0.0, out=0.0, below={0.1: 0.0, 0.3: 0.0, 0.5: 0.0}, dH_pred=0.0)
    rows = torch.arange(len(adv))
    for _ in range(args.epochs):
        for mb in rows.tensor_split(args.mini_batches):
            with autocast():
                lp, ent, col = sequence_token_stats(model, batch.input_ids[mb], batch.attention_mask[mb],
                                                    batch.response_len, args.temperature, collision=True)
            m = mask[mb]
            # the objective's term (token-mean), and the quadrant metrics from the entropy and collision
            loss, metrics = policy_loss(objective, lp, old_lp[mb], adv[mb], m)
            metrics |= entropy_metrics(objective, lp, old_lp[mb], adv[mb], m, ent.detach(), collision=col)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            # out-of-clip tokens of this step (either side) and their probability under pi_old
            r = (lp.detach() - old_lp[mb]).exp()
            a = adv[mb, None]
            out = (((a < 0) & (r < 0.8)) | ((a > 0) & (r > 1.2))).float() * m
            stats["tokens"] += float(m.sum())
            stats["out"] += float(out.sum())
            for thr in stats["below"]:
                stats["below"][thr] += float((out * (p_old[mb] < thr).float()).sum())
            stats["dH_pred"] += float(metrics["dH/predicted"])  # first-order, unit step on the logits, per step
    model.eval()
    return stats


def part_a(args, model, tok) -> tuple[list[dict], dict]:
    train, heldout = addition_problems(2, 12, args.seed)
    reward = load_reward("math-lenient")
    engine = HFGenerator(model, tok, max_prompt_tokens=args.max_prompt_tokens,
                       dtype=torch.bfloat16 if BF16 else torch.float32)
    sampling = Sampling(temperature=args.temperature, top_p=1.0, top_k=0, max_new_tokens=args.max_new_tokens)
    torch.manual_seed(args.seed)
    held = engine.generate([p.messages for p in heldout[: args.heldout]], 1, sampling)
    theta0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    h0 = mean_entropy(model, held, args.temperature)
    print(f"[A] held-out: {args.heldout} teacher-forced responses, entropy {h0:.4f} nats/token at T={args.temperature}")
    objectives = [(label, get_objective(name, **hp)) for label, name, hp in objectives_a(args)]
    per_batch: dict[str, list[dict]] = {label: [] for label, _ in objectives}
    rng = random.Random(args.seed + 1)
    accs = []
    b = 0
    attempts = 0
    unmixed = 0  # batches kept without a mixed group (--quick only: the tiny model never scores)
    t_start = time.perf_counter()
    while b < args.batches:
        if args.max_minutes and b >= 2 and time.perf_counter() - t_start > 60 * args.max_minutes:
            print(f"[A] stopping after {b} batches: --max-minutes {args.max_minutes} reached", flush=True)
            break
        attempts += 1
        probs = rng.sample(train, args.prompts)
        torch.manual_seed(args.seed * 1000 + attempts)
        batch = engine.generate([p.messages for p in probs], args.n, sampling)
        graded = reward(batch.texts, [p.answer for p in probs for _ in range(args.n)])
        adv = group_advantages(torch.tensor(graded.scores), args.n, "grpo")
        if float(adv.abs().sum()) == 0.0:
            if not args.quick:
                continue  # no mixed group: every objective's update would be zero
            unmixed += 1  # a smoke test keeps it: the pipeline runs, the numbers mean nothing
        accs.append(graded.accuracy)
        model.load_state_dict(theta0)
        with torch.no_grad(), autocast():
            old_lp, ent_b, _ = sequence_token_stats(model, batch.input_ids, batch.attention_mask, batch.response_len,
                                                    args.temperature)
        hb0 = float((ent_b * batch.response_mask).sum() / batch.response_mask.sum())
        t0 = time.perf_counter()
        for label, obj in objectives:
            s = update(model, theta0, obj, batch, old_lp.float(), adv, args)
            per_batch[label].append(dict(
                dH=mean_entropy(model, held, args.temperature) - h0,
                dH_batch=mean_entropy(model, batch, args.temperature) - hb0,
                dH_pred=s["dH_pred"], out_frac=s["out"] / s["tokens"],
                below={k: v / max(s["out"], 1.0) for k, v in s["below"].items()}, out_tokens=s["out"]))
        b += 1
        g = per_batch["GRPO"][-1]
        print(f"[A] batch {b}/{args.batches}: acc {graded.accuracy:.2f}, GRPO dH {g['dH']:+.5f}, out-of-clip "
              f"{g['out_frac']:.3f}, {time.perf_counter() - t0:.0f} s for {len(objectives)} updates", flush=True)
    model.load_state_dict(theta0)

    # least-squares scale from first-order units (unit logit step) to nats, one number for all objectives
    xs = [r["dH_pred"] for rs in per_batch.values() for r in rs]
    ys = [r["dH_batch"] for rs in per_batch.values() for r in rs]
    scale = sum(x * y for x, y in zip(xs, ys)) / max(sum(x * x for x in xs), 1e-30)
    rows = []
    grpo = per_batch["GRPO"]
    for label, name, hp in objectives_a(args):
        rs = per_batch[label]
        dh, dh_sem = mean_sem([r["dH"] for r in rs])
        dhb, dhb_sem = mean_sem([r["dH_batch"] for r in rs])
        pm, ps = mean_sem([r["dH"] - g["dH"] for r, g in zip(rs, grpo)])
        pbm, pbs = mean_sem([r["dH_batch"] - g["dH_batch"] for r, g in zip(rs, grpo)])
        ppm, pps = mean_sem([scale * (r["dH_pred"] - g["dH_pred"]) for r, g in zip(rs, grpo)])
        out_tokens = sum(r["out_tokens"] for r in rs)
        labels = [label] + (["GPPO"] if label == "CE-GPPO(1.0,1.0)" else [])
        for lab in labels:
            rows.append(dict(
                objective=lab, loss=name, beta1=hp.get("beta1"), beta2=hp.get("beta2"), eps_low=hp["eps_low"],
                eps_high=hp["eps_high"], dH_mean=dh, dH_sem=dh_sem, dH_batch_mean=dhb, dH_batch_sem=dhb_sem,
                dH_predicted=statistics.fmean([scale * r["dH_pred"] for r in rs]),
                dH_predicted_first_order_units=statistics.fmean([r["dH_pred"] for r in rs]),
                paired_vs_grpo_mean=pm, paired_vs_grpo_sem=ps,
                paired_vs_grpo_batch_mean=pbm, paired_vs_grpo_batch_sem=pbs,
                paired_vs_grpo_predicted_mean=ppm, paired_vs_grpo_predicted_sem=pps,
                out_of_clip_frac=statistics.fmean([r["out_frac"] for r in rs]),
                out_of_clip_prob_below={str(t): sum(r["below"][t] * r["out_tokens"] for r in rs) / max(out_tokens, 1)
                                        for t in (0.1, 0.3, 0.5)},
                batches=len(rs)))
    meta = dict(heldout_entropy_start=h0, prediction_scale=scale, batch_accuracy_mean=statistics.fmean(accs),
                rollout_batches_drawn=attempts, batches_measured=b, batches_without_mixed_group=unmixed,
                per_batch=per_batch)
    return rows, meta


def part_b(args, out_dir: Path) -> list[dict]:
    """Short trajectories with the trainer, same environment as part A (or the GPU grid with --scale gpu)."""
    from cegppo.config import load_config
    from cegppo.engine.trainer import Trainer
    from cegppo.io import read_jsonl
    from cegppo.recipes import held_out_eval, log_eval, train_loop

    train, heldout = addition_problems(2, 12, args.seed)
    data_dir = out_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, probs in (("train", train), ("test", heldout)):
        atomic_write_text(data_dir / f"{name}.jsonl", "".join(
            json.dumps({"id": p.id, "question": p.messages[0]["content"], "answer": p.answer}) + "\n" for p in probs))
    if args.scale == "gpu":
        grid = [("GRPO", "ppo_clip", {}), ("DAPO", "ppo_clip", {"eps_high": 0.28})] + [
            (f"CE-GPPO({b1},{b2})", "ce_gppo", {"beta1": b1, "beta2": b2}) for b1 in (0.0, 0.5, 0.75, 1.0) for b2 in (0.5, 1.0)]
        seeds, steps, prompts, mini, eval_n, model = (0, 1, 2), 200, 32, 8, 64, args.model
    else:
        grid = [("GRPO", "ppo_clip", {}), ("DAPO", "ppo_clip", {"eps_high": 0.28}),
                ("CE-GPPO(0.5,1.0)", "ce_gppo", {"beta1": 0.5, "beta2": 1.0}),
                ("CE-GPPO(0.75,1.0)", "ce_gppo", {"beta1": 0.75, "beta2": 1.0})]
        if args.quick:  # a smoke test: one baseline, one CE-GPPO
            grid = [grid[0], grid[-1]]
        seeds, steps, prompts, mini, eval_n, model = (0,), args.traj_steps, args.prompts, args.mini_batches, 32, args.model
        if args.quick:
            eval_n = 4
    runs = []
    for seed in seeds:
        for label, name, hp in grid:
            run_dir = out_dir / "runs" / f"{label}-seed{seed}"
            cfg = load_config(None, [
                f"output_dir={run_dir}", f"model.name={model}",
                "model.precision=" + ("bf16-autocast" if BF16 else "fp32"),
                "model.rollout_dtype=" + ("bfloat16" if BF16 else "float32"),
                f"data.train_path={data_dir / 'train.jsonl'}", f"data.test_path={data_dir / 'test.jsonl'}",
                "data.task=null", f"data.num_test={eval_n}", f"rollout.n={args.n}", f"rollout.temperature={args.temperature}",
                f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.max_prompt_tokens={args.max_prompt_tokens}",
                "reward.fn=math-lenient",
                f"algorithm.objective={name}", "algorithm.hparams=" + json.dumps({"eps_low": 0.2, "eps_high": 0.2,
                                                                                  "clip_ratio_c": 10.0, **hp}),
                f"algorithm.dynamic_sampling={'false' if args.quick else 'true'}", f"optim.lr={args.traj_lr}",
                "optim.warmup_steps=0",
                "optim.weight_decay=0.0", f"train.steps={steps}", f"train.prompts_per_step={prompts}",
                f"train.mini_batches={mini}", "train.micro_batch_size=16", "train.save_every=0", f"train.seed={seed}",
                f"eval.num_problems={eval_n}", f"eval.every={max(1, steps // 4)}", f"eval.max_new_tokens={args.max_new_tokens}",
                "logging.progress=false",
            ])
            t0 = time.perf_counter()
            with Trainer(cfg, overwrite=True) as tr:  # a rerun replaces its own run directory
                start = log_eval(tr, "base", held_out_eval(tr))["accuracy"]
                train_loop(tr)
                final = log_eval(tr, "final", held_out_eval(tr))["accuracy"]
            rows = read_jsonl(run_dir / "metrics.jsonl")
            runs.append(dict(objective=label, beta1=hp.get("beta1"), beta2=hp.get("beta2"), seed=seed,
                             steps=[r["step"] for r in rows], entropy=[r.get("entropy") for r in rows],
                             reward=[r["reward/mean"] for r in rows], initial_test_accuracy=start,
                             final_test_accuracy=final, run_dir=str(in_checkout(run_dir)),
                             wall_s=time.perf_counter() - t0))
            h0, h1 = first_last([r.get("entropy") for r in rows])
            print(f"[B] {label} seed {seed}: entropy {h0:.4f} -> {h1:.4f}, held-out acc {start:.3f} -> {final:.3f}, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    return runs


def first_last(values: list) -> tuple[float, float]:
    """First and last logged values (a step whose groups were all filtered out logs no entropy)."""
    vals = [v for v in values if v is not None]
    return (vals[0], vals[-1]) if vals else (float("nan"), float("nan"))


def verdicts(per_update: list[dict], runs: list[dict], per_batch: dict | None = None) -> list[str]:
    """The report's claims, each tested against the numbers above and stated plainly."""
    by = {r["objective"]: r for r in per_update}
    out = []

    def t(m, s):
        return m / s if s and s > 0 else float("nan")

    if by:
        # (a) beta2 up raises dH, beta1 up lowers it: contrasts between grid cells, paired per batch (GRPO cancels)
        pb = by["GRPO"]

        def contrast(hi: str, lo: str, key: str = "dH") -> tuple[float, float]:
            if per_batch:
                return mean_sem([a[key] - b[key] for a, b in zip(per_batch[hi], per_batch[lo])])
            k = "paired_vs_grpo_mean" if key == "dH" else "paired_vs_grpo_batch_mean"
            return by[hi][k] - by[lo][k], float("nan")

        def verdict(ms: list[tuple[float, float]], sign: int) -> str:
            sig = sum(1 for m, se in ms if sign * m > 2 * se)
            rev = sum(1 for m, se in ms if -sign * m > 2 * se)
            return f"{sig}/{len(ms)} contrasts in the claimed direction beyond 2 SE, {rev} reversed beyond 2 SE"

        fmt = lambda ms: ", ".join(f"{m:+.2e} +- {se:.1e}" for m, se in ms)  # noqa: E731
        have = lambda *cells: all(c in by for c in cells)  # noqa: E731  (--objectives may measure a subset)
        b1s = [b1 for b1 in (0.0, 0.5, 1.0) if have(f"CE-GPPO({b1},1.0)", f"CE-GPPO({b1},0.5)")]
        b2s = [b2 for b2 in (0.5, 1.0) if have(f"CE-GPPO(1.0,{b2})", f"CE-GPPO(0.0,{b2})")]
        for key, where in (("dH", "held-out responses"), ("dH_batch", "the batch's own states")):
            d_b2 = [contrast(f"CE-GPPO({b1},1.0)", f"CE-GPPO({b1},0.5)", key) for b1 in b1s]
            d_b1 = [contrast(f"CE-GPPO(1.0,{b2})", f"CE-GPPO(0.0,{b2})", key) for b2 in b2s]
            parts = []
            if d_b2:
                parts.append(f"beta2 0.5 -> 1 changes dH by {fmt(d_b2)} (beta1 = {', '.join(map(str, b1s))}): "
                             f"{verdict(d_b2, +1)}")
            else:
                parts.append("beta2 not varied (no contrast)")
            if d_b1:
                parts.append(f"beta1 0 -> 1 changes it by {fmt(d_b1)} (beta2 = {', '.join(map(str, b2s))}): "
                             f"{verdict(d_b1, -1)}")
            holds = bool(d_b2 and d_b1) and all(m > 2 * se for m, se in d_b2) and all(-m > 2 * se for m, se in d_b1)
            b1_down = bool(d_b1) and all(-m > 2 * se for m, se in d_b1)
            out.append(f"(a) on {where}: " + "; ".join(parts) + ". Coordination claim (dH rises with beta2 and falls "
                       f"with beta1): {'HOLDS' if holds else 'NOT ESTABLISHED'} here"
                       + (f"; raising beta1 lowers entropy: {'SHOWN (every contrast beyond 2 SE)' if b1_down else 'NOT SHOWN'}"
                          if d_b1 else "") + ".")
        out.append(f"    GRPO's own held-out dH per update: {pb['dH_mean']:+.2e} +- {pb['dH_sem']:.1e}.")
        d = by.get("DAPO")
        out.append("(b) DAPO not measured (--objectives)." if d is None else f"(b) DAPO - GRPO held-out dH, paired: {d['paired_vs_grpo_mean']:+.2e} +- {d['paired_vs_grpo_sem']:.1e} "
                   f"(t = {t(d['paired_vs_grpo_mean'], d['paired_vs_grpo_sem']):.1f}); on the batch's own states "
                   f"{d['paired_vs_grpo_batch_mean']:+.2e} +- {d['paired_vs_grpo_batch_sem']:.1e}. DAPO > GRPO: "
                   f"{'HOLDS' if d['paired_vs_grpo_mean'] > 2 * d['paired_vs_grpo_sem'] else 'NOT SHOWN (within 2 SE or reversed)'}.")
        pairs = [(r["paired_vs_grpo_predicted_mean"], r["paired_vs_grpo_batch_mean"]) for r in per_update if r["objective"] not in ("GRPO", "GPPO")]
        agree = sum(1 for p, m in pairs if p * m > 0)
        xs, ys = [p for p, _ in pairs], [m for _, m in pairs]
        corr = statistics.correlation(xs, ys) if len(xs) > 2 and statistics.pstdev(xs) > 0 and statistics.pstdev(ys) > 0 else float("nan")
        raw = [(r["dH_predicted"], r["dH_batch_mean"]) for r in per_update]
        sign_raw = sum(1 for p, m in raw if p * m > 0)
        out.append(f"(c) first-order prediction vs measured dH on the batch's own states: the paired contrasts vs GRPO agree "
                   f"in sign for {agree}/{len(pairs)} objectives (Pearson r = {corr:.2f}); absolute dH agrees in sign for "
                   f"{sign_raw}/{len(raw)} (the prediction is in units of a unit logit step, rescaled by one least-squares "
                   f"factor for all objectives, so only sign and relative size are tested).")
    if runs:
        fin = sorted(runs, key=lambda r: -first_last(r["entropy"])[1])
        acc = sorted(runs, key=lambda r: -r["final_test_accuracy"])
        out.append("(d) trajectories (short CPU runs, one seed: an ordering, not a significant result): final entropy "
                   + " > ".join(f"{r['objective']} {first_last(r['entropy'])[1]:.3f}" for r in fin) + "; final held-out accuracy "
                   + " > ".join(f"{r['objective']} {r['final_test_accuracy']:.3f}" for r in acc)
                   + ". The paper's 7B ordering is DAPO > CE-GPPO > GRPO in entropy and CE-GPPO > DAPO > GRPO in accuracy.")
    return out


def plots(per_update: list[dict], runs: list[dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if per_update:
        rows = [r for r in per_update if r["objective"] != "GPPO"]
        fig, ax = plt.subplots(1, 2, figsize=(13, 4.2))
        x = range(len(rows))
        ax[0].errorbar(x, [r["paired_vs_grpo_mean"] for r in rows], yerr=[r["paired_vs_grpo_sem"] for r in rows],
                       fmt="o", capsize=3, label="measured, held-out responses")
        ax[0].errorbar([i + 0.15 for i in x], [r["paired_vs_grpo_batch_mean"] for r in rows],
                       yerr=[r["paired_vs_grpo_batch_sem"] for r in rows], fmt="s", capsize=3, label="measured, batch states")
        ax[0].plot([i + 0.3 for i in x], [r["paired_vs_grpo_predicted_mean"] for r in rows], "x", ms=8,
                   label="first-order prediction (rescaled)")
        ax[0].axhline(0, color="grey", lw=0.7)
        ax[0].set_xticks(list(x), [r["objective"] for r in rows], rotation=35, ha="right", fontsize=8)
        ax[0].set(title="Entropy change of one update, minus GRPO's (paired, mean +- SE)", ylabel="nats / token")
        ax[0].legend(fontsize=8)
        ax[1].bar(list(x), [r["out_of_clip_frac"] for r in rows])
        ax[1].set_xticks(list(x), [r["objective"] for r in rows], rotation=35, ha="right", fontsize=8)
        ax[1].set(title="Share of tokens outside the clip interval, over the update", ylabel="fraction")
        fig.tight_layout()
        fig.savefig(out / "entropy_per_update.png", dpi=110)
        plt.close(fig)
        written.append("entropy_per_update.png")
    if runs:
        fig, ax = plt.subplots(1, 3, figsize=(15, 4))
        for r in runs:
            lab = f"{r['objective']} s{r['seed']}"
            ax[0].plot(r["steps"], r["entropy"], label=lab)
            ax[1].plot(r["steps"], r["reward"], label=lab)
        ax[2].bar(range(len(runs)), [r["final_test_accuracy"] for r in runs])
        ax[2].set_xticks(range(len(runs)), [f"{r['objective']} s{r['seed']}" for r in runs], rotation=35, ha="right", fontsize=8)
        ax[0].set(title="Policy entropy (nats/token)", xlabel="RL step")
        ax[1].set(title="Reward (mean)", xlabel="RL step")
        ax[2].set(title="Held-out accuracy after training")
        ax[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "entropy_trajectories.png", dpi=110)
        plt.close(fig)
        written.append("entropy_trajectories.png")
    return written


def report(args, per_update, meta, runs, claims, figures, wall, command: str, regenerated: bool = False,
           result: dict | None = None) -> str:
    again = (" Verdicts, plots and this report were regenerated from the saved `entropy_dynamics.json` with "
             "`--from-json` (no new measurement)." if regenerated else "")
    lines = ["# CE-GPPO entropy dynamics, measured at CPU scale", "",
             f"Measured by `{command.strip()}` in {wall / 60:.1f} min.{again} Do not edit by hand.", "",
             provenance_line(result or {})
             + (f" Load average {result['load_after']} at the end." if (result or {}).get("load_after") is not None else ""),
             ""]
    if getattr(args, "quick", False):
        lines += ["**A smoke test (`--quick`): the tiny model, tiny sizes. The numbers mean nothing.**", ""]
    if per_update:
        batches = meta.get("batches_measured", args.batches)
        short = (f" (stopped at the time limit, `--max-minutes {args.max_minutes}`; {args.batches} asked)"
                 if batches < args.batches else "")
        if getattr(args, "objectives", None):
            lines += [f"**A reduced grid** (`--objectives`): GRPO and {', '.join(args.objectives)} only, of the "
                      f"{len(OBJECTIVES_A)} cells of the full design.", ""]
        lines += ["## A. Per-update entropy response", "",
                  f"{args.model}, policy = softmax(logits / {args.temperature}); addition a + b (2..12), free-form "
                  f"answers graded by math-verify (lenient, +1/-1); {batches} rollout batches{short} of {args.prompts} prompts x "
                  f"{args.n} samples (<= {args.max_new_tokens} new tokens; mean batch accuracy {meta['batch_accuracy_mean']:.2f}); "
                  f"each update = {args.epochs} epochs x {args.mini_batches} mini-batches of AdamW at lr {args.lr}, from the same "
                  f"weights for every objective. Held-out: {args.heldout} fixed teacher-forced responses, start entropy "
                  f"{meta['heldout_entropy_start']:.4f} nats/token. dH in nats/token, mean +- SE over batches.", "",
                  "| objective | dH held-out | paired vs GRPO (held-out) | paired vs GRPO (batch states) | predicted paired | "
                  "out-of-clip share | of which p_old < 0.1 / 0.3 / 0.5 |", "|---|---|---|---|---|---|---|"]
        for r in per_update:
            pb = r["out_of_clip_prob_below"]
            lines.append(f"| {r['objective']} | {r['dH_mean']:+.2e} +- {r['dH_sem']:.1e} | {r['paired_vs_grpo_mean']:+.2e} +- "
                         f"{r['paired_vs_grpo_sem']:.1e} | {r['paired_vs_grpo_batch_mean']:+.2e} +- {r['paired_vs_grpo_batch_sem']:.1e} "
                         f"| {r['paired_vs_grpo_predicted_mean']:+.2e} | {r['out_of_clip_frac']:.3f} | "
                         f"{pb['0.1']:.2f} / {pb['0.3']:.2f} / {pb['0.5']:.2f} |")
        lines += ["", f"First-order prediction scale (nats per unit-logit-step unit, least squares over all updates): "
                      f"{meta['prediction_scale']:.3e}. Part A wall time: {meta.get('wall_s', float('nan')) / 60:.1f} min "
                      f"({meta.get('rollout_batches_drawn', '?')} rollout batches drawn, those without a mixed group skipped).", ""]
    if runs:
        lines += ["## B. Trajectories (short CPU runs)", "", "| run | steps | entropy start -> end | reward start -> end | "
                  "held-out acc start -> end | wall |", "|---|---|---|---|---|---|"]
        for r in runs:
            h0, h1 = first_last(r["entropy"])
            lines.append(f"| {r['objective']} seed {r['seed']} | {len(r['steps'])} | {h0:.4f} -> {h1:.4f} "
                         f"| {r['reward'][0]:+.3f} -> {r['reward'][-1]:+.3f} | {r['initial_test_accuracy']:.3f} -> "
                         f"{r['final_test_accuracy']:.3f} | {r['wall_s']:.0f} s |")
        lines.append("")
    lines += ["## Verdicts", ""] + [f"- {c}" for c in claims] + [""]
    lines += [f"![{f}]({f})" for f in figures] + [""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["A", "B", "all"], default="all")
    ap.add_argument("--scale", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--lr", type=float, default=1.5e-5)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--mini-batches", type=int, default=4)
    ap.add_argument("--heldout", type=int, default=32)
    ap.add_argument("--traj-steps", type=int, default=10)
    ap.add_argument("--traj-lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-prompt-tokens", type=int, default=96)
    ap.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                    help="auto: bf16 autocast over fp32 weights where bf16 is fast (AVX512-BF16/AMX), else fp32")
    ap.add_argument("--objectives", nargs="+", metavar="LABEL",
                    help="part A: measure only these cells of the grid (GRPO is always measured), e.g. "
                         "'CE-GPPO(0.0,1.0)' 'CE-GPPO(1.0,1.0)' for the beta1 contrast alone")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default torch's; on a loaded machine 1 can be several times faster)")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="part A: draw no new rollout batch after this many minutes (at least 2 batches are measured)")
    ap.add_argument("--out", type=Path, help=f"results directory (default {RESULTS}; --quick: {QUICK_OUT})")
    ap.add_argument("--quick", action="store_true",
                    help="the tiny model, 2 batches, 2-step trajectories: a smoke test (results are not meaningful)")
    ap.add_argument("--from-json", type=Path, help="regenerate verdicts, plots and the report from a saved result")
    args = ap.parse_args()
    if args.from_json:
        return regenerate(args.from_json, args.out or args.from_json.parent)
    if args.quick:  # the tiny char-level model: checks the pipeline end to end, measures nothing
        args.model, args.precision, args.max_prompt_tokens = "tiny", "fp32", 160
        args.batches, args.heldout, args.traj_steps, args.max_new_tokens = min(args.batches, 2), 4, 2, 16
        args.prompts, args.n = 2, 4
    args.out = args.out or (QUICK_OUT if args.quick else RESULTS)
    global BF16
    if args.threads:
        torch.set_num_threads(args.threads)
    BF16 = fast_bf16("cpu") if args.precision == "auto" else args.precision == "bf16"
    precision = "bf16 autocast, fp32 master weights" if BF16 else "fp32"
    prov = provenance("reproduce_entropy.py", precision)
    print(f"[reproduce_entropy] commit {prov['commit']}, {precision}, load {prov['machine']['load_1min']}", flush=True)
    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    per_update, meta, runs = [], {}, []
    if args.part in ("A", "all"):
        model, tok = load_model(args.model)
        model.eval()
        per_update, meta = part_a(args, model, tok)
        wall_a = time.perf_counter() - t0
        meta["wall_s"] = wall_a
        print(f"[A] done in {wall_a / 60:.1f} min", flush=True)
        atomic_write_json(args.out / "entropy_dynamics.partA.json", {"per_update": per_update, "meta": meta})
        del model
    if args.part in ("B", "all"):
        runs = part_b(args, args.out)
    claims = verdicts(per_update, runs, meta.get("per_batch"))
    figures = plots(per_update, runs, args.out)
    wall = time.perf_counter() - t0
    result = {**prov, "wall_s": wall, "load_after": load_now(),
              "settings": settings(args),
              "per_update": per_update, "per_update_meta": {k: v for k, v in meta.items() if k != "per_batch"},
              "per_update_batches": meta.get("per_batch", {}), "runs": runs, "verdicts": claims}
    atomic_write_json(args.out / "entropy_dynamics.json", result)
    (args.out / "entropy_dynamics.partA.json").unlink(missing_ok=True)
    atomic_write_text(args.out / "entropy_dynamics.md",
                      report(args, per_update, meta, runs, claims, figures, wall, result["command"], result=result))
    print("\n".join(claims))
    print(f"wrote {args.out / 'entropy_dynamics.json'} and {args.out / 'entropy_dynamics.md'} in {wall / 60:.1f} min")


def regenerate(path: Path, out: Path) -> None:
    """Verdicts, plots and the markdown report from a saved ``entropy_dynamics.json`` (no new measurement)."""
    result = json.loads(path.read_text())
    args = argparse.Namespace(**{"model": "smollm2-135m-instruct", "max_minutes": None, **result["settings"]})
    per_update, runs = result["per_update"], result["runs"]
    meta = {**result.get("per_update_meta", {}), "per_batch": result.get("per_update_batches", {})}
    claims = verdicts(per_update, runs, meta["per_batch"])
    figures = plots(per_update, runs, out)
    result["verdicts"] = claims
    atomic_write_json(out / "entropy_dynamics.json", result)
    atomic_write_text(out / "entropy_dynamics.md", report(args, per_update, meta, runs, claims, figures, result["wall_s"],
                                                          result["command"], regenerated=True, result=result))
    print("\n".join(claims))


if __name__ == "__main__":
    main()
