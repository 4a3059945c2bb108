"""What ``cegppo train``, ``cegppo sft`` and ``cegppo eval`` run: setup, the loop, cleanup, over the engine's plain
components (torchtune's recipe shape). This module sits on top with the CLI: it wires the engine to the reporting
layer (progress bars, plots), which the engine itself never imports."""

from __future__ import annotations

import logging
import os
import resource
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

import torch

from cegppo.config import (CLI_EVAL_KEYS, Config, ConfigError, check_batch_tokens, check_data, check_eval_settings,
                           check_prompt_budget, eval_limit)
from cegppo.config.schema import MAX_SEQUENCES, MAX_TOKENS
from cegppo.config.validation import MODEL_DIR_HEADROOM, check_path_fits
from cegppo.data.evalsets import resolve_dataset
from cegppo.data.problems import Problem, load_problems
from cegppo.data.tasks import make_task
from cegppo.data.tasks import check_task
from cegppo.engine import checkpoint as ckpt
from cegppo.engine.checkpoint import MANIFEST, CheckpointError, verify_checkpoint
from cegppo.engine.components import build_policy, build_reward, load_splits, step_seed
from cegppo.engine.evaluation import EvalResult, evaluate
from cegppo.engine.precision import resolve_device, resolve_dtype, resolve_precision
from cegppo.engine.provenance import machine
from cegppo.engine.rollout import HFGenerator, Sampling
from cegppo.engine.rundir import RunInterrupted, TrainingError
from cegppo.engine.runlock import claim_outputs
from cegppo.engine.sft import supervised_warmup
from cegppo.engine.trainer import Trainer
from cegppo.errors import os_error_text
from cegppo.io import probe_writable, read_jsonl
from cegppo.reporting.plots import plot_run
from cegppo.reporting.progress import Progress

log = logging.getLogger("cegppo")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_training(cfg: Config, resume: bool = False, overwrite: bool = False, accept_data_change: bool = False) -> dict:
    """Base eval -> optional warm-start (+ eval) -> RL -> final eval; writes summary.json and the PNG.

    The run directory is locked for the whole call and released however it ends. Ctrl-C raises
    :class:`RunInterrupted` carrying the last completed step."""
    t0 = time.perf_counter()
    trainer = Trainer(cfg, resume=resume, overwrite=overwrite, accept_data_change=accept_data_change)
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
        return evaluate(trainer.generator, problems, trainer.reward_fn, e.k,
                        Sampling(e.temperature, e.top_p, 0, e.max_new_tokens), progress=progress)
    finally:
        progress.close()


def log_eval(trainer: Trainer, tag: str, result: EvalResult) -> dict:
    """Append an evaluation to the run's ``eval.jsonl`` with the scorer's failures beside the accuracy (in total and
    per data source), log them (an ERROR when the scorer failed on every item of a source); returns the row."""
    row = {"step": trainer.state["step"], "tag": tag, "accuracy": result.headline("avg@k"),
           "pass@k": result.headline("pass@k"), "maj@k": result.headline("maj@k"),
           "graded": result.total("graded"), "scorer_failures": result.total("scorer_failures"),
           "scorer_timeouts": result.total("scorer_timeouts"),
           "sources": {src: {"accuracy": s["avg@k"], "graded": s["graded"], "scorer_failures": s["scorer_failures"],
                             "scorer_timeouts": s["scorer_timeouts"]} for src, s in result.summary.items()}}
    trainer.run.log_eval(row)
    note = result.failure_note()
    if result.all_failed():
        log.error("held-out eval (%s, step %d): %s; its accuracy %.4f measures the reward function (reward.fn=%s), "
                  "not the model", tag, row["step"], note, row["accuracy"], trainer.cfg.reward.fn)
    elif note:
        log.warning("held-out eval (%s, step %d): %s", tag, row["step"], note)
    return row


def generated_tokens(cfg: Config, row: dict) -> float:
    """Response tokens generated in the step of metrics ``row`` (every round of dynamic sampling)."""
    t = cfg.train
    return row["response_length/mean"] * row["train/num_gen_batches"] * cfg.rollout.n * (
        t.gen_prompts_per_step or t.prompts_per_step)


NO_UPDATE_WARN_STEPS = 3  # a run that makes no update for this many consecutive steps says why (and every N after)


def no_update_cause(cfg: Config, row: dict) -> str | None:
    """Why the step of metrics ``row`` changed nothing (None when it made an update with a learning signal)."""
    items = int(row.get("train/num_gen_batches", 1) * cfg.rollout.n * (cfg.train.gen_prompts_per_step
                                                                        or cfg.train.prompts_per_step))
    grades = (f"reward accuracy {row.get('reward/accuracy', 0):.3f}, scorer failures "
              f"{int(row.get('reward/failures', 0))} of {items}")
    if row.get("reward/failures", 0) >= items:
        return f"the reward function (reward.fn={cfg.reward.fn}) failed on every item ({grades})"
    if "entropy" not in row:  # no experience kept: dynamic sampling found no group with mixed rewards
        return (f"no group had mixed rewards: dynamic sampling kept 0 groups in {int(row.get('train/num_gen_batches', 1))} "
                f"generation round(s) (algorithm.max_num_gen_batches={cfg.algorithm.max_num_gen_batches}; {grades})")
    if row.get("grad_norm") == 0:
        return f"every gradient was 0: each group's rewards were equal, so every advantage was 0 ({grades})"
    return None


