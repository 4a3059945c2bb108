"""The entropy autopilot through verl 0.9.1's FSDP2 engine, for tests/test_multiprocess_verl_autopilot.py:
``torchrun --nproc_per_node N`` (gloo, CPU, tests/verl_cpu_shim.py), N = 1 or 2.

Each step is what cegppo's verl trainer (``trainer.v1.trainer_mode=cegppo_sync``) does, with rank 0 in the role of
verl's single-controller driver and torch.distributed in the role of Ray's dispatch:

1. every rank: verl's old-log-prob pass on its shard (``infer_batch``, ``calculate_entropy=True``);
2. the driver: ``actor/entropy`` as verl's ``_compute_old_log_prob`` computes it (``agg_loss`` over the whole
   batch, gathered), then :class:`cegppo.integrations.verl_autopilot.Autopilot` ``.step`` -> extra_info, sent to
   every rank, which puts it into its shard as verl's dispatch does (``_async_meta_to_realdata``);
3. every rank: two updates on its shard (on-, then off-policy, as ``ppo_epochs=2``) through ``train_batch`` with
   the :class:`AutopilotPPOLoss` the driver built and shipped (pickled, as ``set_loss_fn`` ships it).

``--save-after K`` writes the engine checkpoint (verl's ``save_checkpoint``) and the controller state
(``Autopilot.save``) after step K; ``--resume DIR`` loads both before the first step. Rank 0 writes result.json:
per step the driver's values and what each rank applied in each micro-batch, loss, grad norm, clip metrics.

Usage: torchrun --nproc_per_node N multiprocess_verl_autopilot_worker.py MODEL_DIR OUT_DIR FIRST LAST
       [--save-after K] [--resume DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")

import multiprocess_verl_worker as base  # noqa: E402

A = "actor_rollout_ref.actor."
CONTROL = ("+" + A + "policy_loss.entropy_control={enabled:true,target:1.02,kp:1.0,ki:0.5,ema:1.0,band:0.0,"
           "bonus_gain:0.2,bonus_max:0.1}")
EXTRA = (CONTROL, A + "optim.lr=1.0")
PER_STEP = ("loss", "grad_norm", "actor/pg_loss", "actor/clip/low_frac", "actor/clip/high_frac")


def broadcast(obj, rank: int):
    box = [obj if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("out_dir")
    p.add_argument("first", type=int)
    p.add_argument("last", type=int)
    p.add_argument("--save-after", type=int)
    p.add_argument("--resume")
    args = p.parse_args()
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    import verl_cpu_shim

    verl_cpu_shim.install()
    from tensordict import TensorDict
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric.utils import Metric
    from verl.utils.torch_functional import allgather_dict_into_dict
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    from cegppo.integrations.verl_autopilot import Autopilot, AutopilotPPOLoss

    engine, actor_config, model_config = base.build_engine(args.model_dir, EXTRA)
    driver = Autopilot.from_actor_config(actor_config) if rank == 0 else None
    # the driver builds the loss once and every worker gets its own copy (verl: set_loss_fn, ONE_TO_ALL)
    loss_fn = pickle.loads(broadcast(pickle.dumps(AutopilotPPOLoss(actor_config)) if rank == 0 else None, rank))
    if args.resume:
        engine.load_checkpoint(os.path.join(args.resume, "actor"))
        if rank == 0:
            assert driver.load(args.resume)

    full = base.global_batch(model_config.hf_config.vocab_size)
    per_rank = base.GLOBAL_BATCH // world
    local = {k: v[rank * per_rank:(rank + 1) * per_rank].contiguous() for k, v in full.items()}
    engine_keys = dict(use_remove_padding=False, use_dynamic_bsz=False,
                       micro_batch_size_per_gpu=base.MICRO_BATCH_PER_RANK, use_fused_kernels=False, temperature=1.0)

    def batch(**extra: torch.Tensor) -> TensorDict:
        td = left_right_2_no_padding(TensorDict({**local, **extra}, batch_size=per_rank))
        tu.assign_non_tensor(td, **engine_keys)
        return td

    results = []
    for step in range(args.first, args.last + 1):
        td = batch()
        tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False)
        with engine.eval_mode():
            out = engine.infer_batch(td)
        old_log_probs = no_padding_2_padding(out["model_output"]["log_probs"], td).float().detach()
        entropy = no_padding_2_padding(out["model_output"]["entropy"], td).float().detach()
        shards = [None] * world
        torch.distributed.all_gather_object(shards, (entropy, local["response_mask"]))
        row = {"step": step}
        if rank == 0:  # verl's driver: actor/entropy over the whole batch, then the controller
            metrics = {"actor/entropy": agg_loss(loss_mat=torch.cat([e for e, _ in shards]),
                                                 loss_mask=torch.cat([m for _, m in shards]).bool(),
                                                 loss_agg_mode=actor_config.loss_agg_mode).item()}
            extra_info = driver.step(metrics)
            extra_info["calculate_entropy"] = driver.needs_entropy
            row.update(metrics)
            row["extra_info"] = extra_info
        extra_info = broadcast(row.get("extra_info"), rank)
        for update in range(2):
            td = batch(old_log_probs=old_log_probs)
            tu.assign_non_tensor(td, compute_loss=True, global_batch_size=base.GLOBAL_BATCH)
            for key, val in extra_info.items():  # verl's dispatch: the batch's extra_info as non-tensor data
                tu.assign_non_tensor_data(tensor_dict=td, key=key, val=val)
            with engine.train_mode():
                output = engine.train_batch(td, loss_function=loss_fn)
            metrics = output["metrics"]
            loss = torch.sum(torch.tensor(output["loss"]))
            torch.distributed.all_reduce(loss, op=torch.distributed.ReduceOp.AVG)
            grad_norm = float(metrics.pop("grad_norm"))
            gathered = allgather_dict_into_dict(metrics)
            u = {"loss": float(loss), "grad_norm": grad_norm}
            for key, val in gathered.items():
                if key.startswith("control/applied_"):
                    u[key] = val  # per rank: one value per micro-batch
                elif isinstance(val, list) and val and isinstance(val[0], Metric):
                    u[key] = float(Metric.aggregate_dp(val))
            row[f"update{update}"] = u
        results.append(row)
        if step == args.save_after:
            ckpt = os.path.join(args.out_dir, "ckpt")
            engine.save_checkpoint(os.path.join(ckpt, "actor"), None, step)
            if rank == 0:
                driver.save(ckpt)
            torch.distributed.barrier()

    if rank == 0:
        results.append({"state": driver.controller.state_dict()})
        with open(os.path.join(args.out_dir, "result.json"), "w") as f:
            json.dump(results, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
