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
import shutil
import uuid
from datetime import datetime, timezone
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from cegppo.config import Config, ConfigError, load_yaml, read_config_text, save_config, validate
from cegppo.engine import checkpoint as ckpt
from cegppo.engine.artefacts import data_changes, data_fingerprints
from cegppo.engine.provenance import provenance
from cegppo.engine.runlock import RunLock, RunLockedError
from cegppo.errors import describe_os_error
from cegppo.io import append_jsonl, atomic_write_json, atomic_write_text, probe_writable, read_jsonl

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    pass


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a training run, with the last completed step (``cegppo train`` prints it)."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step


# The files a run writes into its directory. The run's own record, ``run.json`` (written first), lists them under
# "files": they are the run's. A fresh run into a directory holding a run is refused (``--resume`` continues it,
# ``--overwrite`` removes exactly the recorded files and starts over); a file with one of these names that no run
# recorded (a hand-written config.yaml, a directory without run.json) is never counted as a run nor deleted: a run
# would replace it, so it is refused until moved. Anything else in the directory is left alone.
RUN_RECORD = "run.json"
RUN_FILES = (RUN_RECORD, "config.yaml", "config_changes.jsonl", "metrics.jsonl", "eval.jsonl", "summary.json",
             "training_curves.png", "checkpoints", "tensorboard", "wandb")
# What a run holds that a restart from scratch would lose (a run holding none of it has done no work yet)
WORK_FILES = ("metrics.jsonl", "eval.jsonl", "summary.json", "checkpoints")

