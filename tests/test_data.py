import json
import logging
import re
from pathlib import Path

import pytest
from conftest import AIME_LAYOUTS, write_x32

from cegppo.data.evalsets import BUNDLED_DIR, EVAL_SETS, resolve_dataset
from cegppo.data.problems import DatasetError, Problem, load_problems, prompt_id
from cegppo.data.rewards import RewardFn, math_strict


def verl_row(q="What is 1 + 1?", gt="2", source="math_src", **extra):
    return {"data_source": source, "prompt": [{"role": "user", "content": q}], "ability": "MATH",
            "reward_model": {"ground_truth": gt, "style": "rule"}, **extra}


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------- happy paths


def test_verl_jsonl(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [verl_row(), verl_row("What is 2 + 2?", "4")])
    probs = load_problems(p)
    assert [x.answer for x in probs] == ["2", "4"]
    assert probs[0].messages == [{"role": "user", "content": "What is 1 + 1?"}]
    assert probs[0].data_source == "math_src" and probs[0].copies == 1 and probs[0].solution is None
    assert probs[0].id == prompt_id(probs[0].messages) and len(probs[0].id) == 12
    assert load_problems(p, schema="verl") == probs
    assert load_problems(p, data_source="override")[0].data_source == "override"


def test_plain_jsonl_and_json_array(tmp_path):
    rows = [{"question": "What is 3 + 4?", "answer": "7", "solution": "3 + 4 = 7. \\boxed{7}", "id": "q1"},
            {"problem": "What is 5 * 5?", "answer": 25}]
    probs = load_problems(write_jsonl(tmp_path / "p.jsonl", rows))
    assert probs[0] == Problem(id="q1", messages=[{"role": "user", "content": "What is 3 + 4?"}], answer="7",
                               solution="3 + 4 = 7. \\boxed{7}", data_source="p")
    assert probs[1].answer == "25" and probs[1].id == prompt_id(probs[1].messages)
    (tmp_path / "p.json").write_text(json.dumps(rows, indent=2))
    assert load_problems(tmp_path / "p.json", schema="plain") == [
        Problem(**{**p.__dict__, "data_source": "p"}) for p in probs]


def test_json_file_holding_json_lines(tmp_path):
    p = tmp_path / "d.json"
    write_jsonl(p, [verl_row(), verl_row("Q2", "3")])
    assert len(load_problems(p)) == 2


def test_same_prompt_in_both_schemas_gets_same_id(tmp_path):
    a = load_problems(write_jsonl(tmp_path / "a.jsonl", [verl_row("Q?", "1")]))[0]
    b = load_problems(write_jsonl(tmp_path / "b.jsonl", [{"question": "Q?", "answer": "1"}]))[0]
    assert a.id == b.id


def test_custom_keys(tmp_path):
    rows = [{"meta": {"uid": 7}, "text": "Compute 2+3.", "target": {"value": "5"}, "ref": "2+3=5 \\boxed{5}"}]
    p = write_jsonl(tmp_path / "c.jsonl", rows)
    (prob,) = load_problems(p, schema="plain", prompt_key="text", answer_key="target.value", id_key="meta.uid",
                            solution_key="ref")
    assert (prob.id, prob.answer, prob.prompt_text, prob.solution) == ("7", "5", "Compute 2+3.", "2+3=5 \\boxed{5}")
    (prob2,) = load_problems(p, prompt_key="text", answer_key="target.value")  # auto-detects plain
    assert prob2.answer == "5"


def test_parquet(tmp_path):
    import datasets

    rows = [verl_row(), verl_row("What is 2 + 2?", "4"), verl_row()]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    probs = load_problems(tmp_path / "d.parquet")
    assert [(p.answer, p.copies) for p in probs] == [("2", 2), ("4", 1)]


def test_dedupe(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [verl_row(), verl_row("B", "3"), verl_row(), verl_row()])
    probs = load_problems(p)
    assert [(x.answer, x.copies) for x in probs] == [("2", 3), ("3", 1)]
    assert [x.copies for x in load_problems(p, dedupe=False)] == [1, 1, 1, 1]


