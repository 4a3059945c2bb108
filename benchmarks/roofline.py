"""Each phase of one RL step against this machine's limits (issue 25, item 1): how far is it from what the hardware
allows?

    python benchmarks/roofline.py --step benchmarks/results/step_throughput.json   # phases measured on THIS machine
    python benchmarks/roofline.py                 # runs step_throughput.py first (1 round, 2 timed steps; ~10 min)
    python benchmarks/roofline.py --quick         # tiny model: checks the pipeline, measures nothing

Limits, measured here in the precision the step ran in (torch's default threads):

- **compute**: the best FLOP/s of a large square matmul (2048^3), and of the decode-shaped one (the batch's rows x
  the MLP's up-projection), which is what generation can reach at best;
- **memory**: the best bytes/s of a streaming copy of 256 MiB (read + write).

The work of each phase, from the model's shape (the config's hidden size, layers, heads, vocabulary) and the step's
recorded sizes (sequences, mean prompt and response length, the decode steps of the longest response):

- **generation** (HF ``generate``): a prefill of each distinct prompt, once (its n samples need its keys and values,
  not n computations of them: cegppo's engine shares it, TRL's ``generate`` on the n copies does not), then one
  decode step per generated position, each reading every weight once and the KV cache so far, and doing
  2 x params FLOPs per sequence. Its limit is, per decode step, the larger of bytes / bandwidth and FLOPs /
  decode-shaped peak;
- **old log-probs**: one forward over prompt + response (LM head on response tokens only): FLOPs / peak. cegppo's
  trainer takes the first mini-batch's old log-probs from its own loss pass (it is still on-policy), so its separate
  pass covers only the other mini-batches' rows (``1 - 1 / mini_batches`` of them); TRL's covers every row;
- **update**: forward + backward = 3 x the forward, plus one more forward of the body when gradient checkpointing
  recomputes it (cegppo with ``model.gradient_checkpointing=true``; TRL by default): FLOPs / peak.

Share of the limit = the time the limit allows / the time measured (1 = at the limit). Useful work only: padding,
sampling, the optimizer and Python are what separates the two. Writes ``roofline.{json,md}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import RESULTS, ROOT, in_checkout, provenance, provenance_line, quick_out, write_results
from common.measure import problems_in_order

PHASES = ("generate", "old_logp", "update")


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def machine_limits(dtype_name: str, decode_rows: int, hidden: int, inter: int, quick: bool) -> dict:
    """Peak matmul FLOP/s (square, and decode-shaped) and streaming-copy bytes/s, best of several repeats."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    n = 512 if quick else 2048
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    square = 2 * n ** 3 / best_time(lambda: torch.mm(a, b), 3 if quick else 10)
    x, w = torch.randn(decode_rows, hidden, dtype=dtype), torch.randn(hidden, inter, dtype=dtype)
    decode = 2 * decode_rows * hidden * inter / best_time(lambda: torch.mm(x, w), 20 if quick else 200)
    size = (16 if quick else 256) * 2 ** 20 // 4
    src, dst = torch.randn(size), torch.empty(size)
    stream = 2 * size * 4 / best_time(lambda: dst.copy_(src), 5 if quick else 20)
    return dict(dtype=dtype_name, matmul_flops=square, matmul_n=n, decode_matmul_flops=decode,
                decode_shape=[decode_rows, hidden, inter], stream_bytes_s=stream, stream_mib=size * 4 / 2 ** 20)


def model_shape(model: str) -> dict:
    """Parameter counts and attention sizes from the model's config (no weights loaded)."""
    from transformers import AutoConfig

    from cegppo.engine.models import preset_path

    c = AutoConfig.from_pretrained(preset_path(model))
    h, layers, inter, vocab = c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size
    head_dim = getattr(c, "head_dim", None) or h // c.num_attention_heads
    kv = c.num_key_value_heads * head_dim
    body = layers * (2 * h * h + 2 * h * kv + 3 * h * inter)  # q, o; k, v; gate, up, down (norms are negligible)
    return dict(hidden=h, layers=layers, intermediate=inter, vocab=vocab, kv_dim=kv, q_dim=c.num_attention_heads * head_dim,
                body_params=body, head_params=vocab * h, tied=bool(getattr(c, "tie_word_embeddings", False)))


def mean_prompt_tokens(model: str, s: dict) -> float:
    """The mean chat-templated prompt length of the problems the step trained on."""
    from transformers import AutoTokenizer

    from cegppo.engine.models import preset_path

    tok = AutoTokenizer.from_pretrained(preset_path(model))
    lengths = [len(tok.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True, return_dict=True)
                   ["input_ids"]) for p in problems_in_order(s)]
    return statistics.fmean(lengths)


