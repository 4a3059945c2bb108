"""The shared problem record and dataset loading (verl and plain schemas; JSONL, JSON, Parquet).

Errors are `DatasetError`s that name the file and row (`data.jsonl:17` for JSON lines — 1-based line
numbers; `data.json[16]` for JSON arrays and Parquet — 0-based row index) and say what was expected.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from cegppo.data.evalsets import EVAL_SETS, bundled_source, resolve_dataset
from cegppo.io import one_line

log = logging.getLogger(__name__)

SCHEMAS = ("auto", "verl", "plain")
VERL_HELP = "expected the verl schema: prompt=[{role, content}], reward_model.ground_truth=str"
PLAIN_HELP = "expected the plain schema: question (or problem)=str, answer=str, optional solution=str, id"
_PLAIN_PROMPT_KEYS = ("question", "problem")
_MISSING = object()


class DatasetError(ValueError):
    """A dataset file could not be read; the message names file, row and key. Always one line of bounded
    length, whatever value it quotes."""

    def __init__(self, message: object = "") -> None:
        super().__init__(one_line(message, 1000))


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer. `copies` counts identical rows merged into this one."""

    id: str
    messages: list[dict]  # chat messages [{"role": ..., "content": ...}]
    answer: str
    solution: str | None = None  # reference solution ending in \boxed{answer} (SFT warm-start)
    data_source: str = ""
    copies: int = 1

    def __hash__(self) -> int:
        # The generated hash would fail on the `messages` list; hash an immutable view instead.
        return hash((self.id, self.answer, tuple((m["role"], m["content"]) for m in self.messages)))

    @property
    def prompt_text(self) -> str:
        """Content of the last user message (the question itself)."""
        return next(m["content"] for m in reversed(self.messages) if m["role"] == "user")


