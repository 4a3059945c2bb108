"""Where bf16 autocast moves the training gradient: on the same batches and weights, the gradient of the warm-start's
SFT loss and of the RL loss under each precision mode against fp32, per parameter group and per layer.

    python benchmarks/precision_gradients.py                 # SmolLM2-135M, the quickstart's batches, 3 of each
    python benchmarks/precision_gradients.py --quick         # smoke test: the tiny model, into runs/

Modes (fp32 master weights throughout, as the trainer keeps them; the LM head as a plain ``F.linear``, the path of
``model.fused_lm_head=false``, which computes the same numbers as the fused head):

* ``fp32``: the reference;
* ``bf16 (emulated)``: the numerics of ``model.precision: bf16-autocast`` (every matmul in bf16, the LM head's
  included: logits rounded to bf16, then a float32 softmax), computed at fp32 speed by
  :class:`common.bf16_rounding.Bf16Rounding`, because on a CPU without native bf16 the real kernels are far slower (the report's matmul table);
* ``bf16 (emulated), fp32 head``: the same with the LM head's matmul (the logits) in float32;
* ``bf16-autocast``: the real thing, where bf16 is fast (or with ``--autocast``; ``--quick`` always, on the tiny
  model), so the emulation is checked against it (``vs autocast``).

Batches: SFT = the warm-start's loss (token-mean NLL of reference solutions, ``sft.batch_size`` problems drawn as
:func:`cegppo.engine.sft.supervised_warmup` draws them); RL = the quickstart's objective (CE-GPPO, its hparams) on
``rollout.n`` responses to ``train.prompts_per_step`` prompts sampled from the model in fp32 at T = 1, on-policy
(old log-probs from the same pass, as the first mini-batch of a step), with seeded random advantages N(0, 1) per
sequence: the gradient is a signed sum of the responses' log-prob gradients, which is what precision can disturb.

Reported per batch and mode: the cosine similarity and the relative error ``|g - g_fp32| / |g_fp32|`` of the whole
gradient, the cosine of the two sign vectors (``adam cos``: AdamW's first update is ``lr * g / |g|`` element-wise, so
this is how alike the updates it would make from them are, tiny gradients counting as much as large ones), of each parameter group (q/k/v/o, gate/up/down, norms, the tied embedding / LM head) and of each layer,
and the log-prob error (mean and max ``|log p - log p_fp32|`` over response tokens). The scale they must be judged
against is printed beside them: the cosine between the fp32 gradients of two different batches of the same kind
(the minibatch noise SGD lives with anyway). The seconds are this machine's, per forward + backward.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import torch

from cegppo.engine.model_forward import sequence_token_stats
from cegppo.algorithm.objectives import aggregate, get_objective
from cegppo.algorithm.policy_loss import aggregator, policy_loss
from cegppo.cli import _resolve_config
from cegppo.config import load_config
from cegppo.engine.components import build_policy, load_splits
from cegppo.engine.precision import fast_bf16
from cegppo.engine.rollout import HFGenerator, Sampling
from cegppo.engine.sft import sft_batch

from common import RESULTS, provenance, provenance_line, quick_out, write_results
from common.bf16_rounding import EMULATED, precision_context

def token_stats(model, ids, attn, width: int, mode: str, temperature: float = 1.0):
    """Per-token (log-prob, entropy, collision) of the last ``width`` tokens in ``mode``."""
    with precision_context(model, mode):
        return sequence_token_stats(model, ids, attn, width, temperature, True, fused_head=False)


def sft_backward(model, batch, mode: str) -> torch.Tensor:
    """The warm-start's loss on one batch, backward; its per-token log-probs."""
    ids, attn, mask = batch
    lp, _, _ = token_stats(model, ids, attn, mask.shape[1], mode)  # the warm-start's path
    aggregate(-lp, mask, "token-mean").backward()
    return lp.detach()


