"""The run directory (``output_dir``) and everything written into it as a run goes: the resolved config, one
metrics row per step (``metrics.jsonl``, plus TensorBoard / wandb when enabled), held-out evaluations
(``eval.jsonl``), ``summary.json`` and the checkpoints; and the rules of a run's life (docs/runs.md): one writer
at a time (the lock of :mod:`cegppo.engine.runlock`), no fresh run spliced into an old one's files, and the
resume contract (which config keys may change on ``--resume``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import uuid
from datetime import datetime, timezone
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from cegppo.config import Config, save_config
from cegppo.engine import checkpoint as ckpt
from cegppo.engine.runlock import RunLock, RunLockedError
from cegppo.io import append_jsonl, atomic_write_json, atomic_write_text, read_jsonl

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    pass


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a training run, with the last completed step (``cegppo train`` prints it)."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step


# The files a run writes into its directory. A fresh run into a directory holding any of them is refused
# (``--resume`` continues that run, ``--overwrite`` removes exactly these and starts over); anything else in the
# directory is left alone.
RUN_FILES = ("run.json", "config.yaml", "config_changes.jsonl", "metrics.jsonl", "eval.jsonl", "summary.json",
             "training_curves.png", "checkpoints", "tensorboard", "wandb")

# The resume contract: which config keys may differ between a run's start and a ``--resume`` of it. Patterns are
# dotted keys (``*`` matches the rest, dots included); a nested mapping (``algorithm.hparams``) is compared key by
# key. MUTABLE_KEYS are applied for real and recorded in ``config_changes.jsonl``; every other key -- FIXED_KEYS
# and any key listed in neither -- defines what the run *is*, and changing it on ``--resume`` is refused.
FIXED_KEYS = (
    "model.*", "data.*", "rollout.*", "reward.*", "algorithm.*", "sft.*",
    "train.seed", "train.prompts_per_step", "train.gen_prompts_per_step", "train.mini_batches", "train.ppo_epochs",
    "optim.betas", "optim.weight_decay", "optim.warmup_steps",
)
MUTABLE_KEYS = (
    "output_dir",
    "train.steps", "train.save_every", "train.keep_checkpoints", "train.max_bad_steps", "train.micro_batch_size",
    "train.micro_batch_tokens",
    "train.threads", "train.deterministic",
    "optim.lr", "optim.grad_clip",
    "eval.*", "logging.*",
)
_UNSET = "(unset)"


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": {}}`` -> ``{"a.b": 1}`` (lists are values; empty mappings have no keys)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _open_mappings(tree: dict, prefix: str = "") -> set[str]:
    """Dotted keys of free-form mappings (empty by default, e.g. ``algorithm.hparams``)."""
    out: set[str] = set()
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= _open_mappings(v, f"{prefix}{k}.") if v else {f"{prefix}{k}"}
    return out


def is_mutable(key: str) -> bool:
    """Whether ``key`` (dotted) may change on ``--resume``; keys in neither list are fixed."""
    return any(fnmatchcase(key, p) for p in MUTABLE_KEYS) and not any(fnmatchcase(key, p) for p in FIXED_KEYS)


def config_diff(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """``(key, old, new)`` for every dotted key whose value differs (``"(unset)"`` for an absent mapping entry).
    Keys missing from ``old`` (a config written before the key existed) count as their defaults; keys this
    version no longer knows are ignored."""
    default_tree = dataclasses.asdict(Config())
    defaults, maps = flatten(default_tree), _open_mappings(default_tree)

    def known(key: str) -> bool:
        return key in defaults or any(key.startswith(m + ".") for m in maps)

    before = {**defaults, **{k: v for k, v in flatten(old).items() if known(k)}}
    after = flatten(new)
    return [(k, before.get(k, _UNSET), after.get(k, _UNSET)) for k in sorted(set(before) | set(after))
            if before.get(k, _UNSET) != after.get(k, _UNSET)]


def _fmt(v: Any) -> str:
    return v if v == _UNSET else json.dumps(v)


def provenance() -> dict:
    """What produced a result: the command line, cegppo's version and, in a git checkout, the commit (a copy of the
    tree without ``.git``, such as the one a GPU check runs in, names it in ``CEGPPO_COMMIT``)."""
    src = Path(__file__).resolve().parents[3]  # the checkout, when cegppo runs from one (pip install -e)
    commit, dirty = None, False
    if (src / ".git").exists():
        try:
            commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True,
                                    timeout=10).stdout.strip() or None
            dirty = bool(subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"],
                                        capture_output=True, text=True, timeout=10).stdout.strip())
        except (OSError, subprocess.SubprocessError):
            pass
    else:
        commit = os.environ.get("CEGPPO_COMMIT") or None
    return {"command": " ".join(["cegppo", *sys.argv[1:]]) if Path(sys.argv[0]).name == "cegppo" else " ".join(sys.argv),
            "cegppo_version": _version(), "commit": commit, "uncommitted_changes": dirty}


def machine() -> dict:
    """The machine a result was measured on: CPU model, the ISA level that decides the precision (``amx`` /
    ``avx512_bf16`` / ``avx512`` / ``avx2``), cores, whether bf16 is fast there, the GPU if torch sees one, torch's
    version and threads, and the 1-minute load average (what else was running)."""
    import platform

    import torch

    flags, model = set(), platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    isa = next((name for name, flag in (("amx", "amx_bf16"), ("avx512_bf16", "avx512_bf16"), ("avx512", "avx512f"),
                                        ("avx2", "avx2")) if flag in flags), platform.machine())
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": model, "isa": isa, "cores": os.cpu_count(), "bf16_fast": bool(
        torch.ops.mkldnn._is_mkldnn_bf16_supported()), "gpu": gpu, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "load_1min": round(os.getloadavg()[0], 2)}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cegppo")
    except PackageNotFoundError:  # run from a source tree on PYTHONPATH, not installed
        return "unknown (not installed)"


def commit_label() -> str:
    """The checkout's commit, short, with ``-dirty`` when tracked files have uncommitted changes (for results files);
    ``unknown`` outside a git checkout."""
    p = provenance()
    return "unknown" if p["commit"] is None else p["commit"][:7] + ("-dirty" if p["uncommitted_changes"] else "")


class RunDir:
    """The run directory, owned (locked) by this process from construction until :meth:`close`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.provenance = provenance()  # what this session runs: command, version, commit, before anything changes
        self.checkpoints = self.path / "checkpoints"
        self.metrics = self.path / "metrics.jsonl"
        self.evals = self.path / "eval.jsonl"
        self.changes = self.path / "config_changes.jsonl"
        self._sinks: list[Any] = []
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".write-test-{os.getpid()}"
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            raise TrainingError(f"output directory {self.path} is not writable: {e.strerror or e}") from None
        try:
            self.lock = RunLock(self.path).acquire()
        except RunLockedError as e:
            raise TrainingError(str(e)) from None

    def close(self) -> None:
        """Release the run's lock (idempotent)."""
        self.lock.release()

    # ---------------------------------------------------------------------------------------------- a run's start
    def run_files(self) -> list[Path]:
        """The files of a previous run present in the directory (see :data:`RUN_FILES`)."""
        return [self.path / name for name in RUN_FILES if (self.path / name).exists()]

    def begin(self, cfg: Config, resume: bool, overwrite: bool) -> tuple[Path | None, str, list[tuple[str, Any, Any]]]:
        """Where a run starts: (the checkpoint it resumes from or None, its run id, the config changes to apply).
        A fresh run checks the directory holds no other run; a resumed one checks the resume contract."""
        resume_from = ckpt.latest_valid_checkpoint(self.checkpoints) if resume else None
        if resume and resume_from is None:
            log.warning("--resume: no valid checkpoint under %s; starting from scratch", self.checkpoints)
        if resume_from is None:
            if not resume:
                self.check_fresh(overwrite)
            return None, self.new_run_id(), []
        saved = ckpt.read_trainer_state(resume_from)  # the run's identity and config come from the checkpoint
        run_id = saved.get("run_id") or self.read_run_id() or self.new_run_id()
        old_cfg = saved.get("config") or self.read_config()
        if old_cfg is None:
            log.warning("--resume: %s records no config; the resume contract cannot be checked", resume_from)
            return resume_from, run_id, []
        return resume_from, run_id, self.resume_changes(old_cfg, cfg)

    def check_fresh(self, overwrite: bool) -> None:
        """Before a fresh run: refuse a directory holding another run's files, or remove them (``overwrite``)."""
        found = self.run_files()
        if not found:
            return
        names = ", ".join(p.name + ("/" if p.is_dir() else "") for p in found)
        if not overwrite:
            raise TrainingError(f"{self.path} already holds a run ({names}); pass --resume to continue it, or "
                                f"--overwrite to delete it and start over")
        log.warning("--overwrite: removing the previous run's files from %s: %s", self.path, names)
        for p in found:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()

    def read_run_id(self) -> str | None:
        try:
            run_id = json.loads((self.path / "run.json").read_text()).get("run_id")
        except (OSError, ValueError, AttributeError):
            return None
        return run_id if isinstance(run_id, str) else None

    @staticmethod
    def new_run_id() -> str:
        return uuid.uuid4().hex

    def start(self, run_id: str, cfg: Config) -> None:
        """A fresh run's record: ``run.json`` (its id) and ``config.yaml`` (its config, fixed from now on)."""
        self.changes.unlink(missing_ok=True)  # a restart from scratch (--resume without a checkpoint)
        atomic_write_json(self.path / "run.json", {
            "run_id": run_id, "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), **self.provenance})
        self.save_config(cfg)

    def read_config(self) -> dict | None:
        """The run's original config (``config.yaml``) as a mapping, if readable."""
        import yaml

        try:
            tree = yaml.safe_load((self.path / "config.yaml").read_text())
        except (OSError, yaml.YAMLError):
            return None
        return tree if isinstance(tree, dict) else None

    def resume_changes(self, old: dict, cfg: Config) -> list[tuple[str, Any, Any]]:
        """The config changes of a ``--resume`` against the checkpointed config ``old``: raises
        :class:`TrainingError` listing every fixed key that differs; returns the mutable ones."""
        changes = config_diff(old, cfg.to_dict())
        fixed = [c for c in changes if not is_mutable(c[0])]
        if fixed:
            listed = ", ".join(f"{k} {_fmt(a)} -> {_fmt(b)}" for k, a, b in fixed)
            raise TrainingError(f"--resume refused: the config changes what this run is: {listed} (fixed for the "
                                f"life of a run, docs/runs.md); resume with the run's values, or start a new run "
                                f"in another output_dir (or with --overwrite)")
        return changes

    def record_changes(self, step: int, changes: list[tuple[str, Any, Any]], cfg: Config, run_id: str) -> None:
        """After a ``--resume`` from ``step``: append one row per changed key to ``config_changes.jsonl``
        (rows of steps >= ``step`` are dropped first: the sessions that wrote them were rolled back); keep
        ``config.yaml`` (the original config), writing it only if missing; ``run.json`` names the checkpoint's run id."""
        rows = []
        if self.changes.exists():
            try:
                rows = [r for r in read_jsonl(self.changes) if r.get("step", 0) < step]
            except ValueError as e:
                raise TrainingError(f"{e}; repair or remove the file to resume") from None
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        rows += [{"step": step, "key": k, "old": a, "new": b, "time": now} for k, a, b in changes]
        if rows or self.changes.exists():
            atomic_write_text(self.changes, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
        if changes:
            log.info("--resume: config changes applied from step %d (recorded in %s): %s", step, self.changes,
                     ", ".join(f"{k} {_fmt(a)} -> {_fmt(b)}" for k, a, b in changes))
        if not (self.path / "config.yaml").exists():
            self.save_config(cfg)
        if self.read_run_id() != run_id:  # missing, or the checkpoint was brought from elsewhere: its id wins
            atomic_write_json(self.path / "run.json", {"run_id": run_id, "started": None, **self.provenance})

    def truncate_logs(self, step: int, resumed: bool) -> None:
        """Drop metric and eval rows logged after the checkpoint we resume from (all of them on a fresh start):
        a kill between appending a step's row and writing its checkpoint must not leave that step twice."""
        for path, keep in ((self.metrics, lambda r: r.get("step", 0) <= step),
                           # the final evaluation is redone by the resumed run
                           (self.evals, lambda r: r.get("step", 0) < step or
                            (r.get("step", 0) == step and r.get("tag") != "final"))):
            if path.exists():
                try:
                    kept = [r for r in read_jsonl(path) if keep(r)] if resumed else []
                except ValueError as e:
                    raise TrainingError(f"{e}; repair or remove the file to resume") from None
                atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))

    def save_config(self, cfg: Config) -> None:
        save_config(cfg, self.path / "config.yaml")

    def open_sinks(self, cfg: Config) -> None:
        """TensorBoard and wandb writers when ``logging`` asks for them and they are installed."""
        if cfg.logging.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._sinks.append(("tensorboard", SummaryWriter(str(self.path / "tensorboard"))))
            except ImportError:
                log.warning("logging.tensorboard is set but tensorboard is not installed (pip install tensorboard)")
        if cfg.logging.wandb:
            try:
                import wandb

                self._sinks.append(("wandb", wandb.init(project="cegppo", name=self.path.name, dir=str(self.path),
                                                        config=cfg.to_dict(), resume="allow")))
            except ImportError:
                log.warning("logging.wandb is set but wandb is not installed (pip install wandb)")

    def log_metrics(self, row: dict) -> None:
        append_jsonl(self.metrics, row)
        scalars = {k: v for k, v in row.items() if isinstance(v, (int, float))}
        for kind, sink in self._sinks:
            if kind == "tensorboard":
                for k, v in scalars.items():
                    sink.add_scalar(k, v, row["step"])
            else:
                sink.log(scalars, step=row["step"])

    def log_eval(self, row: dict) -> None:
        append_jsonl(self.evals, row)

    def write_summary(self, summary: dict) -> None:
        atomic_write_json(self.path / "summary.json", summary)
