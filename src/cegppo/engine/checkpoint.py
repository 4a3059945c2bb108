"""Checkpoints that survive a kill: written under a temporary name, fsynced, renamed, with a manifest of
file sizes and SHA-256 digests so a half-written or corrupted checkpoint is detected and skipped.

Layout: ``<run>/checkpoints/step_000010/`` holding the policy (``save_pretrained``, safetensors), the
tokenizer, ``optimizer.pt`` / ``scheduler.pt`` (plain tensors and numbers, loaded with ``weights_only=True``),
``trainer_state.json`` (step, data position, the run id and the run's config) and ``manifest.json`` (written last,
with the run id too). Pruning (``keep``) only ever removes checkpoints of the same run id: never another run's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from cegppo.engine.artefacts import optimizer_state_problem, sha256_file
from cegppo.errors import os_error_text, show
from cegppo.faults import failpoint
from cegppo.io import fsync_dir, one_line, replace_dir

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    pass


def _fsync_tree(root: Path) -> None:
    paths = sorted(root.rglob("*"))
    for p in paths:
        if p.is_file():
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
    for d in sorted({p.parent for p in paths} | {root}):
        fsync_dir(d)


_STEP_NAME = re.compile(r"step_([0-9]+)")


def step_dir(ckpt_root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives: ``step_<step>``, zero-padded to 6 digits (more past 999,999; the
    checkpoints are ordered by the number, never by the name: :func:`list_checkpoints`)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"a checkpoint's step must be an integer >= 0, got {step!r}")
    return ckpt_root / f"step_{step:06d}"


def checkpoint_step(path: Path) -> int | None:
    """The step number in a checkpoint directory's name (``step_000010`` -> 10); None for any other name."""
    m = _STEP_NAME.fullmatch(path.name)
    return int(m.group(1)) if m else None