def forward_flops(m: dict, seqs: float, prompt: float, response: float, head_tokens: float) -> float:
    """Matmul FLOPs of one forward over ``seqs`` sequences of prompt + response tokens, the LM head on
    ``head_tokens`` of them in all, causal attention (QK^T and AV: 4 x q_dim x the tokens before each token)."""
    tokens = seqs * (prompt + response)
    attention = 4 * m["layers"] * m["q_dim"] * seqs * (prompt + response) ** 2 / 2
    return 2 * m["body_params"] * tokens + 2 * m["head_params"] * head_tokens + attention


def analyse(step: dict, s: dict, m: dict, limits: dict, prompt: float, checkpointing: bool,
            old_logp_rows: float) -> dict:
    """Per phase: work, time at the limit, measured time, share. ``step``: the mean of a system's timed steps;
    ``old_logp_rows``: the share of the rows the old-log-prob pass covers."""
    seqs, resp = s["prompts"] * s["n"], step["mean_response_length"]
    decode_steps = step.get("decode_steps") or s["max_new_tokens"]  # older results: the bound
    bytes_per = 2 if limits["dtype"] == "bf16" else 4
    weights = (m["body_params"] + m["head_params"]) * bytes_per
    mem_time = compute_time = gen_time = gen_flops = gen_bytes = 0.0
    for t in range(int(decode_steps)):  # each decode step: every weight once, the KV cache so far, 2 x params / seq
        kv = 2 * m["layers"] * m["kv_dim"] * bytes_per * seqs * (prompt + t)
        flops = seqs * (2 * (m["body_params"] + m["head_params"]) + 4 * m["layers"] * m["q_dim"] * (prompt + t))
        mem, compute = (weights + kv) / limits["stream_bytes_s"], flops / limits["decode_matmul_flops"]
        gen_time, mem_time, compute_time = gen_time + max(mem, compute), mem_time + mem, compute_time + compute
        gen_flops, gen_bytes = gen_flops + flops, gen_bytes + weights + kv
    prefill = forward_flops(m, s["prompts"], prompt, 0, s["prompts"])  # once per distinct prompt
    gen_time += prefill / limits["matmul_flops"]
    fwd = forward_flops(m, seqs, prompt, resp, seqs * resp)
    recompute = forward_flops(m, seqs, prompt, resp, 0) if checkpointing else 0.0  # the body again, not the head
    upd = 3 * fwd + recompute
    rows = {
        "generate": dict(measured_s=step["generate_s"], limit_s=gen_time, gflop=(gen_flops + prefill) / 1e9,
                         gbyte=gen_bytes / 1e9, decode_steps=decode_steps, memory_s=mem_time, compute_s=compute_time,
                         bound="memory" if mem_time > compute_time else "compute"),
        "old_logp": dict(measured_s=step["old_logp_s"], limit_s=old_logp_rows * fwd / limits["matmul_flops"],
                         gflop=old_logp_rows * fwd / 1e9, rows=old_logp_rows, bound="compute"),
        "update": dict(measured_s=step["update_s"], limit_s=upd / limits["matmul_flops"], gflop=upd / 1e9,
                       bound="compute", recomputed=checkpointing),
    }
    for r in rows.values():
        r["share"] = r["limit_s"] / r["measured_s"] if r["measured_s"] > 0 else float("nan")
        r["achieved_gflop_s"] = r["gflop"] / r["measured_s"] if r["measured_s"] > 0 else float("nan")
    rows["generate"]["achieved_gbyte_s"] = rows["generate"]["gbyte"] / step["generate_s"]
    return rows


def old_logp_rows(system: dict, s: dict) -> float:
    """cegppo's first mini-batch takes its old log-probs from its loss pass (one epoch, no entropy controller)."""
    return 1.0 - 1.0 / s["mini_batches"] if system["kind"] == "cegppo" else 1.0


def checkpointed(system: dict) -> bool:
    """TRL checkpoints by default (GRPOConfig); cegppo only with the override."""
    return system["kind"] == "trl" or "model.gradient_checkpointing=true" in system.get("overrides", [])


