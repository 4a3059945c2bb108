"""Fault injection for the kill-and-resume tests: a testing hook, not a feature.

``failpoint(name, step)`` kills the process with SIGKILL (no cleanup, no ``finally``, no flush: what a power
cut or the OOM killer does) when the environment variable ``CEGPPO_FAILPOINT`` is ``"<name>"`` or
``"<name>:<step>"``. The variable is read once at import; when it is unset a failpoint is one comparison.

Failpoints: ``generation`` (after a step's rollouts are generated), ``optimizer-step`` (gradients computed,
before ``optimizer.step()``), ``checkpoint-write`` (checkpoint files written to the temporary directory,
before the manifest and the rename), ``checkpoint-renamed`` (after the rename, before pruning).
"""

from __future__ import annotations

import os
import signal

ENV = "CEGPPO_FAILPOINT"
_SPEC = os.environ.get(ENV) or None


def failpoint(name: str, step: int | None = None) -> None:
    if _SPEC is None:
        return
    if _SPEC == name or (step is not None and _SPEC == f"{name}:{step}"):
        os.kill(os.getpid(), signal.SIGKILL)
