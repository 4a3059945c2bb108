"""What ``cegppo train``, ``cegppo sft`` and ``cegppo eval`` run: setup, the loop, cleanup, over the engine's plain
components (torchtune's recipe shape). This module sits on top with the CLI: it wires the engine to the reporting
layer (progress bars, plots), which the engine itself never imports."""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from cegppo.config import (CLI_EVAL_KEYS, Config, check_data, check_eval_settings, check_prompt_budget,
                           eval_limit)
from cegppo.data.evalsets import resolve_dataset
from cegppo.data.problems import Problem, load_problems
from cegppo.data.tasks import make_task
from cegppo.data.tasks import check_task
from cegppo.engine import checkpoint as ckpt
from cegppo.engine.checkpoint import MANIFEST, CheckpointError, verify_checkpoint
from cegppo.engine.components import build_policy, build_reward, load_splits, step_seed
from cegppo.engine.evaluation import EvalResult, evaluate
from cegppo.engine.models import resolve_device, resolve_dtype, resolve_precision
from cegppo.engine.rollout import HFRollout, Sampling
from cegppo.engine.rundir import RunInterrupted, TrainingError
from cegppo.engine.sft import supervised_warmup
from cegppo.engine.trainer import Trainer
from cegppo.io import read_jsonl
from cegppo.reporting.plots import plot_run
from cegppo.reporting.progress import Progress

log = logging.getLogger("cegppo")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_training(cfg: Config, resume: bool = False, overwrite: bool = False) -> dict:
    """Base eval -> optional warm-start (+ eval) -> RL -> final eval; writes summary.json and the PNG.

    The run directory is locked for the whole call and released however it ends. Ctrl-C raises
    :class:`RunInterrupted` carrying the last completed step."""
    t0 = time.perf_counter()
    trainer = Trainer(cfg, resume=resume, overwrite=overwrite)
    try:
        return _train(trainer, cfg, t0)
    except KeyboardInterrupt:
        raise RunInterrupted(trainer.state["step"]) from None
    finally:
        trainer.close()


def held_out_eval(trainer: Trainer, problems: list[Problem] | None = None, desc: str = "eval") -> EvalResult:
    """The trainer's policy on the held-out problems (or ``problems``), under ``eval.*``, seeded by the step."""
    e = trainer.cfg.eval
    problems = (trainer.test_problems if problems is None else problems)[: eval_limit(e.num_problems)]
    torch.manual_seed(step_seed(trainer.cfg.train.seed, trainer.state["step"], "eval"))
    progress = Progress(f"cegppo {desc}", len(problems), unit="problem", enabled=trainer.cfg.logging.progress)
    try:
        return evaluate(trainer.engine, problems, trainer.reward_fn, e.k,
                        Sampling(e.temperature, e.top_p, 0, e.max_new_tokens), progress=progress)
    finally:
        progress.close()


def log_eval(trainer: Trainer, tag: str, result: EvalResult) -> dict:
    """Append an evaluation to the run's ``eval.jsonl``; returns the row."""
    row = {"step": trainer.state["step"], "tag": tag, "accuracy": result.headline("avg@k"),
           "pass@k": result.headline("pass@k"), "maj@k": result.headline("maj@k")}
    trainer.run.log_eval(row)
    return row


def generated_tokens(cfg: Config, row: dict) -> float:
    """Response tokens generated in the step of metrics ``row`` (every round of dynamic sampling)."""
    t = cfg.train
    return row["response_length/mean"] * row["train/num_gen_batches"] * cfg.rollout.n * (
        t.gen_prompts_per_step or t.prompts_per_step)