def report(result: dict) -> str:
    lim = result["limits"]
    lines = ["# Each phase of one RL step against this machine's limits", "",
             f"Generated by `{result['command']}`. Do not edit by hand; `--from-json` regenerates it.", "",
             provenance_line(result), "",
             f"Phases from `{result['step_file']}` (made at `{result['step_commit']}` on {result['step_cpu']}), "
             f"{result['settings']['prompts']} x {result['settings']['n']} sequences, mean prompt "
             f"{result['prompt_tokens']:.1f} tokens.", "",
             f"Limits ({lim['dtype']}): matmul {lim['matmul_flops'] / 1e9:.3g} GFLOP/s ({lim['matmul_n']}^3), "
             f"decode-shaped matmul {lim['decode_matmul_flops'] / 1e9:.3g} GFLOP/s "
             f"({' x '.join(map(str, lim['decode_shape']))}), streaming copy {lim['stream_bytes_s'] / 1e9:.3g} GB/s "
             f"({lim['stream_mib']:.0f} MiB, read + write).", "",
             "| system | phase | measured | at the limit | share of the limit | work | achieved | bound |",
             "|---|---|---|---|---|---|---|---|"]
    for system, rows in result["phases"].items():
        for phase in PHASES:
            r = rows[phase]
            work = f"{r['gflop']:.3g} GFLOP" + (f", {r['gbyte']:.3g} GB" if "gbyte" in r else "")
            got = f"{r['achieved_gflop_s']:.3g} GFLOP/s" + (f", {r['achieved_gbyte_s']:.3g} GB/s"
                                                            if "achieved_gbyte_s" in r else "")
            lines.append(f"| {system} | {phase} | {r['measured_s']:.1f} s | {r['limit_s']:.1f} s | {r['share']:.0%} | "
                         f"{work} | {got} | {r['bound']}{' (recomputed)' if r.get('recomputed') else ''} |")
    far = {system: min(PHASES, key=lambda p: rows[p]["share"]) for system, rows in result["phases"].items()}
    lines += ["", "Furthest from its limit: " + "; ".join(f"{k}: {v} ({result['phases'][k][v]['share']:.0%})"
                                                          for k, v in far.items()) + ".", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step", type=Path, help="a step_throughput.json made on this machine (default: run one)")
    ap.add_argument("--quick", action="store_true", help="tiny model: a smoke test, not a result")
    ap.add_argument("--out", type=Path, help=f"results directory (default {RESULTS}; --quick: runs/roofline_quick)")
    ap.add_argument("--from-json", type=Path, help="regenerate the report from a saved result")
    args = ap.parse_args()
    if args.from_json:
        result = json.loads(args.from_json.read_text())
        return write_results(args.out or args.from_json.parent, "roofline", result, report(result))
    from cegppo.engine.provenance import machine

    out = args.out or (quick_out("roofline") if args.quick else RESULTS)
    step_file = args.step
    if step_file is None:  # measure the phases now: one round, both systems, checkpointing for both
        step_out = out / "roofline_step"
        rel = in_checkout(step_out)  # a command other clones can run
        cmd = [sys.executable, str(ROOT / "benchmarks" / "step_throughput.py"), "--out", str(rel)]
        cmd += ["--quick"] if args.quick else ["--rounds", "1", "--steps", "2", "--variant",
                                               "ckpt=model.gradient_checkpointing=true"]
        subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)
        step_file = step_out / "step_throughput.json"
    step = json.loads(step_file.read_text())
    here, there = machine(), step.get("machine") or {}
    if not args.quick and (there.get("cpu"), there.get("isa")) != (here["cpu"], here["isa"]):
        sys.exit(f"{step_file} was measured on {there.get('cpu')} ({there.get('isa')}), this machine is "
                 f"{here['cpu']} ({here['isa']}): the limits must be the same machine's")
    s = step["settings"]
    m = model_shape(s["model"])
    limits = machine_limits("bf16" if s.get("bf16") else "fp32", s["prompts"] * s["n"], m["hidden"],
                            m["intermediate"], args.quick)
    prompt = mean_prompt_tokens(s["model"], s)
    systems = {x["label"]: x for x in step["systems"]}
    phases = {}
    for label, summ in step["summary"].items():
        phases[label] = analyse(summ, s, m, limits, prompt, checkpointed(systems[label]),
                                old_logp_rows(systems[label], s))
    result = dict(**provenance("roofline.py", limits["dtype"]), limits=limits, model=m, prompt_tokens=prompt,
                  settings=s, step_file=str(in_checkout(step_file)),
                  step_commit=step.get("commit"), step_cpu=f"{there.get('cpu')} ({there.get('isa')})", phases=phases)
    write_results(out, "roofline", result, report(result))


if __name__ == "__main__":
    main()
