"""The RL trainer: one step = rollout -> reward -> advantages -> (dynamic sampling) -> old log-probs ->
mini-batch updates with micro-batch accumulation. :meth:`Trainer.step` is the whole algorithm on one screen;
everything else here is setup, bookkeeping and I/O.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from cegppo.engine import checkpoint as ckpt
from cegppo.algorithm.advantages import group_advantages, mixed_groups
from cegppo.config import Config, ConfigError, save_config
from cegppo.data.problems import Problem, load_problems
from cegppo.algorithm.diagnostics import metric_weight, quadrant_metrics
from cegppo.reporting.evaluation import EvalResult, evaluate
from cegppo.faults import failpoint
from cegppo.io import append_jsonl, atomic_write_json, atomic_write_text, read_jsonl
from cegppo.algorithm.logprobs import sequence_token_stats
from cegppo.engine.models import ModelLoadError, autocast, load_model
from cegppo.algorithm.objectives import aggregate, get_objective
from cegppo.data.rewards import load_reward
from cegppo.engine.rollout import HFRollout, RolloutBatch, Sampling
from cegppo.data.tasks import make_task

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    pass


@dataclass
class Experience:
    """One step's training data: rollouts plus what the update needs, all ``[B, ...]`` tensors."""

    rollouts: RolloutBatch
    rewards: Tensor  # [B]
    correct: Tensor  # [B] bool
    advantages: Tensor  # [B]
    old_log_prob: Tensor | None = None  # [B, T]
    ref_log_prob: Tensor | None = None  # [B, T]