def test_numeric_answers_converted(tmp_path, caplog):
    p = write_jsonl(tmp_path / "d.jsonl", [verl_row(gt=540), verl_row("B", 2.0), verl_row("C", 0.25),
                                           verl_row("D", "7"), verl_row(gt=540)])
    with caplog.at_level(logging.INFO, logger="cegppo.data.problems"):
        assert [x.answer for x in load_problems(p)] == ["540", "2", "0.25", "7"]
    # every numeric row counts, duplicates included; string answers do not
    assert "4 numeric answers converted to strings" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cegppo.data.problems"):
        load_problems(write_jsonl(tmp_path / "s.jsonl", [verl_row(gt="540")]))
    assert "converted" not in caplog.text


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize("row, match", [
    ({"data_source": "x", "prompt": [{"role": "user", "content": "Q"}], "reward_model": {}},
     r"d\.jsonl:2: missing 'reward_model\.ground_truth' \(expected the verl schema"),
    (verl_row(gt=None), r"d\.jsonl:2: 'reward_model\.ground_truth' is NoneType"),
    (verl_row(gt=[1, 2]), r"d\.jsonl:2: 'reward_model\.ground_truth' is list"),
    (verl_row(gt={"a": 1}), r"is dict"),
    (verl_row(gt=True), r"is bool"),
    (verl_row(gt="  "), r"empty string"),
    (verl_row(gt=float("nan")), r"finite"),
    ({**verl_row(), "prompt": []}, r"d\.jsonl:2: empty prompt"),
    ({**verl_row(), "prompt": [{"role": "user", "content": "  "}]}, r"empty prompt"),
    ({**verl_row(), "prompt": "What?"}, r"d\.jsonl:2: 'prompt' is str; expected the verl schema"),
    ({**verl_row(), "prompt": [{"role": "user"}]}, r"prompt\[0\].*expected \{'role': str, 'content': str\}"),
    ({**verl_row(), "prompt": [{"role": "system", "content": "S"}]}, r"no message with role 'user'"),
    ([1, 2], r"d\.jsonl:2: row is list; expected a JSON object"),
    ({**verl_row(), "data_source": 3}, r"'data_source' is int"),
])
def test_verl_row_errors(tmp_path, row, match):
    p = write_jsonl(tmp_path / "d.jsonl", [verl_row("First"), row])
    with pytest.raises(DatasetError, match=match):
        load_problems(p)


@pytest.mark.parametrize("row, match", [
    ({"question": "Q"}, r"p\.jsonl:1: missing 'answer' \(expected the plain schema"),
    ({"question": "", "answer": "1"}, r"p\.jsonl:1: empty prompt"),
    ({"question": ["Q"], "answer": "1"}, r"'question' is list"),
    ({"question": "Q", "answer": "1", "solution": 5}, r"'solution' is int; expected a string"),
    ({"question": "Q", "answer": "1", "id": {"x": 1}}, r"id 'id' is"),
])
def test_plain_row_errors(tmp_path, row, match):
    with pytest.raises(DatasetError, match=match):
        load_problems(write_jsonl(tmp_path / "p.jsonl", [row]), schema="plain")


def test_malformed_json_line(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [verl_row(), "", '{"prompt": [}'])
    with pytest.raises(DatasetError, match=r"d\.jsonl:3: malformed JSON"):
        load_problems(p)


def test_malformed_json_array(tmp_path):
    p = tmp_path / "d.json"
    p.write_text('[\n{"question": "Q", "answer": "1"},\n{"question": }\n]')
    with pytest.raises(DatasetError, match=r"d\.json:3: malformed JSON"):
        load_problems(p)


def test_json_array_row_location(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps([{"question": "Q", "answer": "1"}, {"question": "R"}]))
    with pytest.raises(DatasetError, match=r"d\.json\[1\]: missing 'answer'"):
        load_problems(p)


def test_same_prompt_different_answer(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [verl_row(), verl_row("B", "1"), verl_row(gt="3")])
    for dedupe in (True, False):
        with pytest.raises(DatasetError, match=r"d\.jsonl:3: same prompt as .*d\.jsonl:1 but a different answer"):
            load_problems(p, dedupe=dedupe)


def test_duplicate_explicit_ids(tmp_path):
    rows = [{"id": "a", "question": "Q1", "answer": "1"}, {"id": "a", "question": "Q2", "answer": "2"}]
    with pytest.raises(DatasetError, match=r"p\.jsonl:2: id 'a' was already used by .*p\.jsonl:1"):
        load_problems(write_jsonl(tmp_path / "p.jsonl", rows))
    same = [{"id": "a", "question": "Q1", "answer": "1"}] * 2
    (prob,) = load_problems(write_jsonl(tmp_path / "s.jsonl", same))
    assert prob.copies == 2


def test_missing_configured_id(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [verl_row()])
    with pytest.raises(DatasetError, match=r"d\.jsonl:1: missing id column 'extra_info\.index'"):
        load_problems(p, id_key="extra_info.index")


