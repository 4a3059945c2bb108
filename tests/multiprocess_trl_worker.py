"""One training run of ``CEGPPOTrainer`` for tests/test_multiprocess_trl.py, in 1 process or under torchrun.

Generation is replaced by a deterministic function of (prompt token ids, sample index within the group), so a
1-process and a 2-process run see the same completions; rewards, advantages (gathered across processes), old
log-probs, the loss, DDP and the optimizer stay TRL's own. Each optimizer step's gradients (after DDP's all-reduce,
before clipping: max_grad_norm=0) are saved from rank 0, with the log history, the final weights and each rank's
completion-token count.

Usage: python multiprocess_trl_worker.py MODEL_DIR OUT_DIR PER_DEVICE_BATCH GRAD_ACCUM
"""

from __future__ import annotations

import gc
import json
import os
import sys
import zlib
from typing import Any

import torch
from datasets import Dataset

from cegppo.integrations.trl import CEGPPOConfig, CEGPPOTrainer

NUM_GENERATIONS = 4
GLOBAL_COMPLETIONS = 16  # per generation batch (= per optimizer step): 4 prompts x 4 samples


def length_reward(completions: list, **kwargs: Any) -> list[float]:
    """Varies within a group (the replayed completions have different lengths), so advantages are non-zero."""
    return [float(len(c[0]["content"]) % 7) for c in completions]


class ReplayTrainer(CEGPPOTrainer):
    """Completions drawn from a generator seeded by the prompt's token ids and the sample's index in its group:
    the same completions whatever the number of processes (TRL keeps each group in one process here)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.completion_tokens = 0  # this rank's completion tokens, over all generation batches
        self.step_grads: list[torch.Tensor] = []

    def _generate_single_turn(self, prompt_ids: list[list[int]], images: Any, multimodal_fields: Any,
                              num_generations: int, has_tool_images: bool = False) -> tuple[list[list[int]], None]:
        seen: dict[tuple[int, ...], int] = {}
        vocab = self.model.config.vocab_size
        eos = self._tokenizer.eos_token_id
        completions = []
        for ids in prompt_ids:
            key = tuple(ids)
            index = seen.get(key, 0)
            seen[key] = index + 1
            g = torch.Generator().manual_seed(zlib.crc32(repr((key, index)).encode()))
            # lengths 2..15 tokens: unequal token counts per rank and per micro-batch
            n = int(torch.randint(2, 16, (1,), generator=g))
            tokens = torch.randint(3, vocab, (n,), generator=g)
            tokens = tokens[tokens != eos].tolist() + [eos]
            completions.append(tokens)
            self.completion_tokens += len(tokens)
        return completions, None

    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        optimizer = super().create_optimizer(*args, **kwargs)

        def record(opt: torch.optim.Optimizer, *_: Any) -> None:
            # the accumulated, DDP-averaged gradient this step applies
            self.step_grads.append(torch.cat([p.grad.detach().flatten().clone() for p in self.model.parameters()]))

        optimizer.register_step_pre_hook(record)
        return optimizer


def main() -> None:
    model_dir, out_dir, per_device, grad_accum = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    assert per_device * grad_accum * world == GLOBAL_COMPLETIONS, (per_device, grad_accum, world)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {i}+{3 * i}?"}] for i in range(8)]})
    args = CEGPPOConfig(
        output_dir=out_dir, per_device_train_batch_size=per_device, gradient_accumulation_steps=grad_accum,
        num_generations=NUM_GENERATIONS, max_completion_length=16, logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, bf16=False, seed=0, max_steps=2, num_iterations=2,
        # SGD: the update is linear in the gradient, so equal gradients give equal weights for the off-policy step
        # (Adam's g / sqrt(v) amplifies rounding in near-zero gradients); lr large enough that the beta regions act
        optim="sgd", learning_rate=3.0, max_grad_norm=0.0, beta1=0.5, beta2=1.0,
        ddp_backend="gloo" if world > 1 else None,
    )
    trainer = ReplayTrainer(model=model_dir, reward_funcs=[length_reward], args=args, train_dataset=dataset)
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    tokens = [None] * world
    if world > 1:
        torch.distributed.all_gather_object(tokens, trainer.completion_tokens)
    else:
        tokens = [trainer.completion_tokens]
    if rank == 0:
        torch.save({"grads": trainer.step_grads,
                    "weights": torch.cat([p.detach().flatten() for p in trainer.model.parameters()])},
                   os.path.join(out_dir, "tensors.pt"))
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump({"logs": [h for h in trainer.state.log_history if "loss" in h], "tokens_per_rank": tokens}, f)
    if world > 1:
        # Every rank leaves together, with the gloo group destroyed and, first, the trainer freed (its DDP model holds
        # the group): left to interpreter teardown, a rank aborted after training had finished ("terminate called
        # without an active exception") in 3 of 24 two-process runs and once in CI; 0 of 48 with the trainer freed.
        del trainer
        gc.collect()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