# The resume contract: which config keys may differ between a run's start and a ``--resume`` of it. Patterns are
# dotted keys (``*`` matches the rest, dots included); a nested mapping (``algorithm.hparams``) is compared key by
# key. MUTABLE_KEYS are applied for real and recorded in ``config_changes.jsonl``; every other key -- FIXED_KEYS
# and any key listed in neither -- defines what the run *is*, and changing it on ``--resume`` is refused.
FIXED_KEYS = (
    "model.*", "data.*", "rollout.*", "reward.*", "algorithm.*", "sft.*",
    "train.seed", "train.prompts_per_step", "train.gen_prompts_per_step", "train.mini_batches", "train.ppo_epochs",
    "train.target_kl",
    "optim.betas", "optim.weight_decay", "optim.warmup_steps",
)
MUTABLE_KEYS = (
    "output_dir",
    "train.steps", "train.save_every", "train.keep_checkpoints", "train.max_bad_steps", "train.micro_batch_size",
    "train.micro_batch_tokens", "train.shared_prompt_tokens",
    "train.threads", "train.deterministic", "train.on_collapse",
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
        self.data: dict[str, dict[str, Any]] = {}  # the data files' fingerprints (begin)
        try:
            probe_writable(self.path)
        except OSError as e:
            raise TrainingError(f"output directory {self.path} is not writable: "
                                f"{describe_os_error(e, {'output_dir': str(self.path)})}") from None
        try:
            self.lock = RunLock(self.path).acquire()
        except RunLockedError as e:
            raise TrainingError(str(e)) from None

    def close(self) -> None:
        """Release the run's lock (idempotent)."""
        self.lock.release()

    # ---------------------------------------------------------------------------------------------- a run's start
    def run_files(self) -> list[Path]:
        """The files with a run file's name present in the directory (see :data:`RUN_FILES`)."""
        return [self.path / name for name in RUN_FILES if (self.path / name).exists() or (self.path / name).is_symlink()]

    def recorded_files(self) -> set[str] | None:
        """The names the directory's run recorded as its own in ``run.json`` (``run.json`` included), or None when
        there is no readable run record. A record written before the list existed owns every run file name."""
        try:
            record = json.loads((self.path / RUN_RECORD).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or not isinstance(record.get("run_id"), str):
            return None
        files = record.get("files", list(RUN_FILES))  # a record from before the list: every run file name
        return {RUN_RECORD, *(f for f in files if f in RUN_FILES)} if isinstance(files, list) else {RUN_RECORD}

    def foreign_files(self) -> list[Path]:
        """Files with a run file's name that no run recorded writing: a run would replace them."""
        owned = self.recorded_files() or set()
        return [p for p in self.run_files() if p.name not in owned]

    def check_inputs(self, inputs: dict[str, str | None]) -> None:
        """Refuse an input (``{key: path}``: data files, the model directory) that is, or lies inside, one of this
        directory's run files: the run writes, truncates or prunes them (``--overwrite`` deletes them)."""
        root = self.path.resolve()
        for key, value in inputs.items():
            if not value or not Path(value).exists():
                continue  # a preset or hub name, or a missing file (reported where it is loaded)
            p = Path(value).resolve()
            for name in RUN_FILES:
                target = root / name
                if p == target or target in p.parents:
                    raise TrainingError(f"{key} {value} is inside this run's {name} (output_dir {self.path}), which "
                                        f"the run writes: move the input, or choose another output_dir")

    def begin(self, cfg: Config, resume: bool, overwrite: bool, accept_data_change: bool = False,
              ) -> tuple[Path | None, str, list[tuple[str, Any, Any]]]:
        """Where a run starts: (the checkpoint it resumes from or None, its run id, the config changes to apply).
        A fresh run checks the directory holds no other run; a resumed one checks the resume contract, and that the
        data files still hold what the run started on (``accept_data_change`` continues on new contents, recorded).
        A ``--resume`` that cannot continue the run (no valid checkpoint) never replaces it."""
        validate(cfg)  # a Config built in code never went through load_config: checked before anything loads
        data = {"data.train_path": cfg.data.train_path, "data.test_path": cfg.data.test_path}
        self.check_inputs({**data, "model.name": cfg.model.name})
        self.data = data_fingerprints(data)  # computed once: recorded at the start, compared on --resume
        resume_from = ckpt.latest_valid_checkpoint(self.checkpoints) if resume else None
        if resume and resume_from is None:
            self.check_restart(cfg)
            log.warning("--resume: no valid checkpoint under %s; starting from scratch", self.checkpoints)
        if resume_from is None:
            self.check_fresh(overwrite, restart=resume)
            return None, self.new_run_id(), []
        saved = ckpt.read_trainer_state(resume_from)  # the run's identity and config come from the checkpoint
        run_id = saved.get("run_id") or self.read_run_id() or self.new_run_id()
        old_cfg = saved.get("config") or self.read_config()
        if old_cfg is None:
            log.warning("--resume: %s records no config; the resume contract cannot be checked", resume_from)
            return resume_from, run_id, []
        changes = self.resume_changes(old_cfg, cfg)
        self.check_data(accept_data_change)
        return resume_from, run_id, changes

    def check_data(self, accept: bool) -> None:
        """``--resume``: refuse data files whose contents differ from the fingerprints in the run's record, unless
        ``accept`` (``--accept-data-change``: logged, and recorded in ``run.json`` by :meth:`record_changes`)."""
        recorded = self.read_record().get("data")
        if recorded is None:
            log.warning("--resume: %s records no data fingerprints (a run from before they were kept); the data "
                        "files cannot be compared, and are fingerprinted from now on", self.path / RUN_RECORD)
            return
        changed = data_changes(recorded, self.data)
        if changed and not accept:
            raise TrainingError(f"--resume refused: the data changed since the run started: {'; '.join(changed)}; "
                                f"resume on the run's data, or pass --accept-data-change to continue on the new "
                                f"contents (recorded in {RUN_RECORD})")
        if changed:
            log.warning("--resume --accept-data-change: continuing on changed data: %s", "; ".join(changed))

    @staticmethod
    def _names(paths: list[Path]) -> str:
        return ", ".join(p.name + ("/" if p.is_dir() else "") for p in paths)

    def check_restart(self, cfg: Config) -> None:
        """``--resume`` found no valid checkpoint: starting from scratch is allowed only where it loses nothing (no
        run, or a run with no work yet and the same fixed config); otherwise refused, naming why, the run intact."""
        if self.recorded_files() is None:
            return  # no run here (files without a record are refused by check_fresh)
        def holds(p: Path) -> bool:
            return any(p.iterdir()) if p.is_dir() else p.exists() and p.stat().st_size > 0

        work = [self.path / n for n in WORK_FILES if holds(self.path / n)]
        saved = ckpt.list_checkpoints(self.checkpoints)
        why = (f"{len(saved)} checkpoint(s) under checkpoints/, none intact (see the warnings above)" if saved else
               "no checkpoint was written (train.save_every=0 writes none, and a run stopped before its first "
               "checkpoint has none)")
        if work:
            raise TrainingError(f"--resume refused: {self.path} holds a run with work in {self._names(work)} but "
                                f"{why}, so it cannot be continued, and a restart would replace it (nothing was "
                                f"changed); start over with --overwrite (without --resume), or use another output_dir")
        old = self.read_config()
        if old is not None:
            self.resume_changes(old, cfg)  # the same run, or refused: a restart must not change what the run is

    def check_fresh(self, overwrite: bool, restart: bool = False) -> None:
        """Before a fresh run: refuse a directory holding another run's files, or remove them (``overwrite``);
        refuse files with a run file's name that no run recorded (neither a run nor ours to delete). ``restart``:
        a ``--resume`` that :meth:`check_restart` let start over the run's own files."""
        foreign = self.foreign_files()
        if foreign:
            them = "it" if len(foreign) == 1 else "them"
            raise TrainingError(f"{self.path} holds {self._names(foreign)}, which no cegppo run recorded writing "
                                f"(no {RUN_RECORD} lists {them}); a run would replace {them}, so it is refused (even "
                                f"with --overwrite, which deletes only a run's recorded files): move {them} away, or "
                                f"choose another output_dir")
        found = self.run_files()
        if not found or restart:
            return
        names = self._names(found)
        if not overwrite:
            raise TrainingError(f"{self.path} already holds a run ({names}); pass --resume to continue it, or "
                                f"--overwrite to delete it and start over")
        log.warning("--overwrite: removing the previous run's files from %s: %s", self.path, names)
        for p in found:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()

    def read_record(self) -> dict:
        """The run's record (``run.json``); empty when missing or unreadable."""
        try:
            record = json.loads((self.path / RUN_RECORD).read_text())
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    def read_run_id(self) -> str | None:
        run_id = self.read_record().get("run_id")
        return run_id if isinstance(run_id, str) else None

    @staticmethod
    def new_run_id() -> str:
        return uuid.uuid4().hex

    def start(self, run_id: str, cfg: Config) -> None:
        """A fresh run's record: ``run.json`` (its id) and ``config.yaml`` (its config, fixed from now on)."""
        self.changes.unlink(missing_ok=True)  # a restart from scratch (--resume without a checkpoint)
        atomic_write_json(self.path / RUN_RECORD, {
            "run_id": run_id, "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "files": list(RUN_FILES), "data": self.data, **self.provenance})  # the record: these names are this run's
        self.save_config(cfg)

    def read_config(self) -> dict | None:
        """The run's original config (``config.yaml``) as a mapping, if readable; read by the config loader's bounded
        parser (a hostile file is logged and treated as unreadable, in milliseconds)."""
        path = self.path / "config.yaml"
        if not path.exists():
            return None
        try:
            tree = load_yaml(read_config_text(path), str(path))
        except ConfigError as e:
            log.warning("%s", e)
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
        before = self.read_record()
        record = dict(before)
        if record.get("run_id") != run_id:  # missing, or the checkpoint was brought from elsewhere: its id wins
            record = {"run_id": run_id, "started": None, "files": list(RUN_FILES), **self.provenance}
        if record.get("data") != self.data:  # first fingerprinted, or a change accepted (--accept-data-change)
            if isinstance(record.get("data"), dict):
                record["data_changes"] = [*record.get("data_changes", []), {"step": step, "time": now, "old": record[
                    "data"], "new": self.data}]
            record["data"] = self.data
        if record != before:
            atomic_write_json(self.path / RUN_RECORD, record)

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