def train_loop(trainer: Trainer, on_step: Callable[[Trainer, dict], None] | None = None) -> list[dict]:
    """Run ``trainer`` to ``train.steps``: each step, the periodic held-out evaluation (``eval.every``), the metrics
    row, the checkpoint (``train.save_every``) and the progress bar; a final checkpoint. Returns the rows written.
    Stops with :class:`TrainingError` after ``train.max_bad_steps`` consecutive steps without a finite update."""
    cfg, rows = trainer.cfg, []
    progress = Progress("cegppo train", cfg.train.steps, unit="step", enabled=cfg.logging.progress,
                        initial=trainer.state["step"])
    trainer.progress = progress
    trainer.run.open_sinks(cfg)
    while trainer.state["step"] < cfg.train.steps:
        row = trainer.step()
        step = row["step"]
        if cfg.eval.every and step % cfg.eval.every == 0 and trainer.test_problems:
            result = held_out_eval(trainer, desc=f"eval at step {step}")
            row["val/accuracy"] = log_eval(trainer, "periodic", result)["accuracy"]
        trainer.run.log_metrics(row)
        rows.append(row)
        if cfg.train.save_every and step % cfg.train.save_every == 0:
            progress.phase("checkpoint")
            trainer.save()
        progress.advance(1, reward=row["reward/mean"], acc=row["reward/accuracy"], H=row.get("entropy", float("nan")),
                         clip=f"{100 * row.get('clip/low_frac', 0):.2f}%/{100 * row.get('clip/high_frac', 0):.2f}%",
                         gen_tok_s=generated_tokens(cfg, row) / max(row["time/rollout_s"], 1e-9),
                         step_s=row["time/step_s"])
        if on_step is not None:
            on_step(trainer, row)
        if trainer.state["bad_steps"] >= cfg.train.max_bad_steps:
            raise TrainingError(
                f"{trainer.state['bad_steps']} consecutive steps had a non-finite loss or gradient (train.max_bad_steps="
                f"{cfg.train.max_bad_steps}); stopping. Last checkpoint: "
                f"{ckpt.latest_valid_checkpoint(trainer.run.checkpoints)}")
    progress.close()
    saved = ckpt.list_checkpoints(trainer.run.checkpoints)
    if cfg.train.save_every and (not saved or saved[-1] != ckpt.step_dir(trainer.run.checkpoints, trainer.state["step"])):
        trainer.save()
    return rows


def warm_start(trainer: Trainer, steps: int | None = None) -> list[float]:
    """The supervised warm-start (``sft.*``) of the trainer's policy, then the rollout engine takes its weights."""
    cfg = trainer.cfg
    n = cfg.sft.steps if steps is None else steps
    bar = Progress("cegppo sft (warm-start)", n, unit="step", enabled=cfg.logging.progress)
    try:
        losses = supervised_warmup(trainer.model, trainer.tokenizer, trainer.train_problems, cfg.sft, steps=n,
                                   seed=cfg.train.seed, precision=trainer.precision, progress=bar)
    finally:
        bar.close()
    trainer.engine.sync(trainer.model)
    return losses


def _train(trainer: Trainer, cfg: Config, t0: float) -> dict:
    evals = {}

    def held_out(tag: str, label: str) -> None:
        if trainer.test_problems:
            evals[tag] = log_eval(trainer, tag, held_out_eval(trainer, desc=f"held-out eval, {label}"))["accuracy"]
            log.info("held-out accuracy %s: %.3f", label, evals[tag])

    if not trainer.state.get("warm_started"):
        held_out("base", "of the base model")
        if cfg.sft.steps:
            warm_start(trainer)
            held_out("warm-start", "after warm-start")
        trainer.state["warm_started"] = True
        if cfg.train.save_every:
            trainer.save()  # step 0: a resume never repeats the warm-start
    rows = train_loop(trainer)
    held_out("final", "after RL")
    entropies = [r["entropy"] for r in read_jsonl(trainer.run.metrics) if "entropy" in r]  # steps with an update
    summary = {
        "steps": trainer.state["step"],
        "wall_time_s": time.perf_counter() - t0,
        "peak_rss_mb": peak_rss_mb(),
        "heldout_accuracy": evals,
        "entropy_first": entropies[0] if entropies else None,
        "entropy_last": entropies[-1] if entropies else None,
        "steps_this_session": len(rows),
        "precision": {"model.precision": trainer.precision, "model.rollout_dtype": str(trainer.engine.dtype)},
        "provenance": trainer.run.provenance,  # taken when this session started
    }
    trainer.run.write_summary(summary)
    plot_run(trainer.run.path)
    return summary


