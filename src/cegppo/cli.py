"""Command line: ``cegppo train | sft | eval | compare``. Every path ends in one line: bad input exits 2 with
``cegppo <command>: error: <message>`` (an unexpected error exits 1 the same way), Ctrl-C exits 130 with
``cegppo <command>: interrupted`` (``cegppo train: interrupted at step N; continue with --resume``); ``--debug``
re-raises instead, with the traceback."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from importlib import resources
from pathlib import Path

from cegppo.errors import describe_os_error
from cegppo.io import cache_root, create_new_file, one_line

log = logging.getLogger("cegppo")


class UsageError(ValueError):
    """A bad command-line argument (one line, exit 2)."""


def example_config(name: str) -> Path:
    """A config bundled with the package (``examples/<name>.yaml``)."""
    path = Path(str(resources.files("cegppo") / "examples" / f"{name}.yaml"))
    if not path.is_file():
        raise FileNotFoundError(f"no bundled example config {name!r}")
    return path


def _resolve_config(arg: str | None) -> Path:
    if arg is None:
        return example_config("quickstart")
    p = Path(arg)
    if p.exists() or arg.endswith((".yaml", ".yml")):
        return p
    return example_config(arg)  # a bundled name: quickstart, tiny, paper_1p5b, paper_7b


def _existing(pairs: list[tuple[str, str | None]]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in pairs if v and os.path.lexists(os.path.expanduser(v))]


def _config_paths(cfg) -> list[tuple[str, str]]:
    """The settings that name paths, for an OS error's message (the file it concerns belongs to one of them)."""
    return [("output_dir", cfg.output_dir), ("$CEGPPO_CACHE", str(cache_root())),
            *_existing([("model.name", cfg.model.name), ("data.train_path", cfg.data.train_path),
                        ("data.test_path", cfg.data.test_path)])]


def cmd_train(args) -> int:
    from cegppo.config import load_config
    from cegppo.recipes import run_training

    if args.accept_data_change and not args.resume:
        raise UsageError("--accept-data-change applies to --resume (a fresh run fingerprints the data it starts on)")
    cfg = load_config(_resolve_config(args.config), args.overrides)
    args.paths = _config_paths(cfg)
    summary = run_training(cfg, resume=args.resume, overwrite=args.overwrite, accept_data_change=args.accept_data_change)
    print(json.dumps(summary, indent=2))
    print(f"run directory: {cfg.output_dir} (metrics.jsonl, eval.jsonl, training_curves.png, checkpoints/)")
    return 0


def cmd_sft(args) -> int:
    from cegppo.config import load_config
    from cegppo.recipes import run_sft

    cfg = load_config(_resolve_config(args.config), args.overrides)
    args.paths = [("--out", args.out), *_config_paths(cfg)[1:]]
    steps = cfg.sft.steps or 40
    losses = run_sft(cfg, Path(args.out), steps)
    print(f"SFT {steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}; saved to {args.out}")
    return 0


def eval_outputs(out: str) -> tuple[Path, Path]:
    """``cegppo eval --out``: the per-problem JSONL and the summary JSON beside it."""
    if out.endswith(("/", os.sep)):
        raise UsageError(f"--out {out} names a directory; give the path of a new .jsonl file")
    path = Path(out)
    return path, path.with_suffix(".summary.json")


def cmd_eval(args) -> int:
    from contextlib import nullcontext

    from cegppo.recipes import EvalRequest, check_eval_request, new_outputs
    from cegppo.engine.rollout import Sampling

    args.paths = [*(("--out", str(p)) for p in (eval_outputs(args.out) if args.out else ())),
                  ("$CEGPPO_CACHE", str(cache_root())),
                  *_existing([("--model", args.model), *(("--data", d) for d in args.data)])]
    temperature, top_p = (0.0, 1.0) if args.greedy else (args.temperature, args.top_p)
    req = EvalRequest(args.model, args.data, args.k, Sampling(temperature, top_p, 0, args.max_new_tokens),
                      args.num_problems, args.difficulty, args.reward, args.dtype, args.max_prompt_tokens,
                      args.batch_prompts, args.seed, args.device)
    check_eval_request(req)
    # before the evaluation: never overwrite a file (an input in particular); claimed until written, so a second
    # command with the same --out is refused rather than mixed with this one
    inputs = {**{f"--data {d}": d for d in args.data}, "--model": args.model}
    outputs = list(eval_outputs(args.out)) if args.out else []
    with new_outputs(outputs, "--out", directory=False, inputs=inputs) if outputs else nullcontext():
        return _evaluate(args, req, outputs)


