"""The run directory (``output_dir``) and everything written into it as a run goes: the resolved config, one
metrics row per step (``metrics.jsonl``, plus TensorBoard / wandb when enabled), held-out evaluations
(``eval.jsonl``), ``summary.json`` and the checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from cegppo.config import Config, save_config
from cegppo.io import append_jsonl, atomic_write_json, atomic_write_text, read_jsonl

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    pass


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.checkpoints = self.path / "checkpoints"
        self.metrics = self.path / "metrics.jsonl"
        self.evals = self.path / "eval.jsonl"
        self._sinks: list[Any] = []
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".write-test-{os.getpid()}"
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            raise TrainingError(f"output directory {self.path} is not writable: {e.strerror or e}") from None

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
