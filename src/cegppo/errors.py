"""The leaf every layer may import: the configuration error and the bounded text its messages are made of.

It imports nothing of cegppo's, so ``algorithm`` (pure torch) can raise the same :class:`ConfigError` that the
config loader raises, without a cycle through :mod:`cegppo.config`.
"""

from __future__ import annotations

import re
import reprlib
from typing import Any

MAX_MESSAGE_CHARS = 1000  # an error message, whatever values it quotes

# what model.device / --device accept: auto, cpu, cuda, cuda:N
DEVICES = re.compile(r"auto|cpu|cuda(:\d+)?")


def one_line(text: object, limit: int = 300) -> str:
    """``text`` with all whitespace runs collapsed, cut to ``limit`` characters (for one-line error messages)."""
    return " ".join(str(text).split())[:limit]


class ConfigError(ValueError):
    """A configuration problem, with the key (and file) it concerns. Always one line of bounded length."""

    def __init__(self, message: object = "") -> None:
        super().__init__(one_line(message, MAX_MESSAGE_CHARS))


_REPR = reprlib.Repr()
_REPR.maxstring = 60
_REPR.maxother = 60
_REPR.maxlong = 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6
_REPR.maxlevel = 3


def show(value: Any, limit: int = 80) -> str:
    """A bounded one-line repr of ``value`` for an error message (a value read from a file can be any size)."""
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001 - e.g. an integer too long to print; never let a message fail
        text = f"<{type(value).__name__}>"
    return one_line(text, limit)
