"""Progress is never silent: without a terminal, every phase and a heartbeat inside long phases write log lines."""

from __future__ import annotations

import logging

from cegppo.recipes import train_loop
from cegppo.reporting import progress as progress_module


def test_plain_lines_name_the_phase_and_throughput(caplog, monkeypatch):
    monkeypatch.setattr(progress_module, "PLAIN_HEARTBEAT_S", 0.0)
    p = progress_module.Progress("cegppo train", 3, unit="step")
    assert p.bar is None  # pytest's stderr is not a terminal
    with caplog.at_level(logging.INFO, logger="cegppo"):
        p.phase("generate 8 x 4")
        p.token_heartbeat(12, 128)
        p.advance(1, gen_tok_s=123.4)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "cegppo train 0/3: generate 8 x 4"
    assert lines[1] == "cegppo train 0/3: generate 8 x 4, token 12/128"
    assert lines[2].startswith("cegppo train 1/3 (") and "eta" in lines[2] and "gen_tok_s=123" in lines[2]


def test_heartbeat_is_rate_limited_and_disabled_progress_is_silent(caplog):
    with caplog.at_level(logging.INFO, logger="cegppo"):
        p = progress_module.Progress("x", 1)
        p.phase("update 1/2")
        for i in range(100):
            p.heartbeat(f"{i}/100 sequences")  # within PLAIN_HEARTBEAT_S of the phase line: no extra lines
        off = progress_module.Progress("y", 1, enabled=False)
        off.phase("generate")
        off.heartbeat("token 1/2")
        off.advance(1)
    assert [r.getMessage() for r in caplog.records] == ["x 0/1: update 1/2"]


def test_training_run_reports_every_phase(tiny_config, caplog):
    from cegppo.engine.trainer import Trainer

    with Trainer(tiny_config("train.steps=1", "train.save_every=1", "logging.progress=true",
                             "train.mini_batches=2")) as tr, caplog.at_level(logging.INFO, logger="cegppo"):
        train_loop(tr)
    text = caplog.text
    for phase in ("generate 4 x 4", "old log-probs", "update 1/2", "update 2/2", "checkpoint", "train 1/1 ("):
        assert phase in text, phase
