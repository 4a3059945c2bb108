"""The leaf every layer may import: the configuration error, the bounded text its messages are made of, and the
one interpreter of the config keys' declared rules (:func:`check_rule`).

It imports nothing of cegppo's, so ``algorithm`` (pure torch) can raise the same :class:`ConfigError` that the
config loader raises, without a cycle through :mod:`cegppo.config`.
"""

from __future__ import annotations

import errno
import math
import os
import re
import reprlib
from typing import Any

MAX_MESSAGE_CHARS = 1000  # an error message, whatever values it quotes

# what model.device / --device accept: auto, cpu, cuda, cuda:N
DEVICES = re.compile(r"auto|cpu|cuda(:\d+)?")


def one_line(text: object, limit: int = 300) -> str:
    """``text`` with all whitespace runs collapsed, cut to ``limit`` characters (for one-line error messages)."""
    return " ".join(str(text).split())[:limit]


def dangling_link(path: str | os.PathLike) -> tuple[str, str] | None:
    """(link, its target) for the first component of ``path`` that is a symbolic link to nothing; None if none."""
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts) + 1):
        probe = os.sep.join(parts[:i])
        if os.path.islink(probe) and not os.path.exists(probe):
            try:
                return probe, os.readlink(probe)
            except OSError:
                return probe, "?"
        if not os.path.lexists(probe):
            return None
    return None


def os_error_text(e: OSError) -> str:
    """``<file>: <what went wrong> (<ERRNO>)``: the file an OS error concerns and why, in words; a path through a
    symbolic link to nothing is named as that link (the errno alone says "No such file" or "File exists")."""
    code = errno.errorcode.get(e.errno, "") if e.errno is not None else ""
    what = e.strerror or (os.strerror(e.errno) if e.errno is not None else str(e)) or type(e).__name__
    files = [f for f in (e.filename, e.filename2) if f is not None]
    for f in files:
        link = dangling_link(os.fsdecode(f))
        if link is not None:  # the errno's words ("File exists", "No such file") would mislead
            at = "" if os.path.abspath(os.fsdecode(f)) == link[0] else f"{link[0]} is "
            what = f"{at}a symbolic link to {link[1]!r}, which does not exist"
            break
    where = " -> ".join(os.fsdecode(f) for f in files)
    return one_line(f"{where + ': ' if where else ''}{what}{f' ({code})' if code else ''}", MAX_MESSAGE_CHARS)


def _within(path: str, root: str) -> bool:
    """``path`` is ``root``, inside it, or inside one of the temporary siblings an output is written into before it
    is moved into place (``.tmp-<name>-<pid>``, ``.<name>.tmp-<pid>``, ``.<name>.cegppo-lock``)."""
    if path == root or path.startswith(root.rstrip(os.sep) + os.sep):
        return True
    parent, name = os.path.split(root.rstrip(os.sep))
    rest = os.path.relpath(path, parent) if parent else path
    first = rest.split(os.sep, 1)[0]
    return not rest.startswith("..") and first.startswith((f".tmp-{name}-", f".{name}.tmp-", f".{name}.cegppo-lock"))


Settings = "dict[str, str] | list[tuple[str, str]]"  # {key: path} or (key, path) pairs (a flag given twice)


def setting_of(path: str | os.PathLike, settings: Settings) -> tuple[str, str] | None:
    """The setting (``{key: path}``, e.g. ``{"output_dir": "runs/x"}``) whose path is ``path`` or holds it, the
    most specific first; paths are compared as given and with symbolic links resolved."""
    found = []
    for key, value in (settings.items() if isinstance(settings, dict) else settings):
        if not value:
            continue
        for a, b in ((os.path.abspath(path), os.path.abspath(value)),
                     (os.path.realpath(path), os.path.realpath(value))):
            if _within(a, b):
                found.append((len(b), key, value))
                break
    return max(found)[1:] if found else None


def describe_os_error(e: OSError, settings: Settings) -> str:
    """One line for an OS error (a full disk, a symbolic link to nothing, an unwritable directory): the file, what
    went wrong, and the setting it came from (``settings``: ``{key: path}``) with what to do."""
    text = os_error_text(e)
    files = [os.fsdecode(f) for f in (e.filename, e.filename2) if f is not None]
    for f in files:
        hit = setting_of(f, settings)
        if hit is not None:
            key, value = hit
            return one_line(f"{text}; it is {'' if _same(f, value) else 'under '}{key} {value}: fix that, or set "
                            f"{key} to another path", MAX_MESSAGE_CHARS)
    return text


