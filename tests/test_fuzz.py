"""Property-based fuzzing of everything a user hands in as text: config overrides, YAML config files and dataset
rows. Every generated input either loads or raises the project's one-line error (ConfigError / DatasetError:
a single line of bounded length) — never another exception type, a hang, or a half-written file.
"""

import dataclasses
import functools
import json
import os
import tempfile
import typing
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cegppo.cli import example_config  # noqa: E402
from cegppo.config import Config, ConfigError, load_config, save_config  # noqa: E402
from cegppo.data.problems import DatasetError, Problem, load_problems  # noqa: E402

TINY = example_config("tiny")
MAX_MESSAGE = 1000
# Deterministic by default (same examples every run, ~1 s per test); CEGPPO_FUZZ_EXAMPLES=5000 runs a longer,
# randomised search.
_DEEP = int(os.environ.get("CEGPPO_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=_DEEP or 150, deadline=2000, suppress_health_check=[HealthCheck.too_slow],
                database=None, derandomize=not _DEEP)


@pytest.fixture(scope="module", autouse=True)
def _warm():
    try:  # the first validation imports torch: keep it out of the per-example deadline
        load_config(TINY)
    except ConfigError:
        pass  # a wrong rule in the schema: the tests below say which, not a setup error in each


def _one_line(e: BaseException) -> None:
    text = str(e)
    assert "\n" not in text and "\r" not in text and 0 < len(text) <= MAX_MESSAGE, text[:2000]


def _keys(cls: type = Config, where: str = "") -> list[str]:
    hints, out = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        key = f"{where}.{f.name}" if where else f.name
        out += _keys(hints[f.name], key) if dataclasses.is_dataclass(hints[f.name]) else [key]
    return out


KEYS = _keys() + ["algorithm.hparams.beta1", "algorithm.hparams.eps_low", "algorithm.hparams.clip_ratio_c"]

# ------------------------------------------------------------------------------------------- YAML-ish values

SPECIAL = [".nan", ".inf", "-.inf", "nan", "inf", "1e999", "-0", "0", "1", "-1", "2", "0.5", "1.0e-3", "1e-6", "~",
           "null", "true", "no", "yes", "''", '""', "[]", "{}", "[0.9, 0.999]", "[1]", "{beta1: 0.5}", "&a [*a]",
           "*undefined", "!!python/object:os.system x", "2020-01-01", "0x1F", "0o17", "1_000", "9" * 30, "9" * 400,
           "9" * 5000, "'~/x'", "/tmp/x", "a: b", "[", "{", "- a", "'", '"\\ud800"', "\t", "%YAML 1.1", "---", "!x y",
           "? [a]\n: b", "<<: {a: 1}", "{<<: {a: 1}}", "[" * 70 + "]" * 70, "x" * 2000, "grpo", "rloo", "dr_grpo",
           "fp32", "hf", "arithmetic", "math-strict", "fixtures.rewards:digit_overlap", "tiny", "bf16-autocast"]

scalars = st.one_of(
    st.integers(), st.integers(min_value=-3, max_value=40),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(min_value=0, max_value=1),
    st.booleans(), st.none(), st.text(max_size=30),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def _as_yaml(v) -> str:
    return json.dumps(v, allow_nan=False) if _finite(v) else str(v)


def _finite(v) -> bool:
    try:
        json.dumps(v, allow_nan=False)
        return True
    except ValueError:
        return False


raw_values = st.one_of(st.sampled_from(SPECIAL), values.map(_as_yaml), st.text(max_size=60))
keys = st.one_of(st.sampled_from(KEYS), st.sampled_from(KEYS).map(lambda k: k.rsplit(".", 1)[0]),
                 st.text(alphabet="abcdefgz._ =", max_size=20))
@functools.lru_cache(maxsize=None)
def _default(key: str):
    node = load_config(TINY).to_dict()
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _plausible(key: str) -> st.SearchStrategy:
    """Values near the key's default (so that many generated configs are valid and go through the round trip)."""
    d = _default(key)
    if isinstance(d, bool):
        return st.booleans()
    if isinstance(d, int):
        return st.just(d) | st.integers(min_value=-1, max_value=3 * abs(d) + 2)
    if isinstance(d, float) or key.startswith("algorithm.hparams."):
        base = d if isinstance(d, float) else 0.5
        return st.just(base) | st.floats(min_value=-2 * abs(base) - 1, max_value=2 * abs(base) + 1)
    if isinstance(d, list):
        return st.lists(st.floats(min_value=0, max_value=1, exclude_max=True), min_size=2, max_size=2)
    if key.endswith(("output_dir", "_path")):
        return st.sampled_from(["runs/x", "~/runs/y", "/tmp/z", None]) | st.text(min_size=1, max_size=10)
    return st.sampled_from([d, None]) | st.text(max_size=10)


plausible = st.sampled_from(KEYS).flatmap(lambda k: _plausible(k).map(lambda v: f"{k}={_as_yaml(v)}"))
wild = st.tuples(keys, raw_values).map(lambda kv: f"{kv[0]}={kv[1]}")
overrides = st.lists(plausible, min_size=1, max_size=4) | st.lists(plausible | wild, min_size=1, max_size=4)


def _roundtrip(cfg: Config) -> None:
    """A config that loads is written atomically and reads back identical (no temporary file left behind)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.yaml"
        save_config(cfg, path)
        assert os.listdir(d) == ["config.yaml"]
        assert load_config(path) == cfg


@FUZZ
@given(overrides)
def test_fuzz_config_overrides(items):
    try:
        cfg = load_config(TINY, items)
    except ConfigError as e:
        _one_line(e)
        return
    assert isinstance(cfg, Config)
    _roundtrip(cfg)


# ------------------------------------------------------------------------------------------- YAML documents

SECTIONS = [k for k in KEYS if "." not in k] + sorted({k.split(".")[0] for k in KEYS if "." in k}) + ["base"]
fields = st.dictionaries(st.sampled_from([k.split(".")[-1] for k in KEYS]), values, max_size=4)
documents = st.dictionaries(st.sampled_from(SECTIONS), fields | values, max_size=5)


def _yaml_text(doc) -> str:
    import yaml

    return yaml.safe_dump(doc, allow_unicode=True)


def _nested(items: list[str]) -> dict:
    from cegppo.config import parse_overrides

    def plain(v):
        return {k: plain(x) for k, x in v.items()} if isinstance(v, dict) else v

    try:
        return plain(parse_overrides(items))
    except ConfigError:
        return {}


yaml_texts = st.one_of(
    st.lists(plausible, max_size=6).map(_nested).map(_yaml_text),  # well-formed, often valid
    documents.map(_yaml_text),  # well-formed, mostly invalid settings
    st.lists(st.tuples(st.sampled_from(SECTIONS), raw_values), max_size=6).map(
        lambda kvs: "".join(f"{k}: {v}\n" for k, v in kvs)),  # hand-made, often malformed
    st.lists(st.sampled_from(SPECIAL + ["train:", "  steps: 3", "  - a", "a: &x [1, 2]", "b: *x", "c: [*x, *x]"]),
             max_size=8).map("\n".join),
    st.text(max_size=200),
)


@FUZZ
@given(yaml_texts)
def test_fuzz_yaml_documents(text):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            cfg = load_config(path)
        except ConfigError as e:
            _one_line(e)
            return
    _roundtrip(cfg)


@FUZZ
@given(st.binary(max_size=300))
def test_fuzz_yaml_bytes(data):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.yaml"
        path.write_bytes(data)
        try:
            load_config(path)
        except ConfigError as e:
            _one_line(e)


# ------------------------------------------------------------------------------------------- dataset rows

ROW_KEYS = ["question", "problem", "answer", "prompt", "reward_model", "ground_truth", "id", "solution", "data_source",
            "role", "content", "user", "x"]
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                         st.text(max_size=20), st.sampled_from(["", " ", "user", "assistant", "1", "Q?"]))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.sampled_from(ROW_KEYS) | st.text(max_size=5), inner, max_size=4),
                           max_leaves=10)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", 3]),
                                 "content": st.one_of(st.text(max_size=20), st.integers())})
plain_row = st.fixed_dictionaries({"question": json_scalars, "answer": json_scalars},
                                  optional={"id": json_scalars, "solution": json_scalars, "data_source": json_scalars})
verl_row = st.fixed_dictionaries({"prompt": st.lists(message, max_size=3) | json_values,
                                  "reward_model": st.fixed_dictionaries({"ground_truth": json_scalars}) | json_values},
                                 optional={"data_source": json_scalars})
text = st.text(min_size=1, max_size=20).filter(str.strip)
good_plain = st.fixed_dictionaries({"question": text,
                                    "answer": text | st.integers() | st.floats(allow_nan=False, allow_infinity=False)},
                                   optional={"id": text | st.integers(), "solution": text, "data_source": text})
good_verl = st.fixed_dictionaries({"prompt": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                                             "content": text}), min_size=1, max_size=2),
                                   "reward_model": st.fixed_dictionaries({"ground_truth": text | st.integers()})},
                                  optional={"data_source": text})
rows = st.one_of(good_plain, good_verl, plain_row, verl_row,
                 st.dictionaries(st.sampled_from(ROW_KEYS), json_values, max_size=5), json_values)
lines = st.one_of(rows.map(json.dumps), st.sampled_from(["", "{", "[1]", "null", '{"question": "\\ud800", "answer": 1}',
                                                         '{"question": "Q", "answer": 1e999}', "NaN", "9" * 5000]),
                  st.text(max_size=30))


def _check_problems(problems) -> None:
    assert problems and all(isinstance(p, Problem) for p in problems)
    for p in problems:
        assert isinstance(p.answer, str) and p.answer.strip() and isinstance(p.id, str) and p.id
        assert any(m["role"] == "user" for m in p.messages) and p.copies >= 1
        p.prompt_text.encode("utf-8")


def _load(path: Path, **kw):
    try:
        _check_problems(load_problems(path, **kw))
    except DatasetError as e:
        _one_line(e)


good_lines = st.lists(good_plain, min_size=1, max_size=6) | st.lists(good_verl, min_size=1, max_size=6)


@FUZZ
@given(good_lines.map(lambda rs: [json.dumps(r) for r in rs]) | st.lists(lines, min_size=1, max_size=6),
       st.sampled_from(["auto", "auto", "plain", "verl"]))
def test_fuzz_dataset_rows_jsonl(body, schema):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "d.jsonl"
        path.write_text("\n".join(body) + "\n", encoding="utf-8", errors="surrogatepass")
        _load(path, schema=schema)


@FUZZ
@given(good_lines | st.lists(rows, max_size=6))
def test_fuzz_dataset_rows_json_array(items):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "d.json"
        path.write_text(json.dumps(items))
        _load(path)


@FUZZ
@given(st.binary(max_size=300), st.sampled_from(["d.jsonl", "d.json"]))
def test_fuzz_dataset_bytes(data, name):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / name
        path.write_bytes(data)
        _load(path)


# ------------------------------------------------------------------------------------------- every key's rule
# Issue 23, class 3; issue 38. The keys and their rules come from the schema: every dataclass field of
# cegppo.config.schema (and algorithm.entropy_control / adaptive_entropy) declares its rule in metadata["range"]
# (cegppo.config.schema.key), so a new key is tested the day it is added, and one without a rule fails
# test_every_key_declares_its_rule. Production has one interpreter of the rules, cegppo.errors.check_rule, which
# validate() applies to every field; these tests read the declarations and check, through validate(), that they are
# what is enforced: the values just inside and just outside each declared bound (test_declared_bounds_are_enforced),
# and values of every type, where the production pieces (check_type, then check_rule) are the oracle
# (test_every_key_type_and_range). Nothing here restates a key's range.

import copy  # noqa: E402
import math  # noqa: E402
import types  # noqa: E402

from cegppo.config import MAX_INT, check_type, validate  # noqa: E402
from cegppo.errors import check_rule  # noqa: E402


def _rules(cls: type = Config, where: str = "") -> dict[str, tuple[object, dict]]:
    hints, out = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        key = f"{where}.{f.name}" if where else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(_rules(hints[f.name], key))
        else:
            out[key] = (hints[f.name], f.metadata.get("range"))
    return out


RULES = _rules()
_TINY_CFG = None
NUMERIC = ("ge", "gt", "le", "lt")


def _tiny() -> Config:
    global _TINY_CFG
    if _TINY_CFG is None:
        _TINY_CFG = load_config(TINY)
    return copy.deepcopy(_TINY_CFG)


def _get(cfg: Config, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _set(cfg: Config, key: str, value) -> None:
    *path, leaf = key.split(".")
    setattr(_get(cfg, ".".join(path)) if path else cfg, leaf, copy.deepcopy(value))


def _types(tp) -> set:
    origin = typing.get_origin(tp)
    return set(typing.get_args(tp)) if origin in (typing.Union, types.UnionType) else {tp}


def test_every_key_declares_its_rule():
    assert len(RULES) > 60
    missing = [k for k, (_, rule) in RULES.items() if rule is None]
    assert not missing, f"keys without a declared rule (cegppo.config.schema.key): {missing}"
    # a number's message is worded from its bounds: a `says` beside them could state other ones
    worded = [k for k, (_, rule) in RULES.items() if "says" in rule and any(b in rule for b in NUMERIC)]
    assert not worded, worded


def test_every_default_is_inside_its_rule():
    """Config() as the schema builds it satisfies every declared rule (a rule that refuses its own default is a
    wrong rule), and validates."""
    cfg = Config()
    for key, (tp, rule) in RULES.items():
        value = _get(cfg, key)
        if not (value is None and type(None) in _types(tp)):
            check_rule(check_type(value, tp, key), rule, key)
    validate(cfg)


def test_the_interpreter_words_each_rule():
    """check_rule's one-line messages: the key, what the rule admits, the value."""
    cases = [
        (0, {"ge": 1}, None, "k must be >= 1, got 0"),
        (0, {"ge": 1}, int, "k must be an integer >= 1, got 0"),
        (1.5, {"ge": 1}, int, "k must be an integer >= 1, got 1.5"),
        (9, {"ge": 1, "le": 5}, None, "k must be in 1..5, got 9"),
        (-1.0, {"gt": 0, "le": 3600, "unit": "seconds"}, None, "k must be in (0, 3600] seconds, got -1.0"),
        (2.0, {"ge": 0, "le": 1, "note": "why"}, None, "k must be a finite number >= 0 and <= 1 (why), got 2.0"),
        (0.5, {"ge": 1, "also": (0,)}, None, "k must be 0 or a finite number >= 1, got 0.5"),
        ([0.9, 1.0], {"items": 2, "ge": 0, "lt": 1}, None, "k must be two numbers in [0, 1), got [0.9, 1.0]"),
        ("x", {"choices": ("a", "b", None)}, None, "k must be 'a', 'b' or null, got 'x'"),
        ("x", {"choices": (True, False, "auto")}, None, "k must be true, false or auto, got 'x'"),
        (" ", {"nonempty": True}, None, "k must be non-empty text, got ' '"),
        ("gpu", {"pattern": "cpu|cuda", "says": "cpu or cuda"}, None, "k must be cpu or cuda, got 'gpu'"),
    ]
    for value, rule, kind, message in cases:
        with pytest.raises(ConfigError) as e:
            check_rule(value, rule, "k", kind)
        assert str(e.value) == message
    for value, rule in [(1, {"ge": 1}), (0, {"ge": 1, "also": (0,)}), (None, {"choices": ("a", None)}),
                        ("anything", {"free": "checked elsewhere"}), (True, {}), ([0.0, 0.5], {"items": 2, "lt": 1})]:
        check_rule(value, rule, "k")


def _edges(key: str) -> list[tuple[object, bool]]:
    """(value, inside the rule) read off the declaration: each bound and its nearest neighbour past it, each choice
    and a word that is none, the default and a blank text, a list one item short or long."""
    tp, rule = RULES[key]
    default = _get(Config(), key)
    if "choices" in rule:
        return [(c, True) for c in rule["choices"]] + [("not-a-choice", False)]
    if "nonempty" in rule or "pattern" in rule:
        return [(default, True), (" ", False)] + ([("x", True)] if "pattern" not in rule else [])
    integer = float not in _types(tp) and "items" not in rule

    def beyond(bound, up: bool):
        return bound + (1 if up else -1) if integer else math.nextafter(bound, math.inf if up else -math.inf)

    scalars = [(a, True) for a in rule.get("also", ())]
    for name, up in (("ge", False), ("gt", False), ("le", True), ("lt", True)):
        if name in rule:
            bound, closed = rule[name], name in ("ge", "le")
            scalars += [(bound, closed), (beyond(bound, up if closed else not up), not closed)]
    scalars = [(v, inside) for v, inside in scalars if inside or v not in rule.get("also", ())]
    if "items" not in rule:
        return scalars
    n, ok = rule["items"], next(v for v, inside in scalars if inside)
    return ([([v] + [ok] * (n - 1), inside) for v, inside in scalars]
            + [([ok] * (n - 1), False), ([ok] * (n + 1), False)])


def _names(message: str, key: str) -> bool:
    section, leaf = key.rsplit(".", 1) if "." in key else ("", key)
    return key in message or (section in message and leaf in message)


def _validate(key: str, value) -> str | None:
    """validate() on the tiny config with ``key`` set to ``value``: None if accepted, else its one-line message."""
    cfg = _tiny()
    _set(cfg, key, value)
    try:
        validate(cfg)
    except ConfigError as e:
        _one_line(e)
        return str(e)
    return None


def _related(key: str) -> list[str]:
    cross = RULES[key][1].get("cross", ())
    return [key, *(c if "." in c else f"{key.rsplit('.', 1)[0]}.{c}" for c in cross)]


def _check_outcome(key: str, value, inside: bool | None, refused: str | None) -> None:
    """Outside the rule: refused, naming the key. Inside it: accepted, unless a declared cross-field rule refuses
    it (naming the key or one of its `cross` keys). A free rule (None): whatever refuses it names a related key."""
    if inside is False:
        assert refused is not None, f"{key}={value!r} is outside its declared rule but was accepted"
        assert _names(refused, key), f"{key}={value!r}: the message does not name the key: {refused}"
    elif inside is True and refused is not None:
        assert RULES[key][1].get("cross") and any(_names(refused, k) for k in _related(key)), \
            f"{key}={value!r} is inside its rule: {refused}"
    elif refused is not None:
        assert any(_names(refused, k) for k in _related(key)), f"{key}={value!r}: {refused}"


BOUNDED = sorted(k for k, (_, rule) in RULES.items()
                 if {"choices", "nonempty", "pattern", "items", "also", *NUMERIC} & set(rule))


@pytest.mark.parametrize("key", BOUNDED)
def test_declared_bounds_are_enforced(key):
    """validate() draws each declared bound where the schema puts it: the bound (or its nearest neighbour) inside
    is accepted, its nearest neighbour outside refused naming the key."""
    edges = _edges(key)
    assert any(inside for _, inside in edges) and not all(inside for _, inside in edges), edges
    for value, inside in edges:
        _check_outcome(key, value, inside, _validate(key, value))


def _numbers(tp, rule: dict) -> st.SearchStrategy:
    near = [v for b in [rule[b] for b in NUMERIC if b in rule] + list(rule.get("also", ()))
            for v in (b, b - 1, b + 1, b - 1e-9, b + 1e-9, -b)]
    if int in _types(tp):
        ints = [int(v) for v in near if float(v).is_integer()]
        return st.sampled_from(ints or [0]) | st.integers(-10, 10) | st.sampled_from([MAX_INT, MAX_INT + 1, -2**70])
    return (st.sampled_from(near or [0.0]) | st.floats(-1e3, 1e3) | st.floats(allow_nan=True, allow_infinity=True)
            | st.integers(-5, 5))


def _values(key: str) -> st.SearchStrategy:
    tp, rule = RULES[key]
    kinds = _types(tp)
    wrong = st.sampled_from(["abc", [1, 2], {"a": 1}, 1.5, True, None, -3, ""])
    choices = list(rule.get("choices", ()))
    if choices:
        return st.sampled_from(choices) | st.text(max_size=8) | wrong
    if float in kinds or int in kinds:
        return _numbers(tp, rule) | wrong
    if list in kinds:
        item = _numbers(float, rule)
        return st.lists(item, min_size=0, max_size=3) | wrong
    if str in kinds:
        return st.sampled_from(["x", "  ", "", "a\x00b", _get(Config(), key)]) | st.text(max_size=6) | wrong
    return wrong  # bool, dict


def _admitted(key: str, value) -> bool | None:
    """What the production pieces say of ``value`` alone: its type (check_type), the limits every key shares (a
    finite float, a 64-bit integer, text without NUL), then its declared rule (check_rule). None for a free rule:
    only the code that checks it can say."""
    tp, rule = RULES[key]
    try:
        typed = check_type(copy.deepcopy(value), tp, key)
    except ConfigError:
        return False
    if typed is None:
        return True  # check_type passes null only where the type admits it
    if ((isinstance(typed, float) and not math.isfinite(typed)) or (isinstance(typed, str) and "\x00" in typed)
            or (type(typed) is int and not -MAX_INT - 1 <= typed <= MAX_INT)):
        return False
    if "free" in rule:
        return None
    try:
        check_rule(typed, rule, key)
    except ConfigError:
        return False
    return True


PER_KEY = settings(max_examples=_DEEP or 40, deadline=2000, suppress_health_check=[HealthCheck.too_slow],
                   database=None, derandomize=not _DEEP)


@pytest.mark.parametrize("key", sorted(RULES))
@PER_KEY
@given(data=st.data())
def test_every_key_type_and_range(key, data):
    value = data.draw(_values(key), label=key)
    _check_outcome(key, value, _admitted(key, value), _validate(key, value))


hparam_names = sorted({name for spec in __import__("cegppo.algorithm.objectives", fromlist=["OBJECTIVES"])
                       .OBJECTIVES.values() for name in spec.defaults})


@FUZZ
@given(st.sampled_from(["ce_gppo", "gppo", "ppo_clip", "cispo", "gspo", "clip_cov", "kl_cov", "dapo"]),
       st.sampled_from(hparam_names), st.none() | st.floats(allow_nan=True, allow_infinity=True) | st.integers(-3, 20)
       | st.booleans() | st.text(max_size=4))
def test_every_objective_hyperparameter_is_checked_before_a_model_loads(objective, name, value):
    """`algorithm.hparams.eps_high=null` passed validation and crashed at the first update (issue 23): every
    hyperparameter of every objective, generated from the registry, is either accepted by validate() and by the
    objective the trainer builds, or refused by validate() naming it."""
    from cegppo.algorithm.objectives import OBJECTIVES, get_objective

    cfg = _tiny()
    cfg.algorithm.objective = objective
    cfg.algorithm.hparams = {name: value}
    try:
        validate(cfg)
    except ConfigError as e:
        _one_line(e)
        assert name in str(e) or "algorithm.hparams" in str(e), str(e)
        return
    assert name in OBJECTIVES[objective].defaults
    get_objective(cfg.algorithm.objective, **cfg.algorithm.hparams)  # what the trainer does: must not raise
