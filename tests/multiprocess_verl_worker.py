"""One run of verl 0.9.1's FSDP2 training engine with the registered ``ce_gppo`` loss, for
tests/test_multiprocess_verl.py: ``torchrun --nproc_per_node N`` (gloo, CPU, tests/verl_cpu_shim.py), N = 1 or 2.

Driven as verl's trainer drives its actor: ``compose("ppo_trainer", overrides)`` -> ``omega_conf_to_dataclass`` ->
``EngineRegistry.new("language_model", "fsdp2")`` -> ``initialize()`` -> ``left_right_2_no_padding`` ->
``infer_batch`` for the old log-probs -> ``train_batch(data, loss_function=partial(ppo_loss, config=actor_config))``,
twice on the same global batch: update 1 on-policy, update 2 off-policy (old log-probs from before update 1, as a
second PPO epoch). Each rank takes its contiguous slice of the global batch (unequal tokens per rank). Rank 0
writes the per-update loss, grad norm and metrics (aggregated over ranks as verl's TrainingWorker does) and the
final full weights.

Usage: torchrun --nproc_per_node N multiprocess_verl_worker.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")  # verl registers FSDPEngineWithLMHead for cuda / npu only

GLOBAL_BATCH = 8
PROMPT_LEN, RESPONSE_LEN = 5, 10
MICRO_BATCH_PER_RANK = 2  # gradient accumulation inside each rank


def overrides(model_dir: str) -> list[str]:
    a = "actor_rollout_ref.actor."
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # no flash-attention on CPU
        "actor_rollout_ref.model.use_remove_padding=False",
        a + "strategy=fsdp2",  # FSDP1 needs GPU tensors for sync_module_states
        a + "use_torch_compile=False",
        "++" + a + "fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        a + f"ppo_mini_batch_size={GLOBAL_BATCH}",
        a + f"ppo_micro_batch_size_per_gpu={MICRO_BATCH_PER_RANK}",
        a + "optim.optimizer=SGD",  # linear in the gradient: equal gradients give equal weights (Adam amplifies
        # rounding in near-zero gradients)
        a + "optim.lr=3.0",
        a + "optim.weight_decay=0.0",
        a + "policy_loss._target_=cegppo.integrations.verl.CEGPPOPolicyLossConfig",
        a + "policy_loss.loss_mode=ce_gppo",
        "+" + a + "policy_loss.beta1=0.5",
        "+" + a + "policy_loss.beta2=1.0",
        a + "clip_ratio_c=10.0",
        a + "loss_agg_mode=token-mean",
        "actor_rollout_ref.rollout.n=1",
    ]


def global_batch(vocab: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts, right-padded responses; the first half of the rows has long responses, the second
    short ones, so 2 ranks hold different token counts."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (GLOBAL_BATCH, PROMPT_LEN), generator=g)
    prompt_mask = torch.ones(GLOBAL_BATCH, PROMPT_LEN, dtype=torch.long)
    prompt_mask[1, :2] = 0
    prompt_mask[6, :3] = 0
    responses = torch.randint(3, vocab, (GLOBAL_BATCH, RESPONSE_LEN), generator=g)
    lengths = torch.tensor([10, 9, 10, 8, 3, 5, 2, 4])
    response_mask = (torch.arange(RESPONSE_LEN)[None, :] < lengths[:, None]).long()
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    input_ids = torch.cat([prompts, responses], 1) * attention_mask
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.5, -1.5, 0.8, -0.8])[:, None].expand(-1, RESPONSE_LEN)
    return dict(prompts=prompts * prompt_mask, input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids, responses=responses,
                response_mask=response_mask, advantages=advantages.float() * response_mask)


def build_engine(model_dir: str, extra_overrides: tuple[str, ...] = ()):
    """verl's FSDP2 engine as its worker builds it, from verl's Hydra config with :func:`overrides` (+ extra):
    returns (engine, actor_config, model_config). Needs the process group and tests/verl_cpu_shim.py installed."""
    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine import EngineRegistry

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides(model_dir) + list(extra_overrides))
    model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    actor_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    actor_config.model_config = model_config
    engine_config = actor_config.engine
    engine_config.use_dynamic_bsz = False
    engine_config.micro_batch_size_per_gpu = MICRO_BATCH_PER_RANK
    engine_config.infer_micro_batch_size_per_gpu = MICRO_BATCH_PER_RANK
    engine_config.use_remove_padding = False
    engine = EngineRegistry.new("language_model", "fsdp2", model_config=model_config, engine_config=engine_config,
                                optimizer_config=actor_config.optim, checkpoint_config=actor_config.checkpoint)
    engine.initialize()
    return engine, actor_config, model_config


def main() -> None:
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    import verl_cpu_shim

    verl_cpu_shim.install()
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric.utils import Metric
    from verl.utils.torch_functional import allgather_dict_into_dict
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    import cegppo.integrations.verl as cv

    cv.check(trainer=False)  # ce_gppo is verl's, loaded through the entry point at `import verl`
    engine, actor_config, model_config = build_engine(model_dir)

    full = global_batch(model_config.hf_config.vocab_size)
    per_rank = GLOBAL_BATCH // world
    local = {k: v[rank * per_rank:(rank + 1) * per_rank].contiguous() for k, v in full.items()}
    engine_keys = dict(use_remove_padding=False, use_dynamic_bsz=False, micro_batch_size_per_gpu=MICRO_BATCH_PER_RANK,
                       use_fused_kernels=False, temperature=1.0)

    def batch(**extra: torch.Tensor) -> TensorDict:
        td = left_right_2_no_padding(TensorDict({**local, **extra}, batch_size=per_rank))
        tu.assign_non_tensor(td, **engine_keys)
        return td

    # old log-probs: the policy before update 1, as verl's _compute_old_log_prob
    td = batch()
    tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False)
    with engine.eval_mode():
        out = engine.infer_batch(td)
    old_log_probs = no_padding_2_padding(out["model_output"]["log_probs"], td).float().detach()

    results = []
    loss_fn = partial(ppo_loss, config=actor_config)
    for update in range(2):
        td = batch(old_log_probs=old_log_probs)
        tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=True, global_batch_size=GLOBAL_BATCH)
        with engine.train_mode():
            output = engine.train_batch(td, loss_function=loss_fn)
        # TrainingWorker._postprocess_output / train_mini_batch: loss summed over micro-batches, averaged over
        # ranks; metrics all-gathered and aggregated with Metric.aggregate_dp; grad norm already global
        metrics = output["metrics"]
        loss = torch.sum(torch.tensor(output["loss"]))
        torch.distributed.all_reduce(loss, op=torch.distributed.ReduceOp.AVG)
        grad_norm = float(metrics.pop("grad_norm"))
        gathered = allgather_dict_into_dict(metrics)
        row = {"loss": float(loss), "grad_norm": grad_norm, "tokens": int(local["response_mask"].sum())}
        for key, val in gathered.items():
            if isinstance(val, list) and val and isinstance(val[0], Metric):
                row[key] = float(Metric.aggregate_dp(val))
        tokens = [None] * world
        torch.distributed.all_gather_object(tokens, row.pop("tokens"))
        row["tokens_per_rank"] = tokens
        results.append(row)

    from torch.distributed.tensor import DTensor

    weights = {}
    for name, p in engine.module.named_parameters():
        full_p = p.full_tensor() if isinstance(p, DTensor) else p
        weights[name] = full_p.detach().clone()
    if rank == 0:
        torch.save(weights, os.path.join(out_dir, "weights.pt"))
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(results, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