def step_seed(seed: int, step: int, salt: str = "") -> int:
    """A per-step seed, so a resumed run draws exactly what an uninterrupted one would."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{step}:{salt}".encode()).digest()[:4], "little")


def load_splits(cfg: Config) -> tuple[list[Problem], list[Problem]]:
    d = cfg.data
    kw = dict(prompt_key=d.prompt_key, answer_key=d.answer_key)
    if d.train_path:
        train = load_problems(d.train_path, **kw)
    else:
        train = make_task(d.task, "train", d.num_train, seed=d.seed, difficulty=d.difficulty)
    if d.test_path:
        test = load_problems(d.test_path, **kw)
    elif d.task and d.num_test:
        test = make_task(d.task, "test", d.num_test, seed=d.seed, difficulty=d.difficulty)
    else:
        test = []
    return train, test[: d.num_test] if d.num_test else []


def lr_multiplier(warmup_steps: int):
    # the authors' LambdaLR: min(1, s / warmup), stepped once per training step (so step 1 runs at lr 0)
    return lambda s: 1.0 if warmup_steps == 0 else min(1.0, s / warmup_steps)


class MetricAccumulator:
    """Token-weighted means over micro-batches (quadrant entropies weighted by quadrant token counts)."""

    def __init__(self) -> None:
        self.sums: dict[str, Tensor | float] = defaultdict(float)
        self.weights: dict[str, Tensor | float] = defaultdict(float)

    def add(self, metrics: dict[str, Tensor], n_tokens: Tensor) -> None:
        for k, v in metrics.items():
            w = metric_weight(k, metrics, n_tokens)
            self.sums[k] = self.sums[k] + v.detach() * w
            self.weights[k] = self.weights[k] + w

    def result(self) -> dict[str, float]:
        out = {}
        for k, s in self.sums.items():
            w = float(self.weights[k])
            out[k] = float(s) / w if w > 0 else 0.0
        return out


class Trainer:
    def __init__(self, cfg: Config, resume: bool = False):
        self.cfg = cfg
        self.run_dir = Path(cfg.output_dir)
        self._check_writable(self.run_dir)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
        torch.manual_seed(cfg.train.seed)
        self.objective = get_objective(cfg.algorithm.objective, **cfg.algorithm.hparams)
        try:
            self.reward_fn = load_reward(cfg.reward.fn, correct_score=cfg.reward.correct_score,
                                         incorrect_score=cfg.reward.incorrect_score, timeout=cfg.reward.timeout_s)
        except ValueError as e:
            raise ConfigError(f"reward.fn: {e}") from None
        self.train_problems, self.test_problems = load_splits(cfg)

        resume_from = ckpt.latest_valid_checkpoint(self.ckpt_dir) if resume else None
        if resume and resume_from is None:
            log.warning("--resume: no valid checkpoint under %s; starting from scratch", self.ckpt_dir)
        source = str(resume_from) if resume_from else cfg.model.name
        try:
            self.model, self.tokenizer = load_model(source, dtype="float32")
        except ModelLoadError as e:
            raise ModelLoadError(f"{'checkpoint ' + source if resume_from else 'model.name'}: {e}") from None
        self.ref_model = None
        if cfg.algorithm.kl_coeff > 0:  # frozen reference = the starting policy of this run
            # a fresh run starts from cfg.model.name, just loaded: copy it rather than read it again
            self.ref_model = load_model(cfg.model.name, dtype="float32")[0] if resume_from else copy.deepcopy(self.model)
            self.ref_model.eval().requires_grad_(False)
        if cfg.model.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_multiplier(o.warmup_steps))
        self.state = {"step": 0, "cursor": 0, "bad_steps": 0}
        self._order: tuple[int, list[int]] | None = None  # (epoch, shuffled indices), cached
        if resume_from is not None:
            self.state.update(ckpt.load_training_state(resume_from, self.optimizer, self.scheduler))
            log.info("resumed from %s at step %d", resume_from, self.state["step"])
        self._truncate_logs(self.state["step"], resumed=resume_from is not None)
        rollout_dtype = torch.bfloat16 if cfg.model.rollout_dtype == "bfloat16" else torch.float32
        self.engine = HFRollout(self.model, self.tokenizer, cfg.rollout.max_prompt_tokens, rollout_dtype)
        save_config(cfg, self.run_dir / "config.yaml")

    # ---------------------------------------------------------------------------------------------------
    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @staticmethod
    def _check_writable(path: Path) -> None:
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f".write-test-{os.getpid()}"
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            raise TrainingError(f"output directory {path} is not writable: {e.strerror or e}") from None

    def _truncate_logs(self, step: int, resumed: bool) -> None:
        """Drop metric and eval rows logged after the checkpoint we resume from (all of them on a fresh start):
        a kill between appending a step's row and writing its checkpoint must not leave that step twice."""
        eval_path = self.run_dir / "eval.jsonl"
        for path, keep in ((self.metrics_path, lambda r: r.get("step", 0) <= step),
                           # the final evaluation is redone by the resumed run
                           (eval_path, lambda r: r.get("step", 0) < step or
                            (r.get("step", 0) == step and r.get("tag") != "final"))):
            if path.exists():
                try:
                    kept = [r for r in read_jsonl(path) if keep(r)] if resumed else []
                except ValueError as e:
                    raise TrainingError(f"{e}; repair or remove the file to resume") from None
                atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))

    def sampling(self) -> Sampling:
        r = self.cfg.rollout
        return Sampling(r.temperature, r.top_p, r.top_k, r.max_new_tokens)

    def next_prompts(self, count: int) -> list[Problem]:
        """The next ``count`` training problems in a seeded per-epoch order (the cursor is checkpointed)."""
        out = []
        n = len(self.train_problems)
        while len(out) < count:
            epoch, pos = divmod(self.state["cursor"], n)
            if self._order is None or self._order[0] != epoch:  # one shuffle per epoch, derived from the seed
                g = torch.Generator().manual_seed(step_seed(self.cfg.train.seed, epoch, "data"))
                self._order = (epoch, torch.randperm(n, generator=g).tolist())
            out.append(self.train_problems[self._order[1][pos]])
            self.state["cursor"] += 1
        return out

    # ---------------------------------------------------------------------------------------------------
    def collect(self, step: int) -> tuple[Experience | None, dict]:
        """Generate, grade and compute advantages; with dynamic sampling keep only mixed-reward groups,
        generating up to ``max_num_gen_batches`` batches to fill ``prompts_per_step`` groups."""
        cfg, n = self.cfg, self.cfg.rollout.n
        kept: list[Experience] = []
        stats = defaultdict(float)
        kept_groups = 0
        for gen_batch in range(cfg.algorithm.max_num_gen_batches if cfg.algorithm.dynamic_sampling else 1):
            problems = self.next_prompts(cfg.train.gen_prompts_per_step or cfg.train.prompts_per_step)
            torch.manual_seed(step_seed(cfg.train.seed, step, f"rollout{gen_batch}"))
            rollouts = self.engine.generate([p.messages for p in problems], n, self.sampling())
            failpoint("generation", step)
            graded = self.reward_fn(rollouts.texts, [p.answer for p in problems for _ in range(n)])
            lengths = rollouts.response_mask.sum(-1).float()
            rewards = torch.tensor(graded.scores, dtype=torch.float32) + self.overlong_penalty(lengths)
            correct = torch.tensor(graded.correct)
            stats["reward/mean"] += rewards.mean().item()
            stats["reward/accuracy"] += correct.float().mean().item()
            stats["reward/failures"] += graded.failures
            stats["response_length/mean"] += lengths.mean().item()
            stats["response_length/max"] = max(stats["response_length/max"], lengths.max().item())
            stats["response_length/clip_ratio"] += rollouts.truncated.float().mean().item()
            stats["train/num_gen_batches"] = gen_batch + 1
            for msg in graded.failure_messages:
                log.warning("reward failure at step %d: %s", step, msg)
            adv = group_advantages(rewards, n, cfg.algorithm.advantage, cfg.algorithm.adv_eps)
            rows = torch.arange(len(rewards))
            if cfg.algorithm.dynamic_sampling:
                keep = mixed_groups(correct, n)
                rows = (torch.nonzero(keep).flatten()[:, None] * n + torch.arange(n)).flatten()
                rows = rows[: max(0, cfg.train.prompts_per_step - kept_groups) * n]
            kept_groups += len(rows) // n
            if len(rows):
                kept.append(Experience(rollouts.select(rows), rewards[rows], correct[rows], adv[rows]))
            if kept_groups >= cfg.train.prompts_per_step:
                break
        rounds = stats["train/num_gen_batches"]
        for k in ("reward/mean", "reward/accuracy", "response_length/mean", "response_length/clip_ratio"):
            stats[k] /= rounds
        stats["train/kept_groups"] = kept_groups
        return (self._concat(kept) if kept else None), dict(stats)

    def _concat(self, parts: list[Experience]) -> Experience:
        if len(parts) == 1:
            return parts[0]
        T = max(p.rollouts.response_len for p in parts)
        pad = self.tokenizer.pad_token_id

        def fit(x: Tensor, prompt_w: int, resp_w: int, value: int) -> Tensor:
            # re-pad [prompt | response] to the common prompt width (left) and response width (right)
            return torch.nn.functional.pad(x, (prompt_w, resp_w), value=value)

        ids, att, rmask, texts, trunc = [], [], [], [], []
        P = max(p.rollouts.input_ids.shape[1] - p.rollouts.response_len for p in parts)
        for p in parts:
            r = p.rollouts
            pw, rw = P - (r.input_ids.shape[1] - r.response_len), T - r.response_len
            ids.append(fit(r.input_ids, pw, rw, pad))
            att.append(fit(r.attention_mask, pw, rw, 0))
            rmask.append(fit(r.response_mask, 0, rw, 0))
            texts += r.texts
            trunc.append(r.truncated)
        rb = RolloutBatch(torch.cat(ids), torch.cat(att), torch.cat(rmask), texts, torch.cat(trunc))
        return Experience(rb, torch.cat([p.rewards for p in parts]), torch.cat([p.correct for p in parts]),
                          torch.cat([p.advantages for p in parts]))

    def overlong_penalty(self, length: Tensor) -> Tensor:
        """DAPO overlong shaping of responses of ``length`` tokens: ``min(-(len - (L_max - L_buf)) / L_buf *
        factor, 0)`` (off when L_buf = 0)."""
        buf = self.cfg.reward.overlong_buffer
        if buf == 0:
            return torch.zeros_like(length)
        expected = self.cfg.rollout.max_new_tokens - buf
        return torch.clamp(-(length - expected) / buf * self.cfg.reward.overlong_penalty, max=0.0)

    def token_stats(self, model: torch.nn.Module, rb: RolloutBatch, rows: Tensor, collision: bool = False):
        with autocast(self.cfg.model.precision, model):
            return sequence_token_stats(model, rb.input_ids[rows], rb.attention_mask[rows], rb.response_len,
                                        self.cfg.rollout.temperature, collision)

    @torch.no_grad()
    def recompute_log_probs(self, exp: Experience) -> tuple[Tensor, Tensor]:
        """Old log-probs (and entropy) of the sampled responses under the current policy, in micro-batches."""
        lps, ents, refs = [], [], []
        all_rows = torch.arange(len(exp.rewards))
        for rows in all_rows.split(self.cfg.train.micro_batch_size):
            lp, ent, _ = self.token_stats(self.model, exp.rollouts, rows)
            lps.append(lp)
            ents.append(ent)
            if self.ref_model is not None:
                refs.append(self.token_stats(self.ref_model, exp.rollouts, rows)[0])
        exp.old_log_prob = torch.cat(lps)
        exp.ref_log_prob = torch.cat(refs) if refs else None
        return exp.old_log_prob, torch.cat(ents)

    # ---------------------------------------------------------------------------------------------------
    def step(self) -> dict:
        """One RL step. Returns the metrics row written to ``metrics.jsonl``."""
        cfg, t0 = self.cfg, time.perf_counter()
        step = self.state["step"] + 1
        exp, metrics = self.collect(step)  # rollout -> reward -> advantages -> dynamic sampling
        t_gen = time.perf_counter() - t0
        acc, skipped = MetricAccumulator(), 0
        if exp is not None:
            self.model.train()
            _, old_entropy = self.recompute_log_probs(exp)
            mask = exp.rollouts.response_mask.float()
            metrics["entropy"] = float((old_entropy * mask).sum() / mask.sum().clamp(min=1))
            rows = torch.arange(len(exp.rewards))
            for _ in range(cfg.train.ppo_epochs):
                for mb in rows.tensor_split(cfg.train.mini_batches):  # one optimizer step per mini-batch
                    if len(mb) == 0:
                        continue
                    n_tok = mask[mb].sum().clamp(min=1)
                    n_correct_tok = (mask[mb] * exp.correct[mb, None]).sum().clamp(min=1)
                    self.optimizer.zero_grad(set_to_none=True)
                    finite_loss = torch.tensor(True)
                    for micro in mb.split(cfg.train.micro_batch_size):  # exact global token-mean via num_tokens
                        loss, m = self.micro_loss(exp, micro, n_tok, len(mb), n_correct_tok)
                        finite_loss = finite_loss & torch.isfinite(loss.detach())  # checked once per mini-batch
                        loss.backward()
                        acc.add(m, mask[micro].sum())
                    grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
                    if bool(finite_loss & torch.isfinite(grad_norm)):
                        failpoint("optimizer-step", step)
                        self.optimizer.step()
                    else:  # NaN/Inf in the logits, loss or gradient: skip this update, keep the weights
                        skipped += 1
                        self.optimizer.zero_grad(set_to_none=True)
                        log.warning("step %d: non-finite %s; update skipped (train/skipped_updates)", step,
                                    "loss" if not bool(finite_loss) else f"gradient norm ({float(grad_norm)})")
                    acc.add({"grad_norm": grad_norm}, torch.tensor(1.0))
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()  # once per training step, as the authors' LambdaLR
        if exp is not None:  # the weights changed: copy them into the rollout engine
            self.engine.sync(self.model)
        metrics.update(acc.result())
        metrics["train/skipped_updates"] = skipped
        self.state["bad_steps"] = self.state["bad_steps"] + 1 if skipped else 0
        self.state["step"] = step
        metrics.update(step=step, **{"time/step_s": time.perf_counter() - t0, "time/rollout_s": t_gen})
        return metrics

    def micro_loss(self, exp: Experience, rows: Tensor, n_tok: Tensor, n_seq: int, n_correct_tok: Tensor):
        """Objective (+ optional NLL on correct rollouts, KL, entropy bonus) of one micro-batch, and its metrics."""
        a = self.cfg.algorithm
        lp, ent, col = self.token_stats(self.model, exp.rollouts, rows, collision=True)  # col: for quadrant dH
        mask = exp.rollouts.response_mask[rows].float()
        n_here = mask.sum().clamp(min=1)
        old, adv = exp.old_log_prob[rows], exp.advantages[rows]
        loss, m = self.objective(lp, old, adv, mask, agg=a.agg, num_tokens=n_tok, num_seqs=n_seq)
        m = {k: v for k, v in m.items() if k != "loss"}
        m["pg_loss"] = loss.detach() * n_tok / n_here  # undo the global scaling for logging
        m.update(quadrant_metrics(self.objective, lp.detach(), old, adv, mask, ent.detach(), col, prob_threshold=a.prob_threshold))
        if a.positive_loss_coeff > 0:  # Klear-Reasoner / authors' scripts: NLL on fully-correct rollouts
            cmask = mask * exp.correct[rows, None]
            pos = aggregate(-lp, cmask, "token-mean", num_tokens=n_correct_tok)
            loss = loss + a.positive_loss_coeff * pos
            m["positive_loss"] = pos.detach()
        if a.kl_coeff > 0:  # k3 estimator of KL(pi || pi_ref)
            d = (exp.ref_log_prob[rows] - lp).clamp(-20, 20)
            kl = aggregate(d.exp() - d - 1, mask, a.agg, num_tokens=n_tok, num_seqs=n_seq)
            loss = loss + a.kl_coeff * kl
            m["kl"] = kl.detach() * n_tok / n_here
        if a.entropy_coeff > 0:
            loss = loss - a.entropy_coeff * aggregate(ent, mask, a.agg, num_tokens=n_tok, num_seqs=n_seq)
        m["entropy/current"] = aggregate(ent.detach(), mask, "token-mean")
        return loss, m

    # ---------------------------------------------------------------------------------------------------
    def evaluate(self, problems: list[Problem] | None = None) -> EvalResult:
        e = self.cfg.eval
        problems = self.test_problems if problems is None else problems
        torch.manual_seed(step_seed(self.cfg.train.seed, self.state["step"], "eval"))
        return evaluate(self.engine, problems[: e.num_problems], self.reward_fn, e.k,
                        Sampling(e.temperature, e.top_p, 0, e.max_new_tokens))

    def save(self) -> Path:
        return ckpt.save_checkpoint(self.ckpt_dir, self.state["step"], self.model, self.tokenizer, self.optimizer,
                                    self.scheduler, dict(self.state), keep=self.cfg.train.keep_checkpoints)

    def log_eval(self, tag: str, result: EvalResult) -> dict:
        row = {"step": self.state["step"], "tag": tag, "accuracy": result.headline("avg@k"),
               "pass@k": result.headline("pass@k"), "maj@k": result.headline("maj@k")}
        append_jsonl(self.run_dir / "eval.jsonl", row)
        return row

    def train(self, on_step=None) -> list[dict]:
        """Run to ``train.steps``, logging, validating and checkpointing; returns the metric rows written."""
        cfg = self.cfg
        rows = []
        bar = None
        if cfg.logging.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.train.steps, initial=self.state["step"], desc="cegppo train", dynamic_ncols=True)
        writer, wandb_run = self._tensorboard(), self._wandb()
        while self.state["step"] < cfg.train.steps:
            row = self.step()
            step = row["step"]
            if cfg.eval.every and step % cfg.eval.every == 0 and self.test_problems:
                row["val/accuracy"] = self.log_eval("periodic", self.evaluate())["accuracy"]
            append_jsonl(self.metrics_path, row)
            rows.append(row)
            scalars = {k: v for k, v in row.items() if isinstance(v, (int, float))}
            if writer is not None:
                for k, v in scalars.items():
                    writer.add_scalar(k, v, step)
            if wandb_run is not None:
                wandb_run.log(scalars, step=step)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{row['reward/mean']:.2f}", acc=f"{row['reward/accuracy']:.2f}",
                                H=f"{row.get('entropy', float('nan')):.3f}",
                                clip=f"{row.get('clip/low_frac', 0):.3f}/{row.get('clip/high_frac', 0):.3f}")
            if cfg.train.save_every and step % cfg.train.save_every == 0:
                self.save()
            if on_step is not None:
                on_step(self, row)
            if self.state["bad_steps"] >= cfg.train.max_bad_steps:
                raise TrainingError(
                    f"{self.state['bad_steps']} consecutive steps had a non-finite loss or gradient (train.max_bad_steps="
                    f"{cfg.train.max_bad_steps}); stopping. Last checkpoint: {ckpt.latest_valid_checkpoint(self.ckpt_dir)}")
        if bar is not None:
            bar.close()
        saved = ckpt.list_checkpoints(self.ckpt_dir)
        if cfg.train.save_every and (not saved or saved[-1] != ckpt.step_dir(self.ckpt_dir, self.state["step"])):
            self.save()
        return rows

    def _wandb(self):
        if not self.cfg.logging.wandb:
            return None
        try:
            import wandb
        except ImportError:
            log.warning("logging.wandb is set but wandb is not installed (pip install wandb)")
            return None
        return wandb.init(project="cegppo", name=self.run_dir.name, dir=str(self.run_dir), config=self.cfg.to_dict(),
                          resume="allow")

    def _tensorboard(self):
        if not self.cfg.logging.tensorboard:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.warning("logging.tensorboard is set but tensorboard is not installed (pip install tensorboard)")
            return None
        return SummaryWriter(str(self.run_dir / "tensorboard"))


def write_summary(run_dir: Path, summary: dict) -> None:
    atomic_write_json(run_dir / "summary.json", summary)