def train_loop(trainer: Trainer, on_step: Callable[[Trainer, dict], None] | None = None) -> list[dict]:
    """Run ``trainer`` to ``train.steps``: each step, the periodic held-out evaluation (``eval.every``), the metrics
    row, the checkpoint (``train.save_every``) and the progress bar; a final checkpoint. Returns the rows written.
    Stops with :class:`TrainingError` after ``train.max_bad_steps`` consecutive steps without a finite update; warns,
    naming the cause, after every :data:`NO_UPDATE_WARN_STEPS` consecutive steps without a learning signal."""
    cfg, rows, idle = trainer.cfg, [], 0
    progress = Progress("cegppo train", cfg.train.steps, unit="step", enabled=cfg.logging.progress,
                        initial=trainer.state["step"])
    trainer.progress = progress
    trainer.run.open_sinks(cfg)
    while trainer.state["step"] < cfg.train.steps:
        row = trainer.step()
        step = row["step"]
        cause = no_update_cause(cfg, row)
        idle = idle + 1 if cause else 0
        if idle and idle % NO_UPDATE_WARN_STEPS == 0:
            log.warning("steps %d-%d: no update in %d consecutive steps: %s", step - idle + 1, step, idle, cause)
        pending = int(row.get("control/target_pending", 0))  # entropy autopilot: steps without a relative target
        if pending == 1 or (pending and pending % 10 == 0):
            log.warning("step %d: entropy autopilot waiting: the rollouts' entropy is 0 (rollout.temperature=%g), so "
                        "its relative target (algorithm.entropy_control.target=%g of the first entropy) is not set; "
                        "beta1/beta2 stay at their starting values until the entropy is > 0 (or use target_mode="
                        "absolute)", step, cfg.rollout.temperature, cfg.algorithm.entropy_control.target)
        if cfg.eval.every and step % cfg.eval.every == 0 and trainer.test_problems:
            result = held_out_eval(trainer, desc=f"eval at step {step}")
            row["val/accuracy"] = log_eval(trainer, "periodic", result)["accuracy"]
        trainer.run.log_metrics(row)
        rows.append(row)
        if trainer.collapse and cfg.train.on_collapse == "stop":  # this step's weights are not saved
            raise TrainingError(f"step {step}: collapse guard: {'; '.join(trainer.collapse)}; stopping "
                                f"(train.on_collapse=stop). Last checkpoint: "
                                f"{ckpt.latest_valid_checkpoint(trainer.run.checkpoints)}")
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
    """The supervised warm-start (``sft.*``) of the trainer's policy, then the generator takes its weights."""
    cfg = trainer.cfg
    n = cfg.sft.steps if steps is None else steps
    bar = Progress("cegppo sft (warm-start)", n, unit="step", enabled=cfg.logging.progress)
    try:
        losses = supervised_warmup(trainer.model, trainer.tokenizer, trainer.train_problems, cfg.sft, steps=n,
                                   seed=cfg.train.seed, precision=trainer.precision, progress=bar)
    finally:
        bar.close()
    trainer.generator.sync(trainer.model)
    return losses


def _train(trainer: Trainer, cfg: Config, t0: float) -> dict:
    evals = {}

    def held_out(tag: str, label: str) -> None:
        if trainer.test_problems:
            result = held_out_eval(trainer, desc=f"held-out eval, {label}")
            evals[tag] = log_eval(trainer, tag, result)["accuracy"]
            failed = result.total("scorer_failures")
            log.info("held-out accuracy %s: %.3f%s", label, evals[tag],
                     f" (the scorer failed on {failed} of {result.total('graded')} items)" if failed else "")
            if tag == "base":  # before any training: a grader that fails on every item would waste the whole run
                try:
                    result.check_scorer(f"held-out eval of the base model (reward.fn={cfg.reward.fn})")
                except ValueError as e:
                    raise TrainingError(f"{e}; it grades the training rollouts too, so the run stops before "
                                        f"training (recorded in eval.jsonl)") from None

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
        "precision": {"model.precision": trainer.precision, "model.rollout_dtype": str(trainer.generator.dtype)},
        "provenance": trainer.run.provenance,  # taken when this session started
        "machine": machine(),  # the CPU model and ISA (and GPU) the figures above were measured on
    }
    trainer.run.write_summary(summary)
    plot_run(trainer.run.path)
    return summary


