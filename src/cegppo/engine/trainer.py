"""The RL trainer. :meth:`Trainer.step` is the whole algorithm, top to bottom: rollout -> reward -> advantages ->
dynamic sampling -> old log-probs -> mini-batch updates -> metrics. The components it is built from come from
:mod:`cegppo.engine.components`, the batching from :mod:`cegppo.engine.batching`; the files it writes go through
:class:`cegppo.engine.rundir.RunDir`. The run loop (steps, held-out evaluations, checkpoints, progress) is the
recipe's: :func:`cegppo.recipes.train_loop`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch
from torch import Tensor

from cegppo.algorithm.collapse import CollapseGuard
from cegppo.algorithm.diagnostics import MetricAccumulator
from cegppo.algorithm.entropy_control import build_adaptive_entropy, build_controller
from cegppo.algorithm.objectives import get_objective
from cegppo.algorithm.policy_loss import (aggregator, correct_nll, entropy_bonus, entropy_metrics, entropy_ratio_mask,
                                         kl_metric, kl_penalty, policy_loss)
from cegppo.config import Config, check_data, check_prompt_budget
from cegppo.data.tasks import check_task
from cegppo.engine import checkpoint as ckpt
from cegppo.engine.batching import (Experience, column_token_stats, entropy_mean, entropy_sum, fill_old_log_probs,
                                    micro_batches, sampler_correction)
from cegppo.engine.collect import collect
from cegppo.engine.components import (DataOrder, build_optimizer, build_policy, build_reference, build_reward,
                                      build_rollout, configure_torch, load_splits, set_lr, weights_finite)
from cegppo.engine.lean_layers import lean_layers
from cegppo.engine.model_forward import fused_head_supported
from cegppo.engine.prompt_sharing import (prompt_sharing_supported, shared_prompt_micro_batches,
                                           shared_prompt_token_stats)
from cegppo.engine.precision import resolve_device, resolve_precision
from cegppo.engine.reporter import Reporter, Silent
from cegppo.engine.rollout import RolloutBatch
from cegppo.engine.rundir import RunDir, TrainingError
from cegppo.faults import failpoint

log = logging.getLogger(__name__)

__all__ = ["Experience", "Trainer", "TrainingError", "entropy_mean"]
MB_METRICS = ("ppo_kl", "clip/low_frac", "clip/high_frac", "clip/dual_frac")  # per mini-batch: the last one is logged


class Trainer:
    """``Trainer(cfg)`` starts a fresh run in ``cfg.output_dir`` (refused if the directory holds another run's
    files, unless ``overwrite``, which removes them); ``Trainer(cfg, resume=True)`` continues the run from its
    newest intact checkpoint, under the resume contract of :mod:`cegppo.engine.rundir`. The run directory is
    locked from here until :meth:`close` (``with Trainer(cfg) as t: ...`` closes it)."""

    def __init__(self, cfg: Config, resume: bool = False, overwrite: bool = False, accept_data_change: bool = False):
        if resume and overwrite:
            raise TrainingError("--resume continues the run in output_dir and --overwrite deletes it: pass one of them")
        self.cfg = cfg
        self.run = RunDir(cfg.output_dir)  # takes the run directory's lock, or refuses naming its holder
        try:
            self._setup(cfg, resume, overwrite, accept_data_change)
        except BaseException:
            self.run.close()
            raise

    def _setup(self, cfg: Config, resume: bool, overwrite: bool, accept_data_change: bool) -> None:
        check_task(cfg.data.task)  # the one key config cannot check (the task registry is data's)
        resume_from, run_id, changes = self.run.begin(cfg, resume, overwrite, accept_data_change)  # before any model is loaded
        configure_torch(cfg.train)
        self.objective = get_objective(cfg.algorithm.objective, **cfg.algorithm.hparams)
        self.controller = build_controller(cfg.algorithm.entropy_control, self.objective.hparams)  # entropy autopilot
        self.adaptive_bonus = build_adaptive_entropy(cfg.algorithm.adaptive_entropy)  # Skywork-OR1's rule
        self.reward_fn = build_reward(cfg.reward.fn, cfg.reward)
        self.train_problems, self.test_problems = load_splits(cfg)
        check_data(cfg, self.train_problems, self.test_problems)  # before any model loads
        self.data = DataOrder(self.train_problems, cfg.train.seed)
        source = str(resume_from) if resume_from else cfg.model.name
        self.device = resolve_device(cfg.model.device)
        self.model, self.tokenizer = build_policy(source, f"checkpoint {source}" if resume_from else "model.name",
                                                  self.device)
        check_prompt_budget(self.tokenizer, self.train_problems + self.test_problems, cfg.rollout.max_prompt_tokens)
        self.ref_model = build_reference(cfg, self.model, resumed=resume_from is not None)
        if cfg.model.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        # checkpointing keeps no layer activations: nothing for the lean layers to save, and its recomputation runs
        # the modules as loaded
        self.lean = cfg.model.lean_activations and not cfg.model.gradient_checkpointing
        self.precision = resolve_precision(cfg.model.precision, self.device)
        self.fused_head = fused_head_supported(self.model) if cfg.model.fused_lm_head == "auto" else cfg.model.fused_lm_head
        # the responses to a prompt computed with the prompt once, on models whose attention mask we can write
        self.shared_prompt = cfg.train.shared_prompt_tokens > 0 and prompt_sharing_supported(self.model)
        self.optimizer, self.scheduler = build_optimizer(cfg.optim, self.model)
        self.state = {"step": 0, "cursor": 0, "bad_steps": 0}
        if resume_from is not None:
            self.state.update(ckpt.load_training_state(resume_from, self.optimizer, self.scheduler))
            if any(k == "optim.lr" for k, _, _ in changes):
                set_lr(self.optimizer, self.scheduler, cfg.optim.lr)
            log.info("resumed from %s at step %d", resume_from, self.state["step"])
        self.guard, self.collapse = CollapseGuard(), []  # names a collapse as it starts (train.on_collapse)
        for key, control in (("entropy_control", self.controller), ("adaptive_entropy", self.adaptive_bonus),
                             ("collapse_guard", self.guard)):
            if control is not None and key in self.state:  # the autopilot's or adaptive bonus's state, resumed
                control.load_state_dict(self.state[key])
        self.state["run_id"] = run_id  # kept in every checkpoint: pruning only touches this run's
        self.state["config"] = cfg.to_dict()  # the config in force, compared on the next --resume
        self.run.truncate_logs(self.state["step"], resumed=resume_from is not None)
        self.generator = build_rollout(cfg, self.model, self.tokenizer)  # samples the rollouts (HF or vLLM)
        self.progress: Reporter = Silent()  # the run loop (cegppo.recipes.train_loop) puts a visible one here
        if resume_from is None:
            self.run.start(run_id, cfg)
        else:
            self.run.record_changes(self.state["step"], changes, cfg, run_id)

    def close(self) -> None:
        """Release the run directory's lock and the reward's worker processes (idempotent)."""
        self.run.close()
        if hasattr(self, "reward_fn"):
            self.reward_fn.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------------------------------------------
    def step(self) -> dict:
        """One RL step. Returns the metrics row written to ``metrics.jsonl``."""
        cfg, t0 = self.cfg, time.perf_counter()
        step = self.state["step"] + 1
        exp, metrics = self.collect(step)  # rollout -> reward -> advantages -> dynamic sampling
        t_gen = time.perf_counter() - t0
        acc, skipped = MetricAccumulator(), 0
        if exp is not None:
            exp = exp.to(self.device)
            self.model.train()
            mini_batches = torch.arange(len(exp.rewards)).tensor_split(cfg.train.mini_batches) * cfg.train.ppo_epochs
            # the first mini-batch is still on-policy: its loss pass gives its old log-probs and entropy, so the
            # separate pass covers only the rest (all of it when a controller needs the entropy before any update)
            on_policy_first = cfg.train.ppo_epochs == 1 and self.controller is None and self.adaptive_bonus is None
            fresh = mini_batches[0] if on_policy_first else torch.empty(0, dtype=torch.long)
            self.progress.phase("old log-probs")
            entropy = self.old_log_probs(exp, skip=fresh)  # [entropy sum, tokens] of the rows it covered
            metrics.update(self.steer(entropy))  # autopilot: this step's betas (on: every row is in `entropy`)
            for i, mb in enumerate(mini_batches, 1):  # one optimizer step per mini-batch; the later ones are off-policy
                self.progress.phase(f"update {i}/{len(mini_batches)}")
                if len(mb):
                    applied, mb_metrics = self.update(exp, mb, acc, step, entropy if i == 1 and len(fresh) else None)
                    metrics.update({f"mb_last/{k}": v for k, v in mb_metrics.items()})
                    if cfg.train.target_kl and mb_metrics["ppo_kl"] > cfg.train.target_kl:  # PPO's early stop
                        metrics["train/kl_stopped_at"] = i  # this mini-batch and the rest: no optimizer step
                        break
                    skipped += not applied
            metrics["entropy"] = entropy_mean(entropy)  # the rollout policy's, every response
            self.generator.sync(self.model)  # the weights changed: copy them into the generator
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()  # once per training step, as the authors' LambdaLR
        metrics.update(acc.result())
        metrics["train/skipped_updates"] = skipped
        self.state["bad_steps"] = self.state["bad_steps"] + 1 if skipped else 0
        self.state["step"] = step
        metrics.update(step=step, **{"time/step_s": time.perf_counter() - t0, "time/rollout_s": t_gen})
        self.collapse = self.guard.check(metrics) if cfg.train.on_collapse != "off" else []
        self.state["collapse_guard"] = self.guard.state_dict()
        metrics["collapse/flag"] = float(bool(self.collapse))
        for failure in self.collapse:
            log.warning("step %d: collapse guard: %s", step, failure)
        return metrics

    def steer(self, entropy: Tensor) -> dict:
        """Update the entropy autopilot (``algorithm.entropy_control``: this step's betas; its bonus lever is read by
        :meth:`entropy_coeff`) or the adaptive bonus (``algorithm.adaptive_entropy``) from the rollouts' entropy
        (``[sum, tokens]``); keep its state for the checkpoint; return its ``control/*`` metrics."""
        control = self.adaptive_bonus or self.controller
        if control is None:
            return {}
        out = control.update(entropy_mean(entropy))
        if control is self.controller:
            self.objective = self.objective.with_betas(out["beta1"], out["beta2"])
        self.state["adaptive_entropy" if control is self.adaptive_bonus else "entropy_control"] = control.state_dict()
        return {k: v for k, v in out.items() if k.startswith("control/")}

    def entropy_coeff(self) -> float:
        """The entropy-bonus coefficient of this step's loss: the configured one plus the autopilot's bonus lever or
        the adaptive bonus."""
        control = self.controller or self.adaptive_bonus
        return self.cfg.algorithm.entropy_coeff + (control.entropy_coeff if control else 0.0)

    def collect(self, step: int) -> tuple[Experience | None, dict]:
        """This step's experience (:func:`cegppo.engine.collect.collect`), advancing the data cursor."""
        exp, stats, self.state["cursor"] = collect(self.cfg, step, self.data, self.state["cursor"], self.generator,
                                                   self.reward_fn, self.tokenizer.pad_token_id, self.progress)
        return exp, stats

    def token_stats(self, model: torch.nn.Module, rb: RolloutBatch, rows: Tensor, collision: bool = False):
        """Per-token statistics of ``rows`` at the sampling temperature, in this run's precision: packed with their
        prompt once (:func:`shared_prompt_token_stats`) or in padded rows (:func:`column_token_stats`)."""
        t = self.cfg.rollout.temperature
        with lean_layers(model) if self.lean else contextlib.nullcontext():
            if self.shared_prompt:
                return shared_prompt_token_stats(model, rb, rows, t, self.precision, self.fused_head, self.pack_tokens,
                                                 collision)
            return column_token_stats(model, rb, rows, t, self.precision, self.fused_head, collision)

    def micro_batches(self, rb: RolloutBatch, rows: Tensor) -> list[Tensor]:
        """Micro-batches under ``train.micro_batch_size`` and ``train.micro_batch_tokens``, of whole packs when the
        prompt is shared."""
        tr = self.cfg.train
        if self.shared_prompt:
            return shared_prompt_micro_batches(rb, rows, tr.micro_batch_size, tr.micro_batch_tokens, self.pack_tokens)
        return micro_batches(rb, rows, tr.micro_batch_size, tr.micro_batch_tokens)

    @property
    def pack_tokens(self) -> int:
        """The longest pack: ``train.shared_prompt_tokens``, and no more than ``train.micro_batch_tokens`` (when set),
        so that the memory bound of a micro-batch holds with packs as with padded rows."""
        tr = self.cfg.train
        return min(tr.shared_prompt_tokens, tr.micro_batch_tokens or tr.shared_prompt_tokens)

    def old_log_probs(self, exp: Experience, skip: Tensor) -> Tensor:
        """:func:`fill_old_log_probs` of every row but ``skip`` (which :meth:`update` fills on-policy)."""
        return fill_old_log_probs(exp, skip, self.model, self.ref_model, self.token_stats, self.micro_batches,
                                  self.progress.heartbeat)

    def update(self, exp: Experience, mb: Tensor, acc: MetricAccumulator, step: int,
               on_policy_entropy: Tensor | None = None) -> tuple[bool, dict[str, float]]:
        """One optimizer step on mini-batch ``mb``, accumulated over micro-batches (exact global token-mean);
        skipped, weights kept, when the loss or the gradient is not finite or (``train.target_kl``) when the mini-batch's
        KL(old||new) passes the target. Returns whether it was applied, and the mini-batch's ``ppo_kl`` and clip shares.
        ``on_policy_entropy`` given: ``mb`` is on-policy and has no old log-probs yet; they are this pass's own,
        and its ``[entropy sum, tokens]`` are added to that tensor."""
        a, mask, mb_acc = self.cfg.algorithm, exp.loss_mask, MetricAccumulator()
        n_tok = mask[mb].sum().clamp(min=1)
        n_correct_tok = (mask[mb] * exp.correct[mb, None]).sum().clamp(min=1)
        reduce = aggregator(a.agg or self.objective.default_agg, num_tokens=n_tok, num_seqs=len(mb))
        self.optimizer.zero_grad(set_to_none=True)
        finite_loss = torch.tensor(True)
        done = 0
        for rows in self.micro_batches(exp.rollouts, mb):
            self.progress.heartbeat(f"{done}/{len(mb)} sequences")
            done += len(rows)
            lp, ent, col = self.token_stats(self.model, exp.rollouts, rows, collision=True)
            if on_policy_entropy is not None:  # the policy that generated: ratio exactly 1
                exp.old_log_prob[rows], exp.old_entropy[rows] = lp.detach(), ent.detach()
                on_policy_entropy += entropy_sum(ent.detach(), exp.mask[rows])
            old, adv, mk, correct = exp.old_log_prob[rows], exp.advantages[rows], mask[rows], exp.correct[rows]
            ref = None if exp.ref_log_prob is None else exp.ref_log_prob[rows]
            erc = entropy_ratio_mask(ent, exp.old_entropy[rows], mk, a.erc_low, a.erc_high) if a.erc else None
            tis = sampler_correction(exp, rows, self.cfg.rollout.tis_cap, acc)  # vLLM's sampling log-probs: TIS
            pg, m = policy_loss(self.objective, lp, old, adv, mk, reduce=reduce, token_weights=tis, gradient_mask=erc)
            c_nll, c_kl, c_ent = a.positive_loss_coeff, a.kl_coeff, self.entropy_coeff()  # a term is built only if used
            nll = correct_nll(lp, mk, correct, num_tokens=n_correct_tok) if c_nll else 0.0
            kl = kl_penalty(lp, ref, mk, reduce=reduce) if c_kl else 0.0
            bonus = entropy_bonus(ent, mk, reduce=reduce) if c_ent else 0.0
            loss = pg + c_nll * nll + c_kl * kl - c_ent * bonus
            m |= entropy_metrics(self.objective, lp, old, adv, mk, ent, collision=col, prob_threshold=a.prob_threshold)
            m |= {"positive_loss": nll.detach()} if c_nll else {}
            m |= {"kl": kl_metric(lp, ref, mk)} if c_kl and ref is not None else {}
            m |= {"erc/kept_frac": (erc * mk).sum() / mk.sum().clamp(min=1)} if erc is not None else {}
            finite_loss = finite_loss & torch.isfinite(loss.detach())  # read once per mini-batch
            loss.backward()
            acc.add(m, mask[rows].sum())
            mb_acc.add({k: m[k] for k in MB_METRICS}, mask[rows].sum())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        acc.add({"grad_norm": grad_norm}, torch.tensor(1.0))
        mb_metrics = mb_acc.result()
        if self.cfg.train.target_kl and mb_metrics["ppo_kl"] > self.cfg.train.target_kl:
            self.optimizer.zero_grad(set_to_none=True)  # PPO's early stop: this step would leave the trust region
            return False, mb_metrics
        if bool(finite_loss & torch.isfinite(grad_norm)):
            failpoint("optimizer-step", step)
            self.optimizer.step()
            if not weights_finite(self.model):  # a finite gradient times a huge lr: nothing left to sample from
                raise TrainingError(f"step {step}: the update made the weights non-finite (optim.lr="
                                    f"{self.optimizer.param_groups[0]['lr']:g}); stopping. Last checkpoint: "
                                    f"{ckpt.latest_valid_checkpoint(self.run.checkpoints)}")
            return True, mb_metrics
        self.optimizer.zero_grad(set_to_none=True)  # NaN/Inf in the logits, loss or gradient: keep the weights
        log.warning("step %d: non-finite %s; update skipped (train/skipped_updates)", step,
                    "loss" if not bool(finite_loss) else f"gradient norm ({float(grad_norm)})")
        return False, mb_metrics

    def save(self) -> Path:
        """A checkpoint of this step (policy, optimizer, scheduler, data position, autopilot), pruned to
        ``train.keep_checkpoints``. The trainer owns that state; the recipe decides when to save."""
        return ckpt.save_checkpoint(self.run.checkpoints, self.state["step"], self.model, self.tokenizer, self.optimizer,
                             self.scheduler, dict(self.state), keep=self.cfg.train.keep_checkpoints)
