"""Progress for every long phase: a tqdm bar on a terminal, one plain line per update elsewhere (logs, CI).

A bar names its phase (``step 3/30 · generate``), shows throughput and ETA, and third-party bars (transformers,
huggingface_hub, datasets) are switched off so they never break into it.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

log = logging.getLogger("cegppo")
PLAIN_HEARTBEAT_S = 8.0  # without a terminal, a long phase still writes a line this often


def quiet_third_party_bars() -> None:
    """Switch off the progress bars transformers / huggingface_hub / datasets draw while loading or saving."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    for module, fn in (("huggingface_hub.utils", "disable_progress_bars"), ("datasets.utils.logging", "disable_progress_bar")):
        try:
            getattr(__import__(module, fromlist=[fn]), fn)()
        except (ImportError, AttributeError):
            pass


class Progress:
    """``total`` units of work named ``desc``. ``phase(text)`` names what is running now; ``advance(n, **info)``
    moves on and shows ``info`` (e.g. tokens/s). Disabled: silent. Not a terminal: a log line per phase and update."""

    def __init__(self, desc: str, total: int, *, unit: str = "it", enabled: bool = True, initial: int = 0):
        self.desc, self.total, self.done, self.initial = desc, total, initial, initial
        self.enabled = enabled
        self.start = self._last_beat = time.perf_counter()
        self._phase = ""
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True)

    def phase(self, text: str) -> None:
        """A new phase starts: shown on the bar, or one log line."""
        if not self.enabled:
            return
        self._phase, self._last_beat = text, time.perf_counter()
        if self.bar is not None:
            self.bar.set_description_str(f"{self.desc} · {text}")
        else:
            log.info("%s %d/%d: %s", self.desc, self.done, self.total, text)

    def heartbeat(self, detail: str) -> None:
        """Progress inside the current phase (a generated token, a micro-batch): the bar is refreshed at most
        twice a second, a log line written at most every ``PLAIN_HEARTBEAT_S`` seconds."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.bar is not None and now - self._last_beat >= 0.5:
            self.bar.set_description_str(f"{self.desc} · {self._phase} · {detail}")
        elif self.bar is None and now - self._last_beat >= PLAIN_HEARTBEAT_S:
            log.info("%s %d/%d: %s, %s", self.desc, self.done, self.total, self._phase, detail)
        else:
            return
        self._last_beat = now

    def token_heartbeat(self, tokens: int, max_tokens: int) -> None:
        """A generator's per-token callback (``on_token``)."""
        self.heartbeat(f"token {tokens}/{max_tokens}")

    @property
    def on_token(self):
        """The callback to hand a generator, or None when nothing is shown (no per-token streamer then)."""
        return self.token_heartbeat if self.enabled else None

    def advance(self, n: int = 1, **info: Any) -> None:
        self.done += n
        if not self.enabled:
            return
        shown = {k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in info.items()}
        if self.bar is not None:
            self.bar.set_description_str(self.desc)
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(n)
        else:
            elapsed = time.perf_counter() - self.start
            eta = elapsed / max(self.done - self.initial, 1) * (self.total - self.done)
            extra = " ".join(f"{k}={v}" for k, v in shown.items())
            log.info("%s %d/%d (%.0f s, eta %.0f s) %s", self.desc, self.done, self.total, elapsed, eta, extra)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