def rl_backward(model, batch, mode: str, objective, agg: str, temperature: float, rows: int = 8) -> torch.Tensor:
    """The RL loss on one step's rollouts, backward in micro-batches of ``rows`` (the batch's token-mean, exactly,
    as the trainer accumulates it; a whole 64-row batch's activations do not fit in memory); its log-probs."""
    rb, adv = batch
    mask = rb.response_mask.float()
    out = torch.zeros_like(mask)
    for s in range(0, mask.shape[0], rows):
        sl = slice(s, s + rows)
        lp, ent, col = token_stats(model, rb.input_ids[sl], rb.attention_mask[sl], rb.response_len, mode, temperature)
        loss, _ = policy_loss(objective, lp, lp.detach(), adv[sl], mask[sl],
                              reduce=aggregator(agg or objective.default_agg, num_tokens=mask.sum(),
                                                num_seqs=mask.shape[0]))
        loss.backward()
        out[sl] = lp.detach()
    return out


def group_of(name: str) -> tuple[str, int | None]:
    """``model.layers.3.self_attn.q_proj.weight`` -> (``self_attn.q_proj``, 3); embeddings/final norm: layer None."""
    m = re.search(r"layers\.(\d+)\.", name)
    short = re.sub(r"^model\.|layers\.\d+\.|\.weight$|\.bias$", "", name)
    return short, (int(m.group(1)) if m else None)


def gradient(model, backward) -> tuple[dict[str, torch.Tensor], torch.Tensor, float]:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    lp = backward()
    seconds = time.perf_counter() - t0
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, lp, seconds


