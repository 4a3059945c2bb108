"""What a command loads is checked for what it will be used as, before any work (issue 41, class 3): the data
files of a run (fingerprinted into its record at start, compared on ``--resume``), a model directory's tokenizer
(present, and its vocabulary fits the embedding) and weights (they fit ``config.json``), and a checkpoint's optimizer
state (its tensors fit the parameters). Each check returns the problem as text (None when there is none); the
caller raises it as its own error type (``TrainingError``, ``ModelLoadError``, ``CheckpointError``), naming the file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from cegppo.data.evalsets import resolve_dataset

DATA_KEYS = ("data.train_path", "data.test_path")
# A local model directory must hold one of these, else transformers builds a tokenizer from tokenizer_config.json
# alone: its special tokens only (4 tokens for the tiny model), and every prompt encodes to nothing.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def data_fingerprints(paths: dict[str, str]) -> dict[str, dict[str, Any]]:
    """``{key: {"path", "bytes", "sha256"}}`` for each data setting (``{"data.train_path": spec, ...}``) naming a
    file (a bundled set's name resolves to its file); empty settings and missing files (reported where the data is
    loaded) have none. Computed once per session, when the run starts or resumes."""
    out: dict[str, dict[str, Any]] = {}
    for key, spec in paths.items():
        if not spec:
            continue
        path = Path(spec) if Path(spec).is_file() else resolve_dataset(spec)
        if path is None or not path.is_file():
            continue
        out[key] = {"path": str(spec), "bytes": path.stat().st_size, "sha256": sha256_file(path)}
    return out


def data_changes(recorded: dict, current: dict[str, dict[str, Any]]) -> list[str]:
    """The data files whose contents differ from the run's record (``recorded``: what :func:`data_fingerprints`
    gave when the run started), one phrase each naming the setting and the file."""
    changed = []
    for key, now in current.items():
        then = recorded.get(key) if isinstance(recorded, dict) else None
        if isinstance(then, dict) and then.get("sha256") != now["sha256"]:
            changed.append(f"{key} {now['path']} (sha256 {str(then.get('sha256'))[:12]}... -> {now['sha256'][:12]}..., "
                           f"{then.get('bytes')} -> {now['bytes']} bytes)")
    return changed


def tokenizer_file_problem(directory: Path) -> str | None:
    """A local model or checkpoint directory without any tokenizer vocabulary file."""
    if any((directory / name).is_file() for name in TOKENIZER_FILES):
        return None
    return (f"has no tokenizer vocabulary file (one of {', '.join(TOKENIZER_FILES)}); transformers would build a "
            f"fallback tokenizer of special tokens only, which encodes every prompt to nothing: save the model's "
            f"tokenizer into it (tokenizer.save_pretrained)")


def vocabulary_problem(vocab: int, rows: int) -> str | None:
    """A tokenizer of ``vocab`` tokens for an embedding of ``rows`` rows: ids past the rows cannot be embedded, and
    a vocabulary under half the rows is another model's (real models pad their embedding by a few percent)."""
    if vocab > rows:
        return (f"the tokenizer has {vocab} tokens but the model's embedding has {rows} rows: token ids {rows} and up "
                f"cannot be embedded; the tokenizer is not this model's")
    if 2 * vocab < rows:
        return (f"the tokenizer has {vocab} tokens for the model's {rows} embedding rows (fewer than half): it is not "
                f"this model's tokenizer")
    return None


def loading_problem(info: dict[str, Any]) -> str | None:
    """transformers' loading report (``output_loading_info=True``): weights missing from the file (initialised at
    random), weights the architecture has no place for (dropped) or of another shape mean config.json and the
    weights are of different models."""
    found = [(what, list(info.get(what) or [])) for what in ("missing_keys", "unexpected_keys", "mismatched_keys")]
    found = [(what, keys) for what, keys in found if keys]
    if not found:
        return None
    listed = "; ".join(f"{len(keys)} {what.replace('_keys', '')} (first: {keys[0]})" for what, keys in found)
    return f"the weights do not fit config.json: {listed}; config.json and the weights are of different models"


def optimizer_state_problem(saved: Any, params: list[list[Any]]) -> str | None:
    """An optimizer state dict (``optimizer.pt``) against the parameters of the optimizer it will be loaded into
    (``params``: each param group's parameters, in order): the groups' sizes, then every per-parameter tensor (AdamW's
    ``exp_avg``, ``exp_avg_sq``) must have its parameter's shape; 0-d entries (``step``) are counters."""
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) or not isinstance(
            saved.get("param_groups"), list):
        return "not an optimizer state (expected a mapping with 'state' and 'param_groups')"
    groups = saved["param_groups"]
    sizes = [len(g.get("params", [])) if isinstance(g, dict) else -1 for g in groups]
    if sizes != [len(g) for g in params]:
        return (f"holds {len(groups)} parameter group(s) of {sizes} parameters; this model's optimizer has "
                f"{[len(g) for g in params]}")
    by_index = {i: p for g, ps in zip(groups, params) for i, p in zip(g["params"], ps)}
    for index, entry in saved["state"].items():
        if index not in by_index or not isinstance(entry, dict):
            return f"holds state for parameter {index!r}, which this model's optimizer does not have"
        shape = tuple(by_index[index].shape)
        for name, value in entry.items():
            got = tuple(getattr(value, "shape", ()))
            if got and got != shape:
                return (f"'{name}' of parameter {index} has shape {got}; the model's parameter has shape {shape}: "
                        f"the state was written for another model")
    return None