def check_new_output(path: Path, key: str, *, directory: bool, headroom: int = 0,
                     inputs: dict[str, str] | None = None) -> None:
    """Before the expensive part of a command: ``path`` (a file, or with ``directory`` a model directory) must be
    new, or an empty directory; not one of ``inputs`` (``{flag: path}``) nor inside one; creatable here (path length
    limits, a writable parent, created now). Raises a one-line :class:`ConfigError` naming ``key``."""
    check_path_fits(str(path), key, headroom)
    for flag, value in (inputs or {}).items():
        src = Path(value)
        if src.exists() and (path.resolve() == src.resolve() or src.resolve() in path.resolve().parents):
            raise ConfigError(f"{key} {path} is also an input ({flag} {value}); writing it would destroy the input: "
                              f"choose another path")
    if path.is_dir() and not path.is_symlink():
        if not directory:
            raise ConfigError(f"{key} {path} is a directory; give the path of a new file")
        held = sorted(p.name for p in path.iterdir())
        if held:
            raise ConfigError(f"{key} {path} is a directory holding {', '.join(held[:5])}"
                              f"{', ...' if len(held) > 5 else ''}; it would be overwritten: give a new or empty "
                              f"directory")
    elif path.exists() or path.is_symlink():
        raise ConfigError(f"{key} {path} is an existing file; it would be overwritten: choose a new path (or remove "
                          f"it)")
    try:
        probe_writable(path.parent)
    except OSError as e:
        raise ConfigError(f"{key} {path}: cannot write in {path.parent}: {os_error_text(e)}") from None


@contextmanager
def new_outputs(paths: list[Path], key: str, *, directory: bool, headroom: int = 0,
                inputs: dict[str, str] | None = None) -> Iterator[None]:
    """Hold an exclusive claim on each new output in ``paths`` (:class:`OutputLock`) for the ``with`` block: each is
    checked as :func:`check_new_output` says, claimed, then checked again (a command holding the claim until just now
    may have written it). A second command with the same output is refused, naming the path and the holder."""
    def check() -> None:
        for path in paths:
            check_new_output(path, key, directory=directory, headroom=headroom, inputs=inputs)

    with claim_outputs(paths, key, check):
        yield


def run_sft(cfg: Config, out: Path, steps: int) -> list[float]:
    """Supervised warm-start of ``model.name`` on the training split's reference solutions, saved to ``out`` (new or
    empty, checked and claimed before anything loads; written into a temporary directory beside it, then renamed)."""
    with new_outputs([out], "--out", directory=True, headroom=MODEL_DIR_HEADROOM, inputs={"model.name": cfg.model.name}):
        return _sft(cfg, out, steps)


def _sft(cfg: Config, out: Path, steps: int) -> list[float]:
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
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    try:
        tmp.mkdir()
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        # rename(2) replaces only an empty directory (as checked under the claim); anything else there fails it
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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


def check_eval_request(req: EvalRequest) -> None:
    """Every setting of ``cegppo eval`` that could fail later (or evaluate nothing), before anything loads."""
    s = req.sampling
    check_eval_settings(num_problems=req.num_problems, k=req.k, temperature=s.temperature, top_p=s.top_p,
                        max_new_tokens=s.max_new_tokens, keys=CLI_EVAL_KEYS)

    def need(ok: bool, flag: str, what: str, value: object) -> None:
        if not ok:
            raise ConfigError(f"{flag} must be {what}, got {value!r:.60}")

    def whole(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    need(whole(req.batch_prompts) and 1 <= req.batch_prompts <= MAX_SEQUENCES, "--batch-prompts",
         f"an integer in 1..{MAX_SEQUENCES} (prompts generated together)", req.batch_prompts)
    need(whole(req.max_prompt_tokens) and 1 <= req.max_prompt_tokens <= MAX_TOKENS, "--max-prompt-tokens",
         f"an integer in 1..{MAX_TOKENS}", req.max_prompt_tokens)
    check_batch_tokens([("--batch-prompts", req.batch_prompts), ("--k", req.k)],
                       [("--max-prompt-tokens", req.max_prompt_tokens), ("--max-new-tokens", s.max_new_tokens)],
                       "one generation batch")
    need(whole(req.difficulty) and 1 <= req.difficulty <= 5, "--difficulty", "in 1..5", req.difficulty)
    need(whole(req.seed) and 0 <= req.seed < 2**63, "--seed", "an integer >= 0", req.seed)
    need(bool(req.data), "--data", "at least one dataset, eval set or task", req.data)


def run_eval(req: EvalRequest) -> EvalResult:
    """``cegppo eval``: the scorer's failures are counted per data source in the result
    (:meth:`EvalResult.failure_note`, :meth:`EvalResult.check_scorer`)."""
    check_eval_request(req)
    verify_model_dir(req.model)
    problems = eval_problems(req)
    reward = build_reward(req.reward, key="--reward")
    device = resolve_device(req.device, key="--device")
    model, tok = build_policy(req.model, key="--model", device=device)
    check_prompt_budget(tok, problems, req.max_prompt_tokens, key="--max-prompt-tokens")
    # generation only: the generator runs on the loaded model itself, cast in place
    generator = HFGenerator(model, tok, req.max_prompt_tokens,
                            dtype=getattr(torch, resolve_dtype(req.dtype, device)), copy=False)
    torch.manual_seed(req.seed)
    progress = Progress("cegppo eval", len(problems), unit="problem")
    try:
        return evaluate(generator, problems, reward, req.k, req.sampling, batch_prompts=req.batch_prompts,
                        progress=progress)
    finally:
        progress.close()
        reward.close()
