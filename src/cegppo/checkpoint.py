"""Checkpoints that survive a kill: written under a temporary name, fsynced, renamed, with a manifest of
file sizes and SHA-256 digests so a half-written or corrupted checkpoint is detected and skipped.

Layout: ``<run>/checkpoints/step_000010/`` holding the policy (``save_pretrained``, safetensors), the
tokenizer, ``optimizer.pt`` / ``scheduler.pt`` (plain tensors and numbers, loaded with ``weights_only=True``),
``trainer_state.json`` (step, data position, RNG states) and ``manifest.json`` (written last).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from cegppo.io import atomic_write_json, fsync_dir

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    pass


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
    for d in sorted({p.parent for p in root.rglob("*")} | {root}):
        fsync_dir(d)


def save_checkpoint(
    ckpt_root: Path, step: int, model: torch.nn.Module, tokenizer: Any, optimizer: torch.optim.Optimizer,
    scheduler: Any, state: dict, keep: int = 2,
) -> Path:
    """Write ``step_<step>`` atomically; prune to the newest ``keep`` valid checkpoints."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".tmp-step_{step:06d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {
            "step": step,
            "files": {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files},
        }
        atomic_write_json(tmp / MANIFEST, manifest)
        _fsync_tree(tmp)
        if final.exists():  # a previous, possibly broken, checkpoint of the same step
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(ckpt_root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write checkpoint {final}: {e.strerror or e}") from e
    for old in list_checkpoints(ckpt_root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Checkpoint directories, oldest first (temporary directories excluded)."""
    if not ckpt_root.is_dir():
        return []
    return sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())


def verify_checkpoint(path: Path) -> str | None:
    """None if the checkpoint is complete and intact, else the reason it is not."""
    mpath = path / MANIFEST
    if not mpath.is_file():
        return "no manifest (write was interrupted)"
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as e:
        return f"unreadable manifest ({e})"
    for rel, meta in files.items():
        p = path / rel
        if not p.is_file():
            return f"missing {rel}"
        if p.stat().st_size != meta["bytes"]:
            return f"{rel} has {p.stat().st_size} bytes, manifest says {meta['bytes']}"
        if _sha256(p) != meta["sha256"]:
            return f"{rel} does not match its SHA-256"
    return None


def latest_valid_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest intact checkpoint; broken ones are logged and skipped."""
    for path in reversed(list_checkpoints(ckpt_root)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def load_training_state(path: Path, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict:
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    return json.loads((path / "trainer_state.json").read_text())
