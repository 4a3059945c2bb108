"""Command line: ``cegppo train | sft | eval | compare``. Every path ends in one line: bad input exits 2 with
``cegppo <command>: error: <message>`` (an unexpected error exits 1 the same way), Ctrl-C exits 130 with
``cegppo <command>: interrupted`` (``cegppo train: interrupted at step N; continue with --resume``); ``--debug``
re-raises instead, with the traceback."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from importlib import resources
from pathlib import Path

from cegppo.io import atomic_write_text, one_line

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


def cmd_train(args) -> int:
    from cegppo.config import load_config
    from cegppo.engine.recipes import run_training

    cfg = load_config(_resolve_config(args.config), args.overrides)
    summary = run_training(cfg, resume=args.resume, overwrite=args.overwrite)
    print(json.dumps(summary, indent=2))
    print(f"run directory: {cfg.output_dir} (metrics.jsonl, eval.jsonl, training_curves.png, checkpoints/)")
    return 0


def cmd_sft(args) -> int:
    from cegppo.config import load_config
    from cegppo.engine.recipes import run_sft

    cfg = load_config(_resolve_config(args.config), args.overrides)
    steps = cfg.sft.steps or 40
    losses = run_sft(cfg, Path(args.out), steps)
    print(f"SFT {steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}; saved to {args.out}")
    return 0


def cmd_eval(args) -> int:
    from cegppo.engine.recipes import EvalRequest, run_eval
    from cegppo.engine.rollout import Sampling

    req = EvalRequest(args.model, args.data, args.k, Sampling(args.temperature, args.top_p, 0, args.max_new_tokens),
                      args.num_problems, args.difficulty, args.reward, args.dtype, args.max_prompt_tokens,
                      args.batch_prompts, args.seed)
    result = run_eval(req)
    print(f"| data source | problems | avg@{args.k} | pass@{args.k} | maj@{args.k} |\n|---|---|---|---|---|")
    for src, s in result.summary.items():
        print(f"| {src} | {s['num_problems']} | {s['avg@k']:.4f} | {s['pass@k']:.4f} | {s['maj@k']:.4f} |")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, "".join(json.dumps(r) + "\n" for r in result.rows))
        atomic_write_text(out.with_suffix(".summary.json"), json.dumps(result.summary, indent=2))
        print(f"per-problem results: {out}")
    return 0


def cmd_compare(args) -> int:
    from cegppo.reporting.compare import compare_runs

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is an existing file; give a directory (it will hold compare.png, one PNG "
                         f"per metric and summary.md)")
    paths = compare_runs([Path(r) for r in args.runs], out)
    for p in paths:
        print(p)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cegppo", description="CE-GPPO RL fine-tuning on verifiable rewards")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error or interrupt")
    sub = p.add_subparsers(dest="command")

    t = sub.add_parser("train", help="RL training (default: the quickstart on the bundled SmolLM2-135M)")
    t.add_argument("config", nargs="?", help="YAML file or bundled name (quickstart, tiny, paper_1p5b, paper_7b)")
    t.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. algorithm.hparams.beta1=0.5")
    t.add_argument("--resume", action="store_true", help="continue from the newest intact checkpoint in output_dir")
    t.add_argument("--overwrite", action="store_true",
                   help="delete the previous run's files in output_dir (logged) and start a fresh run there")
    t.set_defaults(fn=cmd_train)

    s = sub.add_parser("sft", help="supervised warm-start on a task's reference solutions")
    s.add_argument("config", nargs="?")
    s.add_argument("overrides", nargs="*")
    s.add_argument("--out", required=True, help="output model directory")
    s.set_defaults(fn=cmd_sft)

    e = sub.add_parser("eval", help="avg@k / pass@k / maj@k of a model on datasets or built-in tasks")
    e.add_argument("--model", required=True, help="preset, local directory or hub name")
    e.add_argument("--data", nargs="+", required=True, help="dataset files (.jsonl/.json/.parquet) or task names")
    e.add_argument("--k", type=int, default=1)
    e.add_argument("--temperature", type=float, default=0.6)
    e.add_argument("--top-p", type=float, default=0.95)
    e.add_argument("--max-new-tokens", type=int, default=256)
    e.add_argument("--max-prompt-tokens", type=int, default=1024)
    e.add_argument("--num-problems", type=int, default=0, help="limit (0 = all)")
    e.add_argument("--difficulty", type=int, default=1)
    e.add_argument("--reward", default="math-strict")
    e.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    e.add_argument("--batch-prompts", type=int, default=16)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--out", help="per-problem results JSONL")
    e.set_defaults(fn=cmd_eval)

    c = sub.add_parser("compare", help="plots and a summary table comparing run directories")
    c.add_argument("runs", nargs="+")
    c.add_argument("--out", required=True)
    c.set_defaults(fn=cmd_compare)
    for sp in (t, s, e, c):  # `cegppo train --debug ...` as well as `cegppo --debug train ...`
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.command is None:  # `cegppo` alone runs the quickstart too
        args = build_parser().parse_args((["--debug"] if args.debug else []) + ["train"])
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

    # ValueError and OSError cover the rest of what a user can get wrong (an unknown task name, a path that is
    # missing, a file that cannot be read or written)
    return (ConfigError, DatasetError, ModelLoadError, TrainingError, CheckpointError, UsageError, ValueError, OSError)


if __name__ == "__main__":
    sys.exit(main())
