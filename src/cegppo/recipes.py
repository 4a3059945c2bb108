"""What ``cegppo train``, ``cegppo sft`` and ``cegppo eval`` run, assembled from the shared components."""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from cegppo.config import (CLI_EVAL_KEYS, Config, check_data, check_eval_settings, check_prompt_budget,
                           eval_limit)
from cegppo.data.evalsets import resolve_dataset
from cegppo.data.problems import Problem, load_problems
from cegppo.data.tasks import make_task
from cegppo.engine.checkpoint import MANIFEST, CheckpointError, verify_checkpoint
from cegppo.engine.components import build_policy, build_reward, load_splits
from cegppo.engine.models import resolve_device, resolve_dtype, resolve_precision
from cegppo.engine.rollout import HFRollout, Sampling
from cegppo.engine.rundir import RunInterrupted
from cegppo.engine.sft import supervised_warmup
from cegppo.engine.trainer import Trainer
from cegppo.io import read_jsonl
from cegppo.reporting.evaluation import EvalResult, evaluate
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


def _train(trainer: Trainer, cfg: Config, t0: float) -> dict:
    evals = {}

    def held_out(tag: str, label: str) -> None:
        if trainer.test_problems:
            evals[tag] = trainer.log_eval(tag, trainer.evaluate(desc=f"held-out eval, {label}"))["accuracy"]
            log.info("held-out accuracy %s: %.3f", label, evals[tag])

    if not trainer.state.get("warm_started"):
        held_out("base", "of the base model")
        if cfg.sft.steps:
            supervised_warmup(trainer.model, trainer.tokenizer, trainer.train_problems, cfg.sft, seed=cfg.train.seed,
                              precision=trainer.precision, progress=cfg.logging.progress)
            trainer.engine.sync(trainer.model)
            held_out("warm-start", "after warm-start")
        trainer.state["warm_started"] = True
        if cfg.train.save_every:
            trainer.save()  # step 0: a resume never repeats the warm-start
    rows = trainer.train()
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
    train, _ = load_splits(cfg)
    check_data(replace(cfg, sft=replace(cfg.sft, steps=steps)), train)  # before the model loads
    device = resolve_device(cfg.model.device)
    model, tok = build_policy(cfg.model.name, device=device)
    losses = supervised_warmup(model, tok, train, cfg.sft, steps=steps, seed=cfg.train.seed,
                               precision=resolve_precision(cfg.model.precision, device), progress=cfg.logging.progress)
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