def _evaluate(args, req, outputs: list[Path]) -> int:
    from cegppo.recipes import run_eval

    s = req.sampling
    how = "greedy" if s.temperature == 0 else f"sampling at temperature {s.temperature:g}, top-p {s.top_p:g}"
    log.info("cegppo eval: k=%d, %s, up to %d new tokens", args.k, how, args.max_new_tokens)
    result = run_eval(req)
    k = args.k
    print(f"| data source | problems | avg@{k} | pass@{k} | maj@{k} | scorer failures (timed out) |\n"
          f"|---|---|---|---|---|---|")
    for src, s in result.summary.items():
        print(f"| {src} | {s['num_problems']} | {s['avg@k']:.4f} | {s['pass@k']:.4f} | {s['maj@k']:.4f} "
              f"| {s['scorer_failures']} of {s['graded']} ({s['scorer_timeouts']}) |")
    if outputs:
        out, summary = outputs
        create_new_file(out, "".join(json.dumps(r) + "\n" for r in result.rows).encode())
        create_new_file(summary, (json.dumps(result.summary, indent=2) + "\n").encode())
        print(f"per-problem results: {out}")
    note = result.failure_note()
    if note:
        log.warning("cegppo eval: %s", note)
    result.check_scorer(f"--reward {args.reward}")  # every item failed: say so, exit 2
    return 0


def cmd_compare(args) -> int:
    from cegppo.reporting.compare import compare_runs

    out = Path(args.out)
    args.paths = [("--out", args.out), *(("run", r) for r in args.runs)]
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is an existing file; give a directory (it will hold compare.png, one PNG "
                         f"per metric and summary.md)")
    paths = compare_runs([Path(r) for r in args.runs], out)  # checks out against the runs and its own files first
    for p in paths:
        print(p)
    return 0


BUNDLED_CONFIGS = ("quickstart", "tiny", "paper_1p5b", "paper_7b")


