"""Accuracy of a base model on the built-in arithmetic test split, strict vs lenient grading.

    python benchmarks/base_accuracy.py                       # SmolLM2-135M-Instruct, d1, 64 problems, greedy
    python benchmarks/base_accuracy.py --temperature 1.0     # one T=1 sample per problem
    python benchmarks/base_accuracy.py --quick               # smoke test: the tiny model, 4 problems, into runs/

Writes ``base_accuracy.{json,md}`` to ``--out`` (default benchmarks/results; ``--quick``: runs/base_accuracy_quick)
with the commit, the command, the date and the machine.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from cegppo.engine.models import load_model, preset_path
from cegppo.data.rewards import last_boxed, load_reward
from cegppo.data.problems import Problem
from cegppo.data.tasks import INSTRUCTION, make_task
from cegppo.io import atomic_write_json, atomic_write_text

from common import RESULTS, provenance, provenance_line, quick_out, settings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--difficulty", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--instruction", default=None,
                    help="replace the task's instruction sentence (to compare prompt wordings)")
    ap.add_argument("--show", type=int, default=3, help="print this many completions")
    ap.add_argument("--quick", action="store_true", help="the tiny model, 4 problems, 16 new tokens: a smoke test")
    ap.add_argument("--out", type=Path, help=f"results directory (default {RESULTS}; --quick: runs/base_accuracy_quick)")
    args = ap.parse_args()
    if args.quick:  # the locally built character-level model: checks the pipeline, measures nothing
        args.model, args.n, args.max_new_tokens, args.batch_size, args.dtype = "tiny", 4, 16, 4, "float32"
    out_dir = args.out or (quick_out("base_accuracy") if args.quick else RESULTS)
    prov = provenance("base_accuracy.py", "bf16" if args.dtype == "bfloat16" else "fp32")

    t0 = time.perf_counter()
    if args.model in ("smollm2-135m-instruct", "tiny"):
        preset_path(args.model)
    t_prep = time.perf_counter() - t0
    t0 = time.perf_counter()
    model, tok = load_model(args.model, dtype=args.dtype)
    model.eval()
    t_load = time.perf_counter() - t0

    problems = make_task("arithmetic", "test", args.n, seed=args.seed, difficulty=args.difficulty)
    if args.instruction is not None:
        problems = [Problem(id=p.id, messages=[{"role": "user", "content": p.prompt_text.replace(
            INSTRUCTION, args.instruction)}], answer=p.answer, solution=p.solution, data_source=p.data_source)
            for p in problems]
    torch.manual_seed(args.seed)
    completions: list[str] = []
    n_tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(problems), args.batch_size):
        batch = problems[i:i + args.batch_size]
        texts = [tok.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=True) for p in batch]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        gen = dict(max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id)
        if args.temperature > 0:
            gen.update(do_sample=True, temperature=args.temperature, top_p=1.0, top_k=0)
        else:
            gen.update(do_sample=False)
        with torch.no_grad():
            out = model.generate(**enc, **gen)
        new = out[:, enc["input_ids"].shape[1]:]
        n_tokens += int((new != tok.pad_token_id).sum())
        completions += tok.batch_decode(new, skip_special_tokens=True)
    t_gen = time.perf_counter() - t0

    answers = [p.answer for p in problems]
    strict = load_reward("math-strict")(completions, answers)
    lenient = load_reward("math-lenient")(completions, answers)
    boxed = sum(last_boxed(c) is not None for c in completions)
    nonempty_box = sum(bool((last_boxed(c) or "").strip()) for c in completions)
    literal_n = sum((last_boxed(c) or "").strip() == "N" for c in completions)

    mode = f"T={args.temperature}" if args.temperature > 0 else "greedy"
    print(f"model={args.model} dtype={args.dtype} task=arithmetic/test d{args.difficulty} n={len(problems)} "
          f"{mode} max_new_tokens={args.max_new_tokens} seed={args.seed}")
    print(f"preset materialise {t_prep:.2f}s  load {t_load:.2f}s  generate {t_gen:.1f}s "
          f"({n_tokens} tokens, {n_tokens / t_gen:.0f} tok/s)")
    print(f"strict accuracy  {sum(strict.correct)}/{len(problems)} = {strict.accuracy:.1%}  (failures {strict.failures})")
    print(f"lenient accuracy {sum(lenient.correct)}/{len(problems)} = {lenient.accuracy:.1%}  (failures {lenient.failures})")
    print(f"completions with a \\boxed{{}}: {boxed}/{len(problems)}; non-empty box: {nonempty_box}/{len(problems)}; "
          f"literal \\boxed{{N}}: {literal_n}/{len(problems)}")
    for p, c, s, l in list(zip(problems, completions, strict.correct, lenient.correct))[:args.show]:
        print(f"--- gold={p.answer} strict={s} lenient={l}\n{p.prompt_text}\n>>> {c!r}")

    result = {**prov, "settings": settings(args),
              "problems": len(problems), "strict_accuracy": strict.accuracy, "lenient_accuracy": lenient.accuracy,
              "strict_failures": strict.failures, "lenient_failures": lenient.failures, "boxed": boxed,
              "nonempty_box": nonempty_box, "literal_N_box": literal_n, "generated_tokens": n_tokens,
              "generate_s": t_gen, "load_s": t_load,
              "samples": [{"id": p.id, "answer": p.answer, "completion": c, "strict": s, "lenient": l}
                          for p, c, s, l in list(zip(problems, completions, strict.correct, lenient.correct))[:args.show]]}
    md = ["# Base-model accuracy on the arithmetic task", "",
          f"Generated by `{prov['command']}`. Do not edit by hand.", "", provenance_line(result), "",
          f"{args.model} in {args.dtype}, arithmetic/test difficulty {args.difficulty}, {len(problems)} problems, {mode}, "
          f"<= {args.max_new_tokens} new tokens, seed {args.seed}"
          + (" (`--quick`: a smoke test, the numbers mean nothing)" if args.quick else "") + ".", "",
          "| grading | accuracy | failures |", "|---|---|---|",
          f"| strict (math-strict) | {strict.accuracy:.3f} | {strict.failures} |",
          f"| lenient (math-lenient) | {lenient.accuracy:.3f} | {lenient.failures} |", "",
          f"Completions with a `\\boxed{{}}`: {boxed}/{len(problems)}; non-empty: {nonempty_box}; literal "
          f"`\\boxed{{N}}`: {literal_n}. Generation {n_tokens} tokens in {t_gen:.1f} s.", ""]
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "base_accuracy.json", result)
    atomic_write_text(out_dir / "base_accuracy.md", "\n".join(md))
    print(f"wrote {out_dir / 'base_accuracy.json'} and {out_dir / 'base_accuracy.md'}")


if __name__ == "__main__":
    main()
