"""Loading a config: YAML files and dotted ``key=value`` overrides onto the schema's dataclasses, then validation.

Config files are untrusted input: they are read with a size cap, must be UTF-8, are parsed with the safe
(C, where available) YAML loader after a cheap pass over the event stream that bounds nesting depth and the
node count after alias expansion ("billion laughs"), and every error is one bounded line.

Numbers follow YAML 1.2 (core schema), in files and in overrides alike: ``010`` is 10 and ``0777`` is 777 (YAML 1.1
read them as octal: 8, 511), ``0o17`` is 15, ``0x1F`` is 31, ``1e3`` is the float 1000.0, and ``1:30`` or ``1_000``
are text (YAML 1.1 read them as 90 and 1000), which a numeric key refuses naming the key. Booleans, nulls and the
rest stay as PyYAML's safe loader reads them. ``save_config`` quotes any text that YAML 1.1 or 1.2 would read as a
number, so a saved config reads back the same under either.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from pathlib import Path
from typing import Any

import yaml

from cegppo.config.schema import Config
from cegppo.config.validation import check_type, validate
from cegppo.errors import ConfigError, show
from cegppo.io import atomic_write_text

MAX_CONFIG_BYTES = 1 << 20  # a config file (or one override) larger than 1 MiB is refused
MAX_YAML_NODES = 100_000  # YAML nodes after alias expansion (a real config has about a hundred)
MAX_YAML_DEPTH = 64  # nesting of YAML collections
MAX_BASE_DEPTH = 16  # `base:` chain length


_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C parser where PyYAML was built with libyaml
_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
# YAML 1.2 core schema (yaml.org/spec/1.2.2, 10.3.2): the only plain scalars that are numbers
_INT_12 = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT_12 = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                       r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")


def _resolvers_12(base: dict, *, keep_11: bool) -> dict:
    """``base``'s implicit resolvers with YAML 1.2's int and float ones, which are tried first; ``keep_11`` keeps
    YAML 1.1's too (for the dumper, which quotes text that either would read as a number)."""
    out = {ch: [(tag, rx) for tag, rx in lst if keep_11 or tag not in (_INT, _FLOAT)] for ch, lst in base.items()}
    for ch in "-+.0123456789":  # int first, then float: "10" is an int; both before 1.1's (timestamp, ...)
        ours = [(_INT, _INT_12)] * (ch != ".") + [(_FLOAT, _FLOAT_12)]
        out[ch] = ours + out.get(ch, [])
    return out


def _int_12(loader: Any, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text, 10)  # a leading zero is decimal: "010" is 10


def _float_12(loader: Any, node: yaml.ScalarNode) -> float:
    text = loader.construct_scalar(node)
    special = {".inf": "inf", "+.inf": "inf", "-.inf": "-inf", ".nan": "nan"}.get(text.lower())
    return float(special or text)


class _Loader(_SAFE_LOADER):  # type: ignore[misc, valid-type]
    """The safe loader with YAML 1.2 numbers."""

    yaml_implicit_resolvers = _resolvers_12(_SAFE_LOADER.yaml_implicit_resolvers, keep_11=False)


_Loader.add_constructor(_INT, _int_12)
_Loader.add_constructor(_FLOAT, _float_12)
_LOADER = _Loader


class _Dumper(yaml.SafeDumper):
    """``yaml.safe_dump`` that also quotes text YAML 1.2 reads as a number (``1e3``, ``0o17``)."""

    yaml_implicit_resolvers = _resolvers_12(yaml.SafeDumper.yaml_implicit_resolvers, keep_11=True)