def _catalogue() -> str:
    """What can be named on the command line: bundled configs, built-in tasks, bundled eval sets."""
    from cegppo.data.evalsets import EVAL_SETS
    from cegppo.data.tasks import TASKS

    sets = ", ".join(f"{name} ({s.data_source})" for name, s in EVAL_SETS.items())
    return (f"bundled configs: {', '.join(BUNDLED_CONFIGS)}; built-in tasks: {', '.join(sorted(TASKS))}; "
            f"bundled eval sets: {sets}")


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = argparse.ArgumentParser(
        prog="cegppo", formatter_class=fmt,
        description="CE-GPPO RL fine-tuning on verifiable rewards. `cegppo train` runs the quickstart (CE-GPPO on "
                    "the bundled SmolLM2-135M-Instruct: about 29 minutes on a 2-core AVX2 CPU in fp32, alone on the machine).",
        epilog=_catalogue())
    p.add_argument("--debug", action="store_true", help="show the traceback of an error or interrupt")
    sub = p.add_subparsers(dest="command", metavar="{train,sft,eval,compare}")

    t = sub.add_parser("train", formatter_class=fmt, epilog=_catalogue(),
                       help="RL training (no config: the quickstart on the bundled SmolLM2-135M)")
    t.add_argument("config", nargs="?", default="quickstart", help="YAML file or bundled config name")
    t.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. algorithm.hparams.beta1=0.5 "
                                                "(every key: src/cegppo/config/schema.py)")
    t.add_argument("--resume", action="store_true", help="continue from the newest intact checkpoint in output_dir")
    t.add_argument("--overwrite", action="store_true",
                   help="delete the previous run's files in output_dir (logged) and start a fresh run there")
    t.add_argument("--accept-data-change", action="store_true",
                   help="with --resume: continue although a data file's contents changed since the run started "
                        "(recorded in run.json); without it such a resume is refused")
    t.set_defaults(fn=cmd_train)

    s = sub.add_parser("sft", formatter_class=fmt, epilog=_catalogue(),
                       help="supervised warm-start on a task's reference solutions")
    s.add_argument("config", nargs="?", default="quickstart", help="YAML file or bundled config name (its model, "
                                                                    "data and sft sections)")
    s.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. sft.steps=40")
    s.add_argument("--out", required=True, help="output model directory")
    s.set_defaults(fn=cmd_sft)

    e = sub.add_parser(
        "eval", formatter_class=fmt, epilog=_catalogue(),
        help="avg@k / pass@k / maj@k of a model on datasets, bundled eval sets or built-in tasks",
        description="Sample k responses per problem and grade them. Sampling defaults are the paper's evaluation "
                    "(temperature 0.6, top-p 0.95); the held-out evaluation inside `cegppo train` is greedy "
                    "(eval.temperature 0): pass --greedy to match it.")
    e.add_argument("--model", required=True, help="preset (smollm2-135m-instruct, tiny), model or checkpoint "
                                                  "directory, or hub name")
    e.add_argument("--data", nargs="+", required=True,
                   help="dataset files (.jsonl/.json/.parquet), bundled eval sets or built-in task names")
    e.add_argument("--k", type=int, default=1, help="samples per problem (avg@k, pass@k, maj@k)")
    e.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (0 = greedy)")
    e.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling threshold")
    e.add_argument("--greedy", action="store_true", help="greedy decoding (temperature 0; with --k 1), as the in-training evaluation")
    e.add_argument("--max-new-tokens", type=int, default=256, help="response token budget")
    e.add_argument("--max-prompt-tokens", type=int, default=1024, help="prompt token budget (must keep the question)")
    e.add_argument("--num-problems", type=int, default=0, help="problems per dataset (0 = all)")
    e.add_argument("--difficulty", type=int, default=1, help="built-in task difficulty, 1-5")
    e.add_argument("--reward", default="math-strict", help="math-strict, math-lenient or module:function")
    e.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="generation dtype; auto: bfloat16 where bf16 is fast (GPU, CPU with native bf16)")
    e.add_argument("--batch-prompts", type=int, default=16, help="prompts generated together")
    e.add_argument("--device", default="auto", help="auto (the GPU when torch sees one, else the CPU), cpu, cuda or cuda:N")
    e.add_argument("--seed", type=int, default=0, help="sampling seed (and built-in task split seed)")
    e.add_argument("--out", help="per-problem results JSONL (and a .summary.json beside it)")
    e.set_defaults(fn=cmd_eval)

    c = sub.add_parser("compare", formatter_class=fmt, help="plots and a summary table comparing run directories")
    c.add_argument("runs", nargs="+", help="run directories (output_dir of cegppo train)")
    c.add_argument("--out", required=True, help="output directory: compare.png, one PNG per metric, summary.md")
    c.set_defaults(fn=cmd_compare)
    for sp in (t, s, e, c):  # `cegppo train --debug ...` as well as `cegppo --debug train ...`
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `cegppo`: help, not the quickstart's run (that is `cegppo train`)
        parser.print_help()
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from cegppo.reporting.progress import quiet_third_party_bars

    quiet_third_party_bars()  # our own bars name every phase; transformers' would break into them
    try:
        return args.fn(args)
    except KeyboardInterrupt as e:
        if args.debug:
            raise
        if args.command == "train":
            step = getattr(e, "step", None)
            where = f" at step {step}" if step is not None else ""
            print(f"cegppo train: interrupted{where}; continue with --resume", file=sys.stderr)
        else:
            print(f"cegppo {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - always one line, whatever the exception's own formatting
        if args.debug:
            raise
        if isinstance(e, OSError) and e.filename is not None:  # the file, why, and the setting it came from
            print(f"cegppo {args.command}: error: {describe_os_error(e, getattr(args, 'paths', []))}", file=sys.stderr)
            return 2
        if isinstance(e, _bad_input_errors()):
            print(f"cegppo {args.command}: error: {one_line(e, limit=10_000)}", file=sys.stderr)
            return 2
        print(f"cegppo {args.command}: error: {type(e).__name__}: {one_line(e, limit=10_000)} "
              f"(unexpected; rerun with --debug for the traceback)", file=sys.stderr)
        return 1


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    from cegppo.config import ConfigError
    from cegppo.data.problems import DatasetError
    from cegppo.engine.checkpoint import CheckpointError
    from cegppo.engine.models import ModelLoadError
    from cegppo.engine.rundir import TrainingError
    from cegppo.engine.runlock import RunLockedError

    # ValueError and OSError cover the rest of what a user can get wrong (an unknown task name, a path that is
    # missing, a file that cannot be read or written)
    return (ConfigError, DatasetError, ModelLoadError, TrainingError, CheckpointError, RunLockedError, UsageError,
            ValueError, OSError)


if __name__ == "__main__":
    sys.exit(main())