def _canonical(messages: list[dict]) -> str:
    """Canonical JSON of a prompt's messages (role and content only): its id source and dedupe key."""
    return json.dumps([{"role": m["role"], "content": m["content"]} for m in messages],
                      ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def _id_of(canon: str) -> str:
    return hashlib.sha1(canon.encode("utf-8")).hexdigest()[:12]


def prompt_id(messages: list[dict]) -> str:
    """Stable id of a prompt: first 12 hex of sha1 of the canonical JSON of its messages."""
    return _id_of(_canonical(messages))


# ----------------------------------------------------------------------------------------------------
# reading rows


_MAGIC = ((b"\x1f\x8b", "gzip-compressed"), (b"BZh", "bzip2-compressed"), (b"\xfd7zXZ\x00", "xz-compressed"),
          (b"\x28\xb5\x2f\xfd", "zstd-compressed"), (b"PK\x03\x04", "a zip archive"), (b"PAR1", "a Parquet file"),
          (b"\xff\xfe", "UTF-16 text"), (b"\xfe\xff", "UTF-16 text"))
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_BOM = b"\xef\xbb\xbf"


def _sniff(path: Path, expected: str) -> None:
    """Refuse compressed or binary files by their first bytes, before trying to read them as text."""
    with open(path, "rb") as fh:
        head = fh.read(8)
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            raise DatasetError(f"{path}:1: {kind}, not {expected} (decompress it, or convert it to UTF-8 JSON)")


def _decode(raw: bytes, path: Path, lineno: int | None = None) -> str:
    """UTF-8 text of one line (``lineno`` given) or a whole file; binary content (a NUL byte) and invalid UTF-8
    are reported as ``file:line`` with the byte's position in that line."""
    bad, what = raw.find(b"\x00"), "binary content (NUL byte"
    if bad < 0:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            bad, what = e.start, f"not UTF-8 text (byte 0x{raw[e.start]:02x}"
    if lineno is None:  # a whole file: find the line
        lineno = raw.count(b"\n", 0, bad) + 1
        bad -= raw.rfind(b"\n", 0, bad) + 1
    raise DatasetError(f"{path}:{lineno}: {what} at byte {bad + 1} of the line); expected UTF-8 JSON text")


def _loads(where: str, text: str, line_of: Any = None) -> Any:
    """json.loads with every failure as a DatasetError naming the location (``line_of(e)`` adds the line).
    Strings must be valid Unicode: an escaped unpaired surrogate (``"\\ud800"``) is refused (checked per row by
    the caller when ``line_of`` is given)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        at = f"{where}:{line_of(e)}" if line_of else where
        raise DatasetError(f"{at}: malformed JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise DatasetError(f"{where}: malformed JSON (nested too deeply)") from None
    except ValueError as e:  # e.g. an integer literal longer than Python converts
        raise DatasetError(f"{where}: malformed JSON ({e})") from None
    if line_of is None and _SURROGATE_ESCAPE.search(text):  # rare: only then pay for the exact check
        _check_unicode(where, obj)
    return obj


def _check_unicode(where: str, obj: Any) -> None:
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise DatasetError(f"{where}: a string holds an unpaired UTF-16 surrogate (\\ud800-\\udfff); not valid "
                           f"Unicode text") from None


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    # Read as bytes and parsed line by line, so that a malformed, binary or non-UTF-8 line is reported as
    # file:line. Lines end at \n, \r\n or \r (as text mode's universal newlines).
    _sniff(path, "JSON lines text")
    lineno = 0
    with open(path, "rb") as fh:
        for raw in fh:
            if lineno == 0 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            body = raw[:-1] if raw.endswith(b"\n") else raw
            if body.endswith(b"\r"):
                body = body[:-1]
            for part in body.split(b"\r") if b"\r" in body else (body,):
                lineno += 1
                loc = f"{path}:{lineno}"
                line = _decode(part, path, lineno)
                if not line.strip():
                    continue
                yield loc, _loads(loc, line)


def _iter_json(path: Path) -> Iterator[tuple[str, Any]]:
    _sniff(path, "JSON text")
    raw = path.read_bytes()
    if raw.startswith(_BOM):
        raw = raw[len(_BOM):]
    text = _decode(raw, path)
    if not text.lstrip().startswith("["):
        # A .json file that is not an array is read as JSON lines (a common mislabelling).
        yield from _iter_jsonl(path)
        return
    rows = _loads(str(path), text, line_of=lambda e: e.lineno)
    check = _SURROGATE_ESCAPE.search(text) is not None
    for i, row in enumerate(rows):
        if check:
            _check_unicode(f"{path}[{i}]", row)
        yield f"{path}[{i}]", row


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import datasets

    with open(path, "rb") as fh:
        head = fh.read(4)
    if head != b"PAR1":
        kind = next((k for magic, k in _MAGIC if head.startswith(magic[:4])), None)
        raise DatasetError(f"{path}: could not read Parquet file (no PAR1 header{'; it is ' + kind if kind else ''}: "
                           f"starts with {head!r})")
    try:
        ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
    except Exception as e:  # noqa: BLE001 - any reader failure is a bad file
        raise DatasetError(f"{path}: could not read Parquet file ({type(e).__name__}: {e})") from e
    for i, row in enumerate(ds):
        yield f"{path}[{i}]", row


_READERS = {".jsonl": _iter_jsonl, ".json": _iter_json, ".parquet": _iter_parquet}


# ----------------------------------------------------------------------------------------------------
# row -> fields


def _get(row: dict, dotted: str) -> Any:
    """Nested lookup: 'reward_model.ground_truth' -> row['reward_model']['ground_truth']."""
    cur: Any = row
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return _MISSING
        cur = cur[part]
    return cur


def _detect_schema(loc: str, row: dict, prompt_key: str | None) -> str:
    if "reward_model" in row or isinstance(row.get(prompt_key or "prompt"), list):
        return "verl"
    if any(k in row for k in _PLAIN_PROMPT_KEYS) or (prompt_key and isinstance(row.get(prompt_key), str)):
        return "plain"
    raise DatasetError(f"{loc}: cannot detect the schema from keys {sorted(row)}; {VERL_HELP}; or "
                       f"{PLAIN_HELP} (or pass schema=/prompt_key=/answer_key=)")


def _messages(loc: str, value: str | list, key: str) -> list[dict]:
    # `_parse_row` has already checked the type: a list (verl) or a str (plain).
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"{loc}: empty prompt in {key!r}")
        return [{"role": "user", "content": value}]
    if not value:
        raise DatasetError(f"{loc}: empty prompt: {key!r} is an empty list")
    msgs = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DatasetError(f"{loc}: {key}[{j}] is {m!r:.80}; expected {{'role': str, 'content': str}}")
        msgs.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" for m in msgs):
        raise DatasetError(f"{loc}: {key!r} has no message with role 'user'")
    if not any(m["content"].strip() for m in msgs):
        raise DatasetError(f"{loc}: empty prompt: every message in {key!r} has empty content")
    return msgs


def _answer(loc: str, value: Any, key: str, help_: str) -> tuple[str, bool]:
    """Return (answer, converted): converted is True when a number was turned into a string."""
    if value is _MISSING:
        raise DatasetError(f"{loc}: missing {key!r} ({help_})")
    # bool is an int subclass but never a meaningful math answer.
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DatasetError(f"{loc}: {key!r} is {type(value).__name__} ({value!r:.60}); expected a string "
                           f"(numbers are accepted and converted)")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DatasetError(f"{loc}: {key!r} is {value!r}; expected a finite number or a string")
        return (str(int(value)) if value.is_integer() else repr(value)), True
    if isinstance(value, int):
        return str(value), True
    if not value.strip():
        raise DatasetError(f"{loc}: {key!r} is an empty string")
    return value.strip(), False


def _optional_str(loc: str, row: dict, key: str) -> str | None:
    v = _get(row, key)
    if v is _MISSING or v is None:
        return None
    if not isinstance(v, str):
        raise DatasetError(f"{loc}: {key!r} is {type(v).__name__}; expected a string")
    return v


def _parse_row(loc: str, row: Any, schema: str, keys: dict[str, str | None], default_source: str,
               explicit_source: str | None) -> tuple[Problem, bool, bool, str]:
    """Return (problem, has_explicit_id, answer_was_numeric, canonical JSON of the messages)."""
    if not isinstance(row, dict):
        raise DatasetError(f"{loc}: row is {type(row).__name__}; expected a JSON object")
    help_ = VERL_HELP if schema == "verl" else PLAIN_HELP
    # prompt
    if keys["prompt"]:
        pkey = keys["prompt"]
    elif schema == "verl":
        pkey = "prompt"
    else:
        pkey = next((k for k in _PLAIN_PROMPT_KEYS if k in row), "question")
    pval = _get(row, pkey)
    if pval is _MISSING:
        raise DatasetError(f"{loc}: missing {pkey!r} ({help_})")
    if schema == "verl" and not isinstance(pval, list):
        raise DatasetError(f"{loc}: {pkey!r} is {type(pval).__name__}; {VERL_HELP}")
    if schema == "plain" and not isinstance(pval, str):
        raise DatasetError(f"{loc}: {pkey!r} is {type(pval).__name__}; {PLAIN_HELP}")
    messages = _messages(loc, pval, pkey)
    canon = _canonical(messages)
    # answer
    akey = keys["answer"] or ("reward_model.ground_truth" if schema == "verl" else "answer")
    answer, converted = _answer(loc, _get(row, akey), akey, help_)
    # id: explicit column if configured (then required) or a plain 'id' column if present
    ikey = keys["id"] or ("id" if schema == "plain" else None)
    pid: str | None = None
    if ikey is not None:
        v = _get(row, ikey)
        if v is _MISSING or v is None:
            if keys["id"]:
                raise DatasetError(f"{loc}: missing id column {ikey!r} (passed as id_key)")
        elif isinstance(v, bool) or not isinstance(v, (str, int)) or not str(v).strip():
            raise DatasetError(f"{loc}: id {ikey!r} is {v!r:.60}; expected a non-empty string or an int")
        else:
            pid = str(v)
    has_id = pid is not None
    if pid is None:
        pid = _id_of(canon)
    # solution
    skey = keys["solution"] or ("solution" if schema == "plain" else None)
    solution = _optional_str(loc, row, skey) if skey else None
    if keys["solution"] and solution is None:
        raise DatasetError(f"{loc}: missing solution column {skey!r} (passed as solution_key)")
    # data source: argument > row > file stem
    if explicit_source is not None:
        source = explicit_source
    else:
        src = _get(row, "data_source")
        if src is not _MISSING and src is not None and not isinstance(src, str):
            raise DatasetError(f"{loc}: 'data_source' is {type(src).__name__}; expected a string")
        source = src if isinstance(src, str) and src else default_source
    prob = Problem(id=pid, messages=messages, answer=answer, solution=solution, data_source=source)
    return prob, has_id, converted, canon


# ----------------------------------------------------------------------------------------------------
# public API


def load_problems(path: str | Path, *, schema: str = "auto", prompt_key: str | None = None,
                  answer_key: str | None = None, id_key: str | None = None, data_source: str | None = None,
                  dedupe: bool = True, solution_key: str | None = None) -> list[Problem]:
    """Load problems from a local .jsonl / .json / .parquet file, or a bundled evaluation set by name.

    path: a file, or the name of a set in `cegppo.data.evalsets.EVAL_SETS` (`aime24`, `aime25`); an
    existing file always wins over a name.

    schema: "verl" (prompt=list of messages, reward_model.ground_truth, data_source), "plain"
    (question|problem, answer, optional solution and id) or "auto" (detected from the first row).
    Keys may be dotted paths into nested objects. Rows with identical messages and answer are merged
    (copies counted) when dedupe=True; the same prompt with two different answers is always an error.
    Without an id column the id is `prompt_id(messages)`. data_source: argument, else the bundled set's
    readable name ("AIME 2024") for a bundled file, else the row's 'data_source', else the file stem.
    """
    path = Path(path)
    if not path.is_file():  # an existing file wins over a bundled set's name
        path = resolve_dataset(str(path)) or path
    if data_source is None:
        data_source = bundled_source(path)
    if schema not in SCHEMAS:
        raise ValueError(f"schema must be one of {SCHEMAS}, got {schema!r}")
    if not path.exists():
        raise DatasetError(f"{path}: file not found (nor the name of a bundled evaluation set: "
                           f"{', '.join(EVAL_SETS)})")
    if not path.is_file():
        raise DatasetError(f"{path}: not a file")
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise DatasetError(f"{path}: unknown extension {path.suffix!r}; expected one of {sorted(_READERS)}")
    keys = {"prompt": prompt_key, "answer": answer_key, "id": id_key, "solution": solution_key}

    problems: list[Problem] = []
    first: dict[str, tuple[int, str]] = {}  # prompt key -> (index in problems, location of its first row)
    id_owner: dict[str, tuple[str, str]] = {}  # explicit id -> (content key, location)
    converted = 0
    for loc, row in reader(path):
        if schema == "auto":  # first row only: detection replaces "auto" (or raises)
            if not isinstance(row, dict):
                raise DatasetError(f"{loc}: row is {type(row).__name__}; expected a JSON object")
            schema = _detect_schema(loc, row, prompt_key)
        prob, has_id, numeric, pkey = _parse_row(loc, row, schema, keys, path.stem, data_source)
        converted += numeric
        content = pkey + "\x00" + prob.answer
        if has_id:
            prev = id_owner.get(prob.id)
            if prev is not None and prev[0] != content:
                raise DatasetError(f"{loc}: id {prob.id!r} was already used by {prev[1]} for a different "
                                   f"prompt or answer; ids must be unique")
            id_owner.setdefault(prob.id, (content, loc))
        if pkey in first:
            j, first_loc = first[pkey]
            if problems[j].answer != prob.answer:
                raise DatasetError(f"{loc}: same prompt as {first_loc} but a different answer "
                                   f"({prob.answer!r} vs {problems[j].answer!r})")
            if dedupe:
                old = problems[j]
                if prob.solution is not None and old.solution is not None and prob.solution != old.solution:
                    log.warning("%s: duplicate of %s with a different solution; keeping the first",
                                loc, first_loc)
                problems[j] = Problem(id=old.id, messages=old.messages, answer=old.answer,
                                      solution=old.solution if old.solution is not None else prob.solution,
                                      data_source=old.data_source, copies=old.copies + 1)
                continue
        else:
            first[pkey] = (len(problems), loc)
        problems.append(prob)
    if not problems:
        raise DatasetError(f"{path}: no rows")
    if converted:
        log.info("%s: %d numeric answers converted to strings", path, converted)
    return problems
