"""How the engine reports progress without importing the reporting layer: a small protocol that
:class:`cegppo.reporting.progress.Progress` implements, and :class:`Silent`, the engine's default."""

from __future__ import annotations

from typing import Any, Callable, Protocol


class Reporter(Protocol):
    """Progress of ``total`` units of work: ``phase`` names what runs now, ``heartbeat`` reports inside it,
    ``advance`` moves on with figures to show; ``on_token`` is a generator's per-token callback or None."""

    def phase(self, text: str) -> None: ...

    def heartbeat(self, detail: str) -> None: ...

    def advance(self, n: int = 1, **info: Any) -> None: ...

    def close(self) -> None: ...

    @property
    def on_token(self) -> Callable[[int, int], None] | None: ...


class Silent:
    """A reporter that shows nothing (no per-token callback, so generators skip their streamer)."""

    on_token = None

    def phase(self, text: str) -> None:
        pass

    def heartbeat(self, detail: str) -> None:
        pass

    def advance(self, n: int = 1, **info: Any) -> None:
        pass

    def close(self) -> None:
        pass