def save_checkpoint(
    ckpt_root: Path, step: int, model: torch.nn.Module, tokenizer: Any, optimizer: torch.optim.Optimizer,
    scheduler: Any, state: dict, keep: int = 2,
) -> Path:
    """Write ``step_<step>`` atomically; prune this run's checkpoints (those whose manifest carries
    ``state["run_id"]``) to the newest ``keep``. Checkpoints of another run id, or whose owner cannot be read,
    are never deleted."""
    run_id = state.get("run_id")
    final = step_dir(ckpt_root, step)
    tmp = ckpt_root / f".tmp-{final.name}-{os.getpid()}"
    try:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        for stale in stale_temp_dirs(ckpt_root):  # left by a process killed mid-write; one writer per run
            log.warning("removing half-written checkpoint directory %s", stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
        failpoint("checkpoint-write", step)
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {
            "step": step,
            "run_id": run_id,
            "files": {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")  # fsynced below
        _fsync_tree(tmp)
        replace_dir(tmp, final)  # over a previous, possibly broken, checkpoint of the same step
        fsync_dir(ckpt_root)
        failpoint("checkpoint-renamed", step)
    except Exception as e:  # OSError (disk full, permissions) or a serializer's own error type
        shutil.rmtree(tmp, ignore_errors=True)
        reason = os_error_text(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"  # the file, and why
        raise CheckpointError(f"could not write checkpoint {final}: {one_line(reason)} (older checkpoints are kept)") from e
    ours = [p for p in list_checkpoints(ckpt_root) if checkpoint_run_id(p) == run_id]
    for old in ours[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


_NO_OWNER = object()


def checkpoint_run_id(path: Path) -> Any:
    """The run id in a checkpoint's manifest (None for one written before run ids existed); an unreadable
    manifest gives a sentinel that matches no run."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        return manifest.get("run_id") if isinstance(manifest, dict) else _NO_OWNER
    except (OSError, ValueError):
        return _NO_OWNER


COUNTERS = ("step", "cursor", "bad_steps")  # trainer_state.json's counters: integers >= 0 (step required)


def check_trainer_state(file: Path, state: Any) -> dict:
    """``state`` (read from ``file``) as a training state: an object whose ``step`` is an integer >= 0, as are
    ``cursor`` and ``bad_steps`` where present; else a :class:`CheckpointError` naming the file."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{file}: expected an object with an integer 'step', got {type(state).__name__}")
    for key in COUNTERS:
        if key not in state and key != "step":
            continue
        v = state.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise CheckpointError(f"{file}: '{key}' must be an integer >= 0, got {show(v, 60)}; refusing "
                                  f"to resume from it (edited or damaged)")
    return state


def read_trainer_state(path: Path) -> dict:
    """A checkpoint's ``trainer_state.json`` (step, cursor, run id, config), without loading any tensor; checked
    by :func:`check_trainer_state`."""
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / 'trainer_state.json'}: unreadable ({type(e).__name__}: {one_line(e, 200)})") from None
    return check_trainer_state(path / "trainer_state.json", state)


def stale_temp_dirs(ckpt_root: Path) -> list[Path]:
    """Temporary directories of interrupted checkpoint writes (never valid checkpoints)."""
    if not ckpt_root.is_dir():
        return []
    return sorted(p for p in ckpt_root.glob(".tmp-step_*") if p.is_dir())


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Checkpoint directories (``step_<digits>``), oldest first by their step number, not by name (``step_1000000``
    sorts after ``step_999999``); temporary directories and other names (``step_000010.bak``) are not checkpoints."""
    if not ckpt_root.is_dir():
        return []
    found = [(checkpoint_step(p), p.name, p) for p in ckpt_root.glob("step_*")]
    return [p for step, _, p in sorted((s, n, p) for s, n, p in found if s is not None) if p.is_dir()]


def verify_checkpoint(path: Path) -> str | None:
    """None if the checkpoint is complete and intact, else the reason it is not."""
    mpath = path / MANIFEST
    if not mpath.is_file():
        return "no manifest (write was interrupted)"
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable manifest ({type(e).__name__}: {e})"
    if not isinstance(files, dict) or not files:
        return "manifest lists no files"
    for rel, meta in files.items():
        p = path / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            return f"manifest entry {rel!r} points outside the checkpoint"
        if not p.is_file():
            return f"missing {rel}"
        if p.stat().st_size != meta["bytes"]:
            return f"{rel} has {p.stat().st_size} bytes, manifest says {meta['bytes']}"
        if sha256_file(p) != meta["sha256"]:
            return f"{rel} does not match its SHA-256"
    return None


def latest_valid_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest intact checkpoint; broken ones (and half-written temporary directories) are logged and skipped."""
    for tmp in stale_temp_dirs(ckpt_root):
        log.warning("skipping half-written checkpoint directory %s (interrupted write)", tmp)
    for path in reversed(list_checkpoints(ckpt_root)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def _load_tensors(path: Path) -> Any:
    # weights_only=True: the restricted unpickler accepts tensors, containers and numbers, never arbitrary
    # globals, so a tampered file fails to load instead of running code.
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - UnpicklingError, RuntimeError (bad zip), EOFError, ...
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"{path}: refused to load ({type(e).__name__}: {first}); expected plain tensor "
                              f"state written by cegppo (loaded with weights_only=True)") from None


def load_training_state(path: Path, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict:
    opt_state, sched_state = _load_tensors(path / "optimizer.pt"), _load_tensors(path / "scheduler.pt")
    problem = optimizer_state_problem(opt_state, [g["params"] for g in optimizer.param_groups])
    if problem:  # torch checks the group sizes only: a wrong shape would fail at the first update, as "unexpected"
        raise CheckpointError(f"{path / 'optimizer.pt'}: {problem}; refusing to resume from it")
    try:
        optimizer.load_state_dict(opt_state)
        scheduler.load_state_dict(sched_state)
        state = json.loads((path / "trainer_state.json").read_text())
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise CheckpointError(f"{path}: optimizer/scheduler/trainer state does not fit this run "
                              f"({type(e).__name__}: {one_line(e, 200)})") from None
    return check_trainer_state(path / "trainer_state.json", state)