def run_sft(cfg: Config, out: Path, steps: int) -> list[float]:
    """Supervised warm-start of ``model.name`` on the training split's reference solutions, saved to ``out``."""
    check_task(cfg.data.task)
    train, _ = load_splits(cfg)
    check_data(replace(cfg, sft=replace(cfg.sft, steps=steps)), train)  # before the model loads
    device = resolve_device(cfg.model.device)
    model, tok = build_policy(cfg.model.name, device=device)
    bar = Progress("cegppo sft", steps, unit="step", enabled=cfg.logging.progress)
    try:
        losses = supervised_warmup(model, tok, train, cfg.sft, steps=steps, seed=cfg.train.seed,
                                   precision=resolve_precision(cfg.model.precision, device), progress=bar)
    finally:
        bar.close()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return losses


@dataclass
class EvalRequest:
    """What ``cegppo eval`` evaluates, and how (the CLI flags)."""

    model: str
    data: list[str]
    k: int = 1
    sampling: Sampling = field(default_factory=lambda: Sampling(temperature=0.6, top_p=0.95, max_new_tokens=256))
    num_problems: int = 0  # per dataset; 0 = all
    difficulty: int = 1
    reward: str = "math-strict"
    dtype: str = "auto"  # auto: bfloat16 where bf16 is fast, else float32
    max_prompt_tokens: int = 1024
    batch_prompts: int = 16
    seed: int = 0
    device: str = "auto"  # auto: the GPU when torch sees one, else the CPU


def eval_problems(req: EvalRequest) -> list[Problem]:
    """Each dataset (a file or a bundled eval set such as ``aime24``) or built-in task of ``req.data``,
    de-duplicated on load, then limited to ``num_problems``."""
    limit = eval_limit(req.num_problems, "--num-problems")
    problems = []
    for spec in req.data:
        if Path(spec).is_file() or resolve_dataset(spec) is not None or spec.endswith((".jsonl", ".json", ".parquet")):
            loaded = load_problems(spec)
        else:
            loaded = make_task(spec, "test", req.num_problems or 64, seed=req.seed, difficulty=req.difficulty)
        problems += loaded[:limit]
    return problems


def verify_model_dir(model: str) -> None:
    """A cegppo checkpoint given as a model (it holds a manifest) is verified as ``--resume`` does: files that no
    longer match their manifest are refused."""
    path = Path(model)
    if not (path / MANIFEST).is_file():
        return
    problem = verify_checkpoint(path)
    if problem is not None:
        raise CheckpointError(f"--model {model}: this checkpoint no longer matches its manifest ({problem}); "
                              f"refusing to evaluate it")
    log.info("--model %s: checkpoint verified against its manifest", model)


def run_eval(req: EvalRequest) -> EvalResult:
    s = req.sampling
    check_eval_settings(num_problems=req.num_problems, k=req.k, temperature=s.temperature, top_p=s.top_p,
                        max_new_tokens=s.max_new_tokens, keys=CLI_EVAL_KEYS)
    verify_model_dir(req.model)
    problems = eval_problems(req)
    reward = build_reward(req.reward, key="--reward")
    device = resolve_device(req.device, key="--device")
    model, tok = build_policy(req.model, key="--model", device=device)
    check_prompt_budget(tok, problems, req.max_prompt_tokens, key="--max-prompt-tokens")
    # generation only: the engine runs on the loaded model itself, cast in place
    engine = HFRollout(model, tok, req.max_prompt_tokens, dtype=getattr(torch, resolve_dtype(req.dtype, device)),
                       copy=False)
    torch.manual_seed(req.seed)
    progress = Progress("cegppo eval", len(problems), unit="problem")
    try:
        return evaluate(engine, problems, reward, req.k, req.sampling, batch_prompts=req.batch_prompts,
                        progress=progress)
    finally:
        progress.close()