def test_file_level_errors(tmp_path):
    with pytest.raises(DatasetError, match="file not found"):
        load_problems(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match=r"unknown extension '\.csv'"):
        load_problems(tmp_path / "d.csv")
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(DatasetError, match="no rows"):
        load_problems(tmp_path / "e.jsonl")
    (tmp_path / "x.jsonl").write_text(json.dumps({"foo": 1}) + "\n")
    with pytest.raises(DatasetError, match=r"x\.jsonl:1: cannot detect the schema from keys \['foo'\]"):
        load_problems(tmp_path / "x.jsonl")
    with pytest.raises(ValueError, match="schema must be"):
        load_problems(tmp_path / "x.jsonl", schema="csv")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match=r"bad\.parquet: could not read Parquet"):
        load_problems(tmp_path / "bad.parquet")


def test_problem_is_hashable():
    a = Problem(id="x", messages=[{"role": "user", "content": "Q"}], answer="1")
    b = Problem(id="x", messages=[{"role": "user", "content": "Q"}], answer="1")
    assert a == b and len({a, b}) == 1 and a.prompt_text == "Q"


def test_dataset_error_is_value_error():
    assert issubclass(DatasetError, ValueError)


# ---------------------------------------------------------------------------- bundled AIME sets


@pytest.mark.parametrize("name, source, row_source", [("aime24", "AIME 2024", "math_longcot_math_verify"),
                                                      ("aime25", "AIME 2025", "math_longcot_math_verify25")])
def test_aime_files(name, source, row_source, tmp_path):
    path = resolve_dataset(name)
    assert path == BUNDLED_DIR / f"{name}.jsonl" and path.is_file() and EVAL_SETS[name].data_source == source
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    # by name and by the bundled file's path: the readable source name, not the rows' verl routing key
    probs = load_problems(name)
    assert load_problems(path) == probs
    assert len(probs) == 30 and len({p.id for p in probs}) == 30
    assert all(p.data_source == source for p in probs)
    assert all(json.loads(ln)["data_source"] == row_source for ln in lines)  # the files stay as released
    assert [p.data_source for p in load_problems(name, data_source="mine")] == ["mine"] * 30
    # The released files hold 30 prompts x 32 copies (960 rows); a deduplicated copy holds 30 rows.
    assert sum(p.copies for p in probs) == len(lines)
    assert len({p.copies for p in probs}) == 1
    # The 960-row layout: every row repeated 32 times (interleaved as in the release, and in blocks).
    for layout in AIME_LAYOUTS:
        probs32 = load_problems(write_x32(path, tmp_path / f"{name}_x32_{layout}.jsonl", layout))
        assert [p.id for p in probs32] == [p.id for p in probs]
        assert all(p.copies == 32 for p in probs32)
        assert all(p.data_source == row_source for p in probs32)  # a copy elsewhere is a user file
    # AIME answers are integers 0..999, written canonically (no sign, no leading zeros, no spaces)
    assert all(re.fullmatch(r"0|[1-9][0-9]{0,2}", p.answer) for p in probs), [p.answer for p in probs]
    # Smoke check only: strict mode returns True on an exact string match of the boxed content, so a
    # boxed gold always passes against itself; this checks wiring, not that the golds are parseable.
    res = RewardFn(math_strict)([f"\\boxed{{{p.answer}}}" for p in probs], [p.answer for p in probs])
    assert res.failures == 0 and all(res.correct) and res.scores == [1.0] * 30
    # and through math-verify itself (the strict grader short-cuts exact string matches)
    from math_verify import parse, verify

    assert all(verify(parse(f"\\boxed{{{p.answer}}}"), parse(f"The answer is \\boxed{{{p.answer}}}."))
               for p in probs)


def test_file_wins_over_a_set_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # a file named like a set is read as the file: by a path with a suffix, and by the bare name
    write_jsonl(tmp_path / "aime24.jsonl", [verl_row(gt="7")])
    probs = load_problems("aime24.jsonl")
    assert len(probs) == 1 and probs[0].answer == "7" and probs[0].data_source == "math_src"
    write_jsonl(tmp_path / "aime25", [verl_row()])
    with pytest.raises(DatasetError, match=r"^aime25: unknown extension ''"):
        load_problems("aime25")
    # a directory of that name does not hide the set
    (tmp_path / "aime24").mkdir()
    assert len(load_problems("aime24")) == 30


