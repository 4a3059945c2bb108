"""CE-GPPO for TRL 1.16.x: ``CEGPPOConfig(GRPOConfig)`` and ``CEGPPOTrainer(GRPOTrainer)``.

The trainer overrides only ``_compute_loss``. It computes per-token log-probs and entropies with TRL's own
helper, takes the per-token loss from :func:`cegppo.algorithm.objectives.get_objective`, and keeps TRL's handling of
everything around it, as in TRL 1.16.0's ``loss_type="dapo"``:

- normalisation: masked token sum / ``num_items_in_batch`` rescaled to one accumulation window (``dapo``);
- the completion (and tool) mask, ``top_entropy_quantile``, ``off_policy_mask_threshold``, the vLLM
  importance-sampling correction, the KL term (``beta`` > 0), the entropy bonus (static or adaptive), and the
  MoE aux loss.

Metrics logged, each the token mean over all micro-batches of the logging window and all processes: TRL's
``entropy``, ``kl``, ``clip_ratio/{low,high,region}_mean``, plus ``clip/low_frac``, ``clip/high_frac``,
``clip/dual_frac``, ``ppo_kl``, ``ratio/mean`` and the quadrant metrics ``quadrant/<Q>/{frac,entropy}`` (Q in PA_HP,
PA_LP, NA_HP, NA_LP) of :func:`cegppo.algorithm.diagnostics.quadrant_metrics`, using the entropies TRL computes
(no ``dH``: that needs the collision term, which TRL does not compute).

Entropy autopilot: ``CEGPPOConfig(entropy_control={"enabled": True, "target": 0.7, ...})`` (the fields of
:class:`cegppo.algorithm.entropy_control.EntropyControlConfig`) runs the same controller as cegppo's trainer, once
per generation batch, just before TRL generates the next one. Its entropy is the token mean of the entropies TRL
computes in the loss over the previous generation batch's first pass (each completion once, reduced over all
processes): the policy during that batch's updates, where cegppo's trainer uses the rollout policy before them.
It logs ``control/*`` and saves its state as ``entropy_control_state.json`` in each checkpoint.

ERC (``CEGPPOConfig(erc=True)``, band ``erc_low`` / ``erc_high``, as cegppo's ``algorithm.erc``): a token whose
entropy ratio ``H / H_old`` to the sampling policy leaves the band gets no gradient. ``H_old`` is taken where TRL
computes the sampling policy's log-probs (``old_per_token_logps``, in the same forward pass, asked for its
entropies) and travels with the generation batch as ``old_entropies``; when TRL computes no old log-probs (every
update on-policy) the ratio is 1 and ERC keeps every token. Logged as ``erc/kept_frac``.

CE-GPPO only differs from GRPO/DAPO when the update is off-policy (ratio != 1): use ``num_iterations > 1`` or
``steps_per_generation > gradient_accumulation_steps``. The trainer warns otherwise.

Example::

    from cegppo.integrations.trl import CEGPPOConfig, CEGPPOTrainer
    args = CEGPPOConfig(output_dir="out", beta1=0.75, beta2=1.0, epsilon=0.2, num_iterations=2, ...)
    CEGPPOTrainer(model="path/or/name", reward_funcs=[...], args=args, train_dataset=ds).train()
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from trl import GRPOConfig, GRPOTrainer

from cegppo.algorithm.diagnostics import metric_weight
from cegppo.algorithm.entropy_control import EntropyControlConfig, build_controller, validate_entropy_control
from cegppo.algorithm.objectives import OBJECTIVES, Objective, get_objective
from cegppo.algorithm.policy_loss import (aggregator, entropy_bonus, entropy_metrics, entropy_ratio_mask, kl_metric,
                                          kl_penalty, policy_loss)

__all__ = ["CEGPPOConfig", "CEGPPOTrainer", "ONE_PROCESS_WARNING", "ON_POLICY_WARNING", "TRL_OBJECTIVES",
           "is_on_policy", "requested_processes"]

# token-level clipped objectives whose hyperparameters map onto GRPOConfig's epsilon / epsilon_high
TRL_OBJECTIVES = ("ce_gppo", "gppo", "ppo_clip")
_CE_GPPO = OBJECTIVES["ce_gppo"].defaults  # the same defaults as get_objective("ce_gppo") and the verl adapter

ON_POLICY_WARNING = (
    "CEGPPOTrainer: this configuration keeps every update on-policy (num_iterations == 1 and "
    "steps_per_generation <= gradient_accumulation_steps), so the importance ratio is identically 1, no token "
    "ever leaves the clip interval, and CE-GPPO is exactly GRPO/DAPO. Set num_iterations > 1 or "
    "steps_per_generation > gradient_accumulation_steps to let beta1/beta2 act."
)

ONE_PROCESS_WARNING = (
    "CEGPPOTrainer: the launcher asked for {requested} processes but this run has 1 process, which trains on "
    "1/{requested} of the intended global batch. `accelerate launch --cpu --num_processes N` starts one process; "
    "use `torchrun --nproc_per_node N` or `accelerate launch --multi_gpu --num_processes N` (docs/scale-out.md)."
)

CONTROL_STATE = "entropy_control_state.json"  # the controller's state, in each checkpoint directory

# optional model inputs TRL forwards to `_get_per_token_logps_and_entropies` (multimodal models)
_MODEL_KWARGS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
                 "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


@dataclass
class CEGPPOConfig(GRPOConfig):
    """``GRPOConfig`` plus CE-GPPO's hyperparameters.

    The clip bounds are GRPOConfig's: ``epsilon`` (eps_low) and ``epsilon_high`` (eps_high, defaults to
    ``epsilon``). ``beta`` stays TRL's KL coefficient; ``beta1``/``beta2`` are CE-GPPO's.

    Parameters:
        objective: ``"ce_gppo"`` (default), ``"gppo"`` (beta1 = beta2 = 1) or ``"ppo_clip"`` (PPO clip with the
            dual clip; ``beta1`` and ``beta2`` are ignored by the last two).
        beta1: gradient coefficient of the tokens with A < 0 and ratio < 1 - epsilon (authors: 0.5 at 1.5B, 0.75 at 7B).
        beta2: gradient coefficient of the tokens with A > 0 and ratio > 1 + epsilon_high (authors: 1.0).
        clip_ratio_c: dual-clip bound for A < 0 (ratio > c: constant loss, zero gradient); None disables it.
    """

    objective: str = field(default="ce_gppo", metadata={"help": f"one of {', '.join(TRL_OBJECTIVES)}"})
    beta1: float = field(default=_CE_GPPO["beta1"], metadata={"help": "CE-GPPO beta1 (A < 0, ratio < 1 - epsilon)"})
    beta2: float = field(default=_CE_GPPO["beta2"], metadata={"help": "CE-GPPO beta2 (A > 0, ratio > 1 + epsilon_high)"})
    clip_ratio_c: float | None = field(default=_CE_GPPO["clip_ratio_c"],
                                       metadata={"help": "dual-clip bound for A < 0; None: off"})
    erc: bool = field(default=False, metadata={
        "help": "ERC: tokens whose entropy ratio to the sampling policy leaves (erc_low, erc_high) get no gradient"})
    erc_low: float = field(default=0.95, metadata={"help": "ERC band's lower end, in (0, 1)"})
    erc_high: float = field(default=1.05, metadata={"help": "ERC band's upper end, > 1"})
    entropy_control: dict | None = field(default=None, metadata={
        "help": "entropy autopilot: the fields of cegppo's EntropyControlConfig, e.g. {'enabled': true, 'target': 0.7}"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.objective not in TRL_OBJECTIVES:
            raise ValueError(f"CEGPPOConfig.objective must be one of {TRL_OBJECTIVES}, got {self.objective!r}")
        if self.loss_type != "dapo":
            raise ValueError(
                f"CEGPPOConfig: loss_type={self.loss_type!r} is not used; CEGPPOTrainer computes the per-token loss "
                "from `objective` and normalises it like loss_type='dapo' (keep the default)."
            )
        if self.importance_sampling_level != "token":
            raise ValueError("CEGPPOConfig: CE-GPPO clips per-token ratios; importance_sampling_level must be 'token'")
        if self.delta is not None:
            raise ValueError("CEGPPOConfig: use clip_ratio_c (dual clip) instead of delta")
        if not (0 < self.erc_low < 1 < self.erc_high):
            raise ValueError(f"CEGPPOConfig: the ERC band needs 0 < erc_low < 1 < erc_high, got erc_low={self.erc_low}, "
                             f"erc_high={self.erc_high}")
        objective = self.build_objective()  # validate the hyperparameters now rather than at the first loss
        if isinstance(self.entropy_control, EntropyControlConfig):
            self.entropy_control = asdict(self.entropy_control)  # kept a plain dict: TrainingArguments serialise it
        if self.entropy_control is not None:
            try:
                ec = EntropyControlConfig(**self.entropy_control)
            except TypeError as e:
                raise ValueError(f"CEGPPOConfig.entropy_control: {e}") from None
            validate_entropy_control(ec, self.objective, objective.hparams, where="CEGPPOConfig.entropy_control")

    def build_objective(self) -> Objective:
        """The :class:`cegppo.algorithm.objectives.Objective` this config describes."""
        eps_high = self.epsilon_high if self.epsilon_high is not None else self.epsilon
        hp: dict[str, Any] = dict(eps_low=self.epsilon, eps_high=eps_high, clip_ratio_c=self.clip_ratio_c)
        if self.objective == "ce_gppo":
            hp.update(beta1=self.beta1, beta2=self.beta2)
        return get_objective(self.objective, **hp)


def _num_processes_in_accelerate_command(args: list[str]) -> int | None:
    """N of ``--num_processes N`` (or ``--num-processes=N``) when ``args`` is an ``accelerate launch`` command."""
    if "launch" not in args or not any(os.path.basename(a).startswith("accelerate") for a in args[:3]):
        return None
    for i, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name in ("--num_processes", "--num-processes"):
            value = value or (args[i + 1] if i + 1 < len(args) else "")
            return int(value) if value.isdigit() else None
    return None


def requested_processes() -> int | None:
    """The number of processes the launcher was asked for, where it can be seen: ``WORLD_SIZE`` (torchrun,
    accelerate's multi-process launchers), else the ``--num_processes`` of an ``accelerate launch`` parent process
    (Linux ``/proc``; ``accelerate launch --cpu --num_processes N`` starts ONE process and puts no count in its
    environment). None when neither tells."""
    world_size = os.environ.get("WORLD_SIZE", "")
    if world_size.isdigit():
        return int(world_size)
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            parent = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    return _num_processes_in_accelerate_command(parent)


def is_on_policy(args: GRPOConfig) -> bool:
    """True when TRL never reuses a generation batch for a second optimizer step: ratio == 1 exactly."""
    return args.num_iterations == 1 and args.steps_per_generation <= args.gradient_accumulation_steps


class CEGPPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose policy loss is CE-GPPO (or GPPO / PPO-clip), with entropy-quadrant diagnostics."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, CEGPPOConfig):
            raise TypeError(f"CEGPPOTrainer needs args=CEGPPOConfig(...), got {type(self.args).__name__}")
        self.objective = self.args.build_objective()
        self.entropy_controller = build_controller(self.args.entropy_control, self.objective.hparams)
        self._control_stats: torch.Tensor | None = None  # [sum of entropy, tokens] over the current generation batch
        self._old_entropies: torch.Tensor | bool | None = None  # ERC: True while the next old-log-prob pass is awaited
        # mode -> metric -> [token-weighted sum, weight] over the micro-batches since the last log (this process)
        self._token_weighted_sums: dict[str, dict[str, torch.Tensor]] = {}
        if is_on_policy(self.args):
            warnings.warn(ON_POLICY_WARNING, UserWarning, stacklevel=2)
        requested = requested_processes()
        if self.accelerator.num_processes == 1 and requested is not None and requested > 1:
            warnings.warn(ONE_PROCESS_WARNING.format(requested=requested), UserWarning, stacklevel=2)

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]

        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled, **{k: inputs.get(k) for k in _MODEL_KWARGS},
        )
        entropy_mask = (
            self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
            if self.top_entropy_quantile < 1.0 else None
        )
        self._collect_control_entropy(entropies, mask)

        old_per_token_logps = inputs.get("old_per_token_logps")
        old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
        advantages = inputs["advantages"]
        mode = "train" if self.model.training else "eval"

        # TRL's per-token weights on the objective, as in its own loss: off-policy mask, entropy mask, vLLM IS ratio
        weights = []
        if self.off_policy_mask_threshold is not None:
            weights.append(self.get_off_policy_mask(
                advantages=advantages if advantages.dim() == 2 else advantages.unsqueeze(1),
                per_token_logps=per_token_logps,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_per_token_logps), mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold))
        if entropy_mask is not None:
            weights.append(entropy_mask)
        if self.use_vllm and self.vllm_importance_sampling_correction:
            weights.append(inputs["importance_sampling_ratio"])
        kl_weights = None
        if self.beta != 0.0 and self.args.use_bias_correction_kl:
            kl_weights = torch.exp(per_token_logps - old_per_token_logps)
        # loss_type="dapo" normalisation: `num_items_in_batch` spans the generation batch; rescale it to one
        # accumulation window (train) so the micro-batch losses sum to the window's token mean
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation

        reduce, ref = aggregator("token-mean", num_tokens=normalizer), inputs.get("ref_per_token_logps")
        entropy_coeff = self._entropy_coefficient(entropies, mask, entropy_mask, mode) + self._control_bonus()
        erc = None
        if self.args.erc:  # no old entropies: every update on-policy, ratio 1, every token kept
            erc = entropy_ratio_mask(entropies, inputs.get("old_entropies", entropies.detach()), mask,
                                     self.args.erc_low, self.args.erc_high)
        pg, metrics = policy_loss(self.objective, per_token_logps, old_per_token_logps, advantages, mask, reduce=reduce,
                                  token_weights=math.prod(weights) if weights else None, gradient_mask=erc)
        if erc is not None:
            metrics["erc/kept_frac"] = (erc * mask).sum() / mask.sum().clamp(min=1)
        loss = (pg
                + self.beta * kl_penalty(per_token_logps, ref, mask, reduce=reduce, weights=kl_weights)
                - entropy_coeff * entropy_bonus(entropies, mask, reduce=reduce))
        metrics |= entropy_metrics(self.objective, per_token_logps, old_per_token_logps, advantages, mask, entropies)
        if self.beta > 0 and ref is not None:
            metrics["kl"] = kl_metric(per_token_logps, ref, mask)

        if self.aux_loss_enabled:
            normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / normalizer
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        self._log_metrics(mode, metrics, mask)
        return loss

    # ----------------------------------------------------------------------------------------------------
    # ERC: the sampling policy's entropies, from the forward pass TRL makes for its log-probs

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        if not self.args.erc:
            return super()._generate_and_score_completions(inputs)
        self._old_entropies = True  # the next policy pass of this generation is TRL's old_per_token_logps
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            old, self._old_entropies = self._old_entropies, None
        if "old_per_token_logps" in output and isinstance(old, torch.Tensor):
            output["old_entropies"] = old
        return output

    def _get_per_token_logps_and_entropies(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        if self._old_entropies is not True or model is not self.model or kwargs.get("compute_entropy"):
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        # TRL's old-log-prob pass (its first pass over this policy while generating): ask it for the entropies too
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(model, *args, **{**kwargs,
                                                                                          "compute_entropy": True})
        self._old_entropies = entropies
        return logps, None, aux

    # ----------------------------------------------------------------------------------------------------
    # entropy autopilot (cegppo.algorithm.entropy_control): measured in the loss, applied per generation batch

    def _generation_due(self) -> bool:
        """Whether GRPOTrainer._prepare_inputs generates a new batch at this step (its own condition)."""
        return self._step % (self.args.steps_per_generation * self.num_iterations) == 0 or self._buffered_inputs is None

    def _collect_control_entropy(self, entropies: torch.Tensor, mask: torch.Tensor) -> None:
        """Add this micro-batch's entropy to the generation batch's sum, on its first pass only (each completion
        once)."""
        first_pass = self._step % (self.args.steps_per_generation * self.num_iterations) < self.args.steps_per_generation
        if self.entropy_controller is None or not self.model.training or not first_pass:
            return
        stats = torch.stack([(entropies.detach() * mask).sum(), mask.sum()]).float()
        self._control_stats = stats if self._control_stats is None else self._control_stats + stats

    def _prepare_inputs(self, generation_batch: dict[str, Any]) -> dict[str, Any]:
        if self.entropy_controller is not None and self.model.training and self._generation_due():
            self._steer()
        return super()._prepare_inputs(generation_batch)

    def _steer(self) -> None:
        """One controller update from the last generation batch's entropy (none before the first: no change);
        the objective is rebuilt with the new betas and ``control/*`` logged."""
        local = self._control_stats if self._control_stats is not None else torch.zeros(2, device=self.accelerator.device)
        self._control_stats = None
        total = self.accelerator.reduce(local, reduction="sum")  # every process steers at the same step
        entropy = float(total[0] / total[1]) if float(total[1]) > 0 else None
        out = self.entropy_controller.update(entropy)
        self.objective = self.objective.with_betas(out["beta1"], out["beta2"])
        for k, v in out.items():
            if k.startswith("control/"):
                self._metrics["train"][k].append(v)

    def _control_bonus(self) -> float:
        """The autopilot's entropy-bonus lever (``bonus_gain`` > 0), added to TRL's own bonus."""
        return 0.0 if self.entropy_controller is None else self.entropy_controller.entropy_coeff

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.entropy_controller is not None and self.args.should_save:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            path = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}",
                                CONTROL_STATE)
            with open(path, "w") as f:
                json.dump(self.entropy_controller.state_dict(), f)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        self._load_entropy_control(checkpoint)

    def _load_entropy_control(self, checkpoint: str | None) -> None:
        """Restore the controller from ``checkpoint`` (the objective follows at the next generation batch)."""
        path = None if checkpoint is None else os.path.join(checkpoint, CONTROL_STATE)
        if self.entropy_controller is not None and path is not None and os.path.exists(path):
            with open(path) as f:
                self.entropy_controller.load_state_dict(json.load(f))
            b = self.entropy_controller
            self.objective = self.objective.with_betas(b.beta1, b.beta2)

    # ----------------------------------------------------------------------------------------------------
    # pieces of GRPOTrainer._compute_loss (TRL 1.16.0) kept as they are there

    def _entropy_coefficient(self, entropies: torch.Tensor, mask: torch.Tensor, entropy_mask: torch.Tensor | None,
                             mode: str) -> float:
        """The entropy-bonus coefficient this micro-batch applies: TRL 1.16.0's static or adaptive rule (its window
        statistics and ``entropy_coef`` metric); 0 when the bonus is off. The bonus itself is normalised like the
        policy loss (global token mean) by :func:`policy_loss`."""
        if not self._entropy_bonus_enabled:
            return 0.0
        effective_mask = mask if entropy_mask is None else mask * entropy_mask
        apply_coef = self.entropy_coef
        if self.use_adaptive_entropy:
            apply_coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
        if self.use_adaptive_entropy and mode == "train":
            stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
            self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
            if self.accelerator.sync_gradients:
                window_stats = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world_entropy = (window_stats[0] / window_stats[1].clamp(min=1.0)).item()
                if world_entropy <= self.args.entropy_target:
                    self.entropy_coef = min(self.entropy_coef + self.args.entropy_coef_delta, self.args.entropy_coef_max)
                else:
                    self.entropy_coef = max(self.entropy_coef - self.args.entropy_coef_delta, self.args.entropy_coef_min)
                self._last_world_entropy = world_entropy
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return float(apply_coef)

    @torch.no_grad()
    def _log_metrics(self, mode: str, metrics: dict[str, torch.Tensor], mask: torch.Tensor) -> None:
        """Add this micro-batch's token-weighted sums (numerator, weight) of :func:`policy_loss`'s metrics to the
        logging window's; :meth:`log` reduces them over all processes and divides, so each logged value is the
        token mean over every micro-batch and process of the window (as TRL's ``global_masked_mean`` is for one
        micro-batch). The quadrants' ``dH`` needs the collision term, which TRL does not compute."""
        n = mask.sum().float()
        names = [k for k in metrics if not k.endswith("/dH") and k != "dH/predicted"]
        parts = {name: (metrics[name] * metric_weight(name, metrics, n), metric_weight(name, metrics, n)) for name in names}
        parts["entropy"] = parts.pop("entropy/current")
        parts["policy_loss"] = parts.pop("pg_loss")
        # TRL's names for the same regions, so existing dashboards keep working
        parts["clip_ratio/low_mean"] = parts["clip/low_frac"]
        parts["clip_ratio/high_mean"] = parts["clip/high_frac"]
        parts["clip_ratio/region_mean"] = ((metrics["clip/low_frac"] + metrics["clip/high_frac"]) * n, n)
        window = self._token_weighted_sums.setdefault(mode, {})
        for name, (num, den) in parts.items():
            local = torch.stack([num.detach().float(), den.detach().float()])
            window[name] = local if name not in window else window[name] + local

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's ``log``, with the token-weighted metrics of the window reduced over all processes (one reduce,
        which every process reaches: the Trainer calls ``log`` on all of them at the same steps)."""
        mode = "train" if self.model.training else "eval"
        window = self._token_weighted_sums.pop(mode, {})
        if window:
            names = sorted(window)  # the same order on every process
            totals = self.accelerator.reduce(torch.stack([window[k] for k in names]), reduction="sum")
            for name, (num, den) in zip(names, totals.tolist()):
                self._metrics[mode][name] = [num / max(den, 1.0)]
        super().log(logs, start_time)