def _same(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


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


# ----------------------------------------------------------------------------------------------- declared rules
# A config key declares its rule as plain data in its dataclass field's ``metadata["range"]``
# (:func:`cegppo.config.schema.key`); :func:`check_rule` is the one code that reads it. The vocabulary:
#   ge / gt / le / lt  numeric bounds; ``also``: values allowed besides them (e.g. 0 = off)
#   choices            the allowed values (None among them: null)
#   nonempty           text with a non-blank character; pattern: a regular expression the whole text matches
#   items              a list of exactly this many numbers, each within the bounds
#   free               checked elsewhere (the text says where): skipped here
#   cross              the keys whose values can refuse an in-range value (the caller's cross-field checks)
# and the words of the message: says (what a text key holds, e.g. "a non-empty path"), unit, note (a parenthesis).

MAX_INT = 2**63 - 1  # every integer setting (seeds, counts) fits a signed 64-bit integer
_COUNTS = {1: "one", 2: "two", 3: "three", 4: "four"}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_kind(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool) and -MAX_INT - 1 <= value <= MAX_INT
    return _is_number(value) and not (isinstance(value, float) and not math.isfinite(value))


def _in_bounds(value: Any, rule: dict) -> bool:
    if not _is_kind(value, float):
        return False
    if value in rule.get("also", ()):
        return True
    return (value >= rule.get("ge", value) and value <= rule.get("le", value)
            and ("gt" not in rule or value > rule["gt"]) and ("lt" not in rule or value < rule["lt"]))


def _number(bound: Any) -> str:
    return str(bound) if isinstance(bound, int) or not float(bound).is_integer() else str(int(bound))


def _bounds_text(rule: dict, noun: str, integer: bool) -> str:
    """The bounds in the wording the messages have always had: ``in 1..5`` (integers), ``a finite number >= 0
    and <= 1`` (a closed float range), ``in (0, 1]`` (a range with an open end), ``>= 0`` / ``a finite number > 0``."""
    low = next(((op, rule[name]) for name, op in (("ge", ">="), ("gt", ">")) if name in rule), None)
    high = next(((op, rule[name]) for name, op in (("le", "<="), ("lt", "<")) if name in rule), None)
    if low and high:
        if low[0] == ">=" and high[0] == "<=":
            text = (f"in {_number(low[1])}..{_number(high[1])}" if integer
                    else f">= {_number(low[1])} and <= {_number(high[1])}")
        else:
            return (f"in {'[' if low[0] == '>=' else '('}{_number(low[1])}, {_number(high[1])}"
                    f"{']' if high[0] == '<=' else ')'}")
    elif low or high:
        op, bound = low or high
        text = f"{op} {_number(bound)}"
    else:
        text = ""
    return f"{noun} {text}".strip()


def _choices_text(choices: tuple) -> str:
    # beside YAML's booleans a word is written bare, as it is typed (true, false or auto); other text is quoted
    bare = any(isinstance(c, bool) for c in choices)
    words = ["null" if c is None else str(c).lower() if isinstance(c, bool) else str(c) if bare else repr(c)
             for c in choices]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def expected(rule: dict, kind: type = float, *, name_kind: bool = False) -> str:
    """What ``rule`` admits, in words (the part of :func:`check_rule`'s message after "must be"). ``kind`` is the
    value's type (int or float); an integer is named as one (``an integer >= 1``) only with ``name_kind``."""
    if "choices" in rule:
        text = _choices_text(tuple(rule["choices"]))
    elif "nonempty" in rule or "pattern" in rule:
        text = rule.get("says") or ("non-empty text" if "nonempty" in rule else f"text matching {rule['pattern']!r}")
    elif "items" in rule:
        n = rule["items"]
        text = f"{_COUNTS.get(n, n)} number{'s' * (n != 1)} {_bounds_text(rule, '', False)}".strip()
    else:
        noun = "a finite number" if kind is not int else "an integer" if name_kind else ""
        text = _bounds_text(rule, noun, kind is int)
        if rule.get("also"):
            text = " or ".join([*(_number(a) for a in rule["also"]), text])
    if rule.get("unit"):
        text += f" {rule['unit']}"
    return text + (f" ({rule['note']})" if rule.get("note") else "")


def check_rule(value: Any, rule: dict, where: str, kind: type | None = None) -> None:
    """Refuse ``value`` of key ``where`` unless it satisfies its declared ``rule``: a :class:`ConfigError` of one
    line, ``<where> must be <what the rule admits>, got <value>``. ``free`` rules are checked elsewhere, ``cross``
    ones by the caller. Without ``kind`` the value's type was checked before (a loaded config); with ``kind`` (int
    or float: a command-line flag, say) it is checked here too, and the message names it (``an integer >= 1``)."""
    if "free" in rule:
        return
    if "choices" in rule:
        ok = any(value == c and type(value) is type(c) for c in rule["choices"])
    elif "nonempty" in rule or "pattern" in rule:
        ok = (isinstance(value, str) and (not rule.get("nonempty") or value.strip() != "")
              and ("pattern" not in rule or re.fullmatch(rule["pattern"], value) is not None))
    elif "items" in rule:
        ok = isinstance(value, list) and len(value) == rule["items"] and all(_in_bounds(v, rule) for v in value)
    elif any(b in rule for b in ("ge", "gt", "le", "lt", "also")):
        ok = (kind is None or _is_kind(value, kind)) and _in_bounds(value, rule)
    else:
        return  # a boolean, or a key whose type is its whole rule
    if not ok:
        of = kind or (int if isinstance(value, int) and not isinstance(value, bool) else float)
        raise ConfigError(f"{where} must be {expected(rule, of, name_kind=kind is not None)}, got {show(value)}")