def _check_yaml_events(loader: Any, source: str) -> None:
    """One pass over the event stream (nothing constructed): bound nesting depth and the number of nodes after
    alias expansion, and refuse recursive aliases. A 400-byte "billion laughs" document fails here at once."""
    sizes: dict[str, int] = {}  # anchor -> its node count, aliases expanded
    stack: list[list] = []  # open collections: [anchor, node count so far]
    total = 0
    while loader.check_event():
        ev = loader.get_event()
        if isinstance(ev, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            if len(stack) >= MAX_YAML_DEPTH:
                raise ConfigError(f"{source}: YAML nested deeper than {MAX_YAML_DEPTH} levels; refused")
            stack.append([ev.anchor, 1])
            continue
        if isinstance(ev, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            anchor, n = stack.pop()
            if anchor is not None:
                sizes[anchor] = n
        elif isinstance(ev, yaml.ScalarEvent):
            n = 1
            if ev.anchor is not None:
                sizes[ev.anchor] = 1
        elif isinstance(ev, yaml.AliasEvent):
            if any(anchor == ev.anchor for anchor, _ in stack):
                raise ConfigError(f"{source}: recursive YAML alias *{show(ev.anchor, 40)} (an anchor used inside "
                                  f"itself); refused")
            n = sizes.get(ev.anchor, 1)  # an undefined alias is reported by the composer
        else:
            continue  # stream and document boundaries
        if stack:
            stack[-1][1] += n
            count = stack[-1][1]
        else:
            total += n
            count = total
        if count > MAX_YAML_NODES:
            raise ConfigError(f"{source}: YAML expands to more than {MAX_YAML_NODES} nodes (aliases included); "
                              f"refused (a config has about a hundred)")


def _yaml_error(source: str, e: BaseException) -> ConfigError:
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is not None and problem:
        context = getattr(e, "context", None)
        return ConfigError(f"{source}: not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {problem}"
                           + (f" ({context})" if context else ""))
    return ConfigError(f"{source}: not valid YAML: {type(e).__name__}: {e}")


def load_yaml(text: str, source: str) -> Any:
    """Parse one YAML document with the safe loader, bounded as :func:`_check_yaml_events`; any failure is a
    one-line :class:`ConfigError` that starts with ``source``."""
    try:
        for construct in (False, True):
            loader = _LOADER(text)
            try:
                if not construct:
                    _check_yaml_events(loader, source)
                else:
                    return loader.get_single_data()
            finally:
                loader.dispose()
    except ConfigError:
        raise
    except yaml.YAMLError as e:
        raise _yaml_error(source, e) from None
    except Exception as e:  # noqa: BLE001 - e.g. an integer too long to convert, text that cannot be encoded
        raise ConfigError(f"{source}: not valid YAML: {type(e).__name__}: {e}") from None


def read_config_text(path: Path, source: str | None = None) -> str:
    """The text of a config file: at most MAX_CONFIG_BYTES, UTF-8; else a one-line ConfigError."""
    source = source or str(path)
    if not path.exists():
        if path.is_symlink():
            raise ConfigError(f"config file {source} is a symbolic link to {os.readlink(path)!r}, which does not exist")
        raise ConfigError(f"config file {source} does not exist")
    if not path.is_file():
        raise ConfigError(f"config file {source} is not a regular file")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"config file {source} cannot be read: {e.strerror or type(e).__name__}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source}: config file larger than {MAX_CONFIG_BYTES >> 10} KiB; refused (a config is "
                          f"a few KB of YAML)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{source}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x}); a config must be UTF-8 "
                          f"YAML") from None


# ---------------------------------------------------------------------------------------------------------
# building the dataclasses


def _build(cls: type, data: dict, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__} {show(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        key = f"{where}.{unknown[0]}" if where else str(unknown[0])
        raise ConfigError(f"unknown config key {show(key)}; valid keys{' in ' + where if where else ''}: "
                          f"{sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        key = f"{where}.{name}" if where else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, key)
        else:
            kwargs[name] = check_type(value, tp, key)
    return cls(**kwargs)


class _Replace(dict):
    """An override whose value is a whole mapping: it replaces the section instead of merging into it."""


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if not all(p.strip() for p in parts) or len(parts) > MAX_YAML_DEPTH:
        raise ConfigError(f"override key {show(dotted)}: expected dotted names such as train.steps")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {show(dotted)}: {show(p)} is not a section")
    node[parts[-1]] = _Replace(value) if isinstance(value, dict) else value


def parse_overrides(overrides: list[str]) -> dict:
    """``["algorithm.hparams.beta1=0.5", "train.steps=3"]`` -> nested dict (values parsed as YAML scalars).

    ``algorithm.hparams={}`` replaces the whole mapping; ``algorithm.hparams.beta1=0.5`` changes one entry.
    Values are parsed with the same bounded loader as config files.
    """
    tree: dict = {}
    for item in overrides:
        if not isinstance(item, str):
            raise ConfigError(f"override {show(item)}: expected a key=value string")
        if len(item) > MAX_CONFIG_BYTES:
            raise ConfigError(f"override {show(item)}: longer than {MAX_CONFIG_BYTES >> 10} KiB; refused")
        if "=" not in item:
            raise ConfigError(f"override {show(item)}: expected key=value, e.g. train.steps=10")
        key, raw = item.split("=", 1)
        value = load_yaml(raw, f"override {show(item)}") if raw != "" else ""
        _set_dotted(tree, key.strip(), value)
    return tree


def _plain(v: Any) -> Any:
    return {k: _plain(x) for k, x in v.items()} if isinstance(v, dict) else v


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and not isinstance(v, _Replace) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = _plain(v)
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or the defaults), apply overrides, validate. Raises :class:`ConfigError`.

    A config may extend another with ``base: other.yaml`` (relative to its own directory); the base is loaded
    and validated first, cycles and chains longer than MAX_BASE_DEPTH are refused.
    """
    return _load(path, list(overrides or []), ())


def _load(path: str | Path | None, overrides: list[str], chain: tuple[str, ...]) -> Config:
    tree: dict = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        p = Path(path)
        tree = load_yaml(read_config_text(p, source), source)
        if tree is None:
            tree = {}
        if not isinstance(tree, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of config sections (output_dir, model, "
                              f"data, ...), got {type(tree).__name__} {show(tree)}")
        base = tree.pop("base", None)  # a config may extend another, relative to its own directory
        if base is not None:
            if not isinstance(base, str) or not base.strip() or "\x00" in base:
                raise ConfigError(f"{source}: base must be the path of another config file, got {show(base)}")
            seen = chain + (os.path.realpath(p),)
            base_path = p.parent / Path(base).expanduser()
            if os.path.realpath(base_path) in seen:
                cycle = " -> ".join(Path(x).name for x in (*seen, os.path.realpath(base_path)))
                raise ConfigError(f"{source}: 'base' cycle {cycle}; a config cannot extend itself")
            if len(seen) >= MAX_BASE_DEPTH:
                raise ConfigError(f"{source}: 'base' chain longer than {MAX_BASE_DEPTH} files; refused")
            parent = _load(base_path, [], seen).to_dict()
            tree = _merge(parent, tree)
    tree = _merge(tree, parse_overrides(overrides))
    try:
        cfg = _build(Config, tree, "")
        validate(cfg)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return cfg


def save_config(cfg: Config, path: Path) -> None:
    atomic_write_text(path, yaml.dump(cfg.to_dict(), Dumper=_Dumper, sort_keys=False))