def compare(g: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict:
    """Cosine and relative error of ``g`` against ``ref``: overall, per parameter group, per layer."""
    def pair(names: list[str]) -> dict:
        a = torch.cat([g[n].flatten() for n in names]).double()  # float64: a cosine of 1 - 1e-6 must read as such
        b = torch.cat([ref[n].flatten() for n in names]).double()
        return {"cos": float(torch.nn.functional.cosine_similarity(a, b, dim=0)),
                "rel_err": float((a - b).norm() / b.norm().clamp(min=1e-30)),
                # AdamW's first step is lr * g / |g| element-wise: how alike the two updates it would make are
                "adam_cos": float(torch.nn.functional.cosine_similarity(a.sign(), b.sign(), dim=0))}
    groups: dict[str, list[str]] = {}
    layers: dict[str, list[str]] = {}
    for n in ref:
        short, layer = group_of(n)
        groups.setdefault(short, []).append(n)
        layers.setdefault("other" if layer is None else str(layer), []).append(n)
    return {"all": pair(list(ref)), "groups": {k: pair(v) for k, v in groups.items()},
            "layers": {k: pair(v) for k, v in layers.items()}}


def logprob_error(lp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> dict:
    d = (lp - ref).abs() * mask
    return {"mean": float(d.sum() / mask.sum()), "max": float(d.max())}


def matmul_seconds(m: int, k: int, n: int, dtype: torch.dtype, repeat: int = 2) -> float:
    """Best-of-``repeat`` seconds of one ``[m, k] @ [k, n]`` product in ``dtype`` on this machine."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return best


def report(result: dict) -> str:
    lines = ["# Gradients under bf16 (autocast's numerics) against fp32", "", f"`{result['command']}`", "",
             provenance_line(result), "", result["setup"], "",
             "Each mode against fp32 on the same batch and weights: 1 - cosine and relative error of the whole "
             "gradient, adam cos (sign agreement: AdamW's first update), the parameter group furthest from fp32, the "
             "log-prob error over response tokens; where real autocast ran, the emulation's relative error to it.", "",
             "| loss | batch | mode | 1 - cos | rel. err | adam cos | worst group: 1 - cos | log-prob err mean / max "
             "| vs autocast: rel. err | s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        c = r.get("vs_fp32")
        if r["mode"] == "fp32":
            lines.append(f"| {r['loss']} | {r['batch']} | fp32 | | | | | | | {r['seconds']:.1f} |")
            continue
        worst = min(c["groups"].items(), key=lambda kv: kv[1]["cos"])
        real = r.get("vs_autocast")
        lines.append(f"| {r['loss']} | {r['batch']} | {r['mode']} | {1 - c['all']['cos']:.1e} | {c['all']['rel_err']:.4f} "
                     f"| {c['all']['adam_cos']:.3f} | {worst[0]}: {1 - worst[1]['cos']:.1e} | "
                     f"{r['logprob_err']['mean']:.4f} / {r['logprob_err']['max']:.3f} | "
                     f"{'' if real is None else format(real['rel_err'], '.4f')} | {r['seconds']:.1f} |")
    lines += ["", "This machine's matmul kernels (why the bf16 modes are emulated where bf16 is not native):", "",
              "| [m, k] @ [k, n] | fp32 s | bf16 s | bf16 / fp32 |", "|---|---|---|---|"]
    lines += [f"| {k['shape']} | {k['fp32_s']:.4f} | {k['bf16_s']:.4f} | {k['bf16_s'] / k['fp32_s']:.1f}x |"
              for k in result.get("matmul", [])]
    lines += ["", "The scale: the fp32 gradients of two different batches of the same kind (minibatch noise).", "",
              "| loss | batches | 1 - cos | rel. err | adam cos |", "|---|---|---|---|---|"]
    lines += [f"| {n['loss']} | {n['batches']} | {1 - n['cos']:.3f} | {n['rel_err']:.3f} | {n['adam_cos']:.3f} |"
              for n in result["batch_noise"]]
    lines += ["", "Per parameter group (mean over batches): 1 - cos to fp32 / adam cos to fp32.", "",
              "| loss | group | " + " | ".join(result["modes"][1:]) + " |", "|---|---|" + "---|" * (len(result["modes"]) - 1)]
    for loss in ("SFT", "RL"):
        rows = [r for r in result["rows"] if r["loss"] == loss and r["mode"] != "fp32"]
        for grp in (rows[0]["vs_fp32"]["groups"] if rows else {}):
            cells = []
            for mode in result["modes"][1:]:
                vals = [r["vs_fp32"]["groups"][grp] for r in rows if r["mode"] == mode]
                cells.append(f"{sum(1 - v['cos'] for v in vals) / len(vals):.1e} / "
                             f"{sum(v['adam_cos'] for v in vals) / len(vals):.3f}")
            lines.append(f"| {loss} | {grp} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="quickstart")
    ap.add_argument("--batches", type=int, default=3, help="batches of each kind (SFT, RL)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--autocast", action="store_true", help="run real bf16 autocast too where bf16 is slow")
    ap.add_argument("--quick", action="store_true", help="the tiny model, 2 small batches of each kind: a smoke test")
    ap.add_argument("--out", type=Path, help=f"results directory (default {RESULTS}; --quick: runs/precision_gradients_quick)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = ["model.name=tiny", "sft.batch_size=4", "rollout.n=2", "train.prompts_per_step=2",
                 "rollout.max_new_tokens=8"] if args.quick else []
    if args.quick:
        args.batches, args.autocast = 2, True
    modes = ["fp32", *EMULATED] + (["bf16-autocast"] if args.autocast or fast_bf16() else [])
    cfg = load_config(_resolve_config(args.config), overrides)
    out_dir = args.out or (quick_out("precision_gradients") if args.quick else RESULTS)
    prov = provenance("precision_gradients.py", f"{', '.join(modes)} (fp32 master weights)")
    torch.manual_seed(args.seed)
    model, tok = build_policy(cfg.model.name)
    model.train()  # as in training (the bundled models have no dropout: train() changes no numerics)
    train, _ = load_splits(cfg)
    objective = get_objective(cfg.algorithm.objective, **cfg.algorithm.hparams)
    g = torch.Generator().manual_seed(args.seed)
    sft_batches = [sft_batch(tok, [train[i] for i in torch.randint(len(train), (cfg.sft.batch_size,), generator=g).tolist()])
                   for _ in range(args.batches)]
    engine = HFGenerator(model, tok, cfg.rollout.max_prompt_tokens, torch.float32)
    sampling = Sampling(temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_new_tokens)
    rl_batches = []
    for b in range(args.batches):
        idx = torch.randint(len(train), (cfg.train.prompts_per_step,), generator=g).tolist()
        with torch.no_grad():
            rb = engine.generate([train[i].messages for i in idx], cfg.rollout.n, sampling)
        rl_batches.append((rb, torch.randn(rb.input_ids.shape[0], generator=g)))

    rows, noise = [], []  # noise: the fp32 gradients of consecutive batches against each other
    for kind, batches in (("SFT", sft_batches), ("RL", rl_batches)):
        for b, batch in enumerate(batches):
            mask = batch[2] if kind == "SFT" else batch[0].response_mask.float()
            grads_of = {}
            for mode in modes:
                fn = ((lambda: sft_backward(model, batch, mode)) if kind == "SFT" else
                      (lambda: rl_backward(model, batch, mode, objective, cfg.algorithm.agg, cfg.rollout.temperature)))
                grads_of[mode], lp, seconds = gradient(model, fn)
                if mode == "fp32":
                    ref_lp = lp
                    if b:
                        noise.append({"loss": kind, "batches": f"{b - 1} vs {b}", **compare(prev, grads_of[mode])["all"]})
                    prev = grads_of[mode]
                r = {"loss": kind, "batch": b, "mode": mode, "seconds": seconds, "tokens": int(mask.sum())}
                rows.append(r)
                if mode == "fp32":  # the reference: nothing to compare it with
                    print(f"{kind} batch {b} {mode:26s} {seconds:.1f}s", flush=True)
                    continue
                r.update(vs_fp32=compare(grads_of[mode], grads_of["fp32"]), logprob_err=logprob_error(lp, ref_lp, mask))
                print(f"{kind} batch {b} {mode:26s} cos {r['vs_fp32']['all']['cos']:.6f} rel.err "
                      f"{r['vs_fp32']['all']['rel_err']:.4f} logp err {r['logprob_err']['mean']:.4f} {seconds:.1f}s",
                      flush=True)
            if "bf16-autocast" in grads_of:  # the emulation against the real autocast
                for r in rows[-len(modes):]:
                    if r["mode"] in EMULATED:
                        r["vs_autocast"] = compare(grads_of[r["mode"]], grads_of["bf16-autocast"])["all"]
            del grads_of
    setup = (f"Model `{cfg.model.name}`, config `{args.config}`: SFT batches of {cfg.sft.batch_size} reference solutions; "
             f"RL batches of {cfg.train.prompts_per_step} prompts x {cfg.rollout.n} responses (<= "
             f"{cfg.rollout.max_new_tokens} tokens, sampled in fp32 at T = {cfg.rollout.temperature}), objective "
             f"`{cfg.algorithm.objective}` {cfg.algorithm.hparams}, random N(0,1) advantages, on-policy. Seed {args.seed}.")
    shapes = [(64, 32, 64)] if args.quick else [(1024, 576, 1536), (256, 49152, 576)]  # an MLP matmul; the LM head's grad
    matmul = [{"shape": f"[{m}, {k}] @ [{k}, {n}]", "fp32_s": matmul_seconds(m, k, n, torch.float32),
               "bf16_s": matmul_seconds(m, k, n, torch.bfloat16)} for m, k, n in shapes]
    result = {**prov, "setup": setup, "modes": modes, "rows": rows, "batch_noise": noise, "matmul": matmul}
    write_results(out_dir, "precision_gradients", result, report(result))


if __name__ == "__main__":
    main()