def test_unknown_name_lists_the_bundled_sets():
    assert resolve_dataset("aime23") is None and resolve_dataset("aime24.jsonl") is None
    with pytest.raises(DatasetError, match=r"^aime23: file not found \(nor the name of a bundled evaluation "
                                           r"set: aime24, aime25\)"):
        load_problems("aime23")


def test_config_test_path_names_a_bundled_set(tiny_config):
    from cegppo.engine.components import load_splits

    _, test = load_splits(tiny_config("data.test_path=aime25"))
    assert len(test) == 4 and {p.data_source for p in test} == {"AIME 2025"}


# ---------------------------------------------------------------------------- hostile files

_OK = json.dumps({"question": "What is 1 + 1?", "answer": "2"}).encode() + b"\n"
_OK2 = json.dumps({"question": "What is 2 + 2?", "answer": "4"}).encode() + b"\n"


def _gzip(data: bytes) -> bytes:
    import gzip
    return gzip.compress(data)


def _bz2(data: bytes) -> bytes:
    import bz2
    return bz2.compress(data)


@pytest.mark.parametrize("name, content, match", [
    ("d.jsonl", _gzip(_OK * 3), r"d\.jsonl:1: gzip-compressed, not JSON lines text"),
    ("d.json", _gzip(_OK), r"d\.json:1: gzip-compressed, not JSON text"),
    ("d.jsonl", _bz2(_OK), r"d\.jsonl:1: bzip2-compressed"),
    ("d.jsonl", b"PAR1" + bytes(range(256)), r"d\.jsonl:1: a Parquet file"),
    ("d.jsonl", _OK + b'{"question": "caf\xe9", "answer": "1"}\n', r"d\.jsonl:2: not UTF-8 text \(byte 0xe9 at byte 18"),
    ("d.jsonl", _OK + _OK2 + b'{"question": "a\x00b", "answer": "1"}\n', r"d\.jsonl:3: binary content \(NUL byte"),
    ("d.jsonl", bytes(range(256)) * 4, r"d\.jsonl:1: binary content \(NUL byte at byte 1"),
    ("d.jsonl", '{"question": "Q", "answer": "1"}\n'.encode("utf-16"), r"d\.jsonl:1: UTF-16 text, not JSON lines"),
    ("d.json", b'[\n{"question": "Q", "answer": "1"},\n{"question": "\xff", "answer": "1"}]', r"d\.json:3: not UTF-8"),
    ("d.jsonl", _OK + b'{"question": "\\ud800", "answer": "1"}\n', r"d\.jsonl:2: .*unpaired UTF-16 surrogate"),
    ("d.json", b'[{"question": "Q", "answer": "1"}, {"question": "\\udc00", "answer": "1"}]', r"d\.json\[1\]: .*surrogate"),
    ("d.jsonl", b"[" * 100_000 + b"]" * 100_000 + b"\n", r"d\.jsonl:1: malformed JSON \(nested too deeply\)"),
    ("d.jsonl", b'{"question": "Q", "answer": ' + b"9" * 5000 + b"}\n", r"d\.jsonl:1: malformed JSON \(Exceeds"),
    ("d.parquet", _gzip(b"x" * 100), r"d\.parquet: could not read Parquet file \(no PAR1 header; it is gzip"),
])
def test_hostile_data_files(tmp_path, name, content, match):
    """Compressed, binary, non-UTF-8 or pathological files: a one-line DatasetError naming the file and line."""
    p = tmp_path / name
    p.write_bytes(content)
    with pytest.raises(DatasetError, match=match) as e:
        load_problems(p)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) <= 1000


def test_line_endings_and_bom(tmp_path):
    """A UTF-8 BOM is skipped; \\r\\n and \\r end lines as in text mode (line numbers stay right)."""
    rows = [_OK.strip(), _OK2.strip(), b"{oops"]
    for sep in (b"\r\n", b"\r", b"\n"):
        p = tmp_path / "d.jsonl"
        p.write_bytes(b"\xef\xbb\xbf" + sep.join(rows[:2]) + sep)
        assert [q.answer for q in load_problems(p)] == ["2", "4"]
        p.write_bytes(sep.join(rows) + sep)
        with pytest.raises(DatasetError, match=r"d\.jsonl:3: malformed JSON"):
            load_problems(p)


def test_dataset_errors_are_one_bounded_line(tmp_path):
    big = "x" * 100_000
    p = write_jsonl(tmp_path / "d.jsonl", [{"question": "Q", "answer": "1"}, {"question": "Q", "answer": big + "\n" + big}])
    with pytest.raises(DatasetError) as e:
        load_problems(p)
    assert "different answer" in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) <= 1000
