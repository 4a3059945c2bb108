"""Issue 41, class 5: `cegppo compare` (and the resume path) read a run's config.yaml and metrics through the same
hardened loaders as everything else: the config loader's bounded YAML parser and checked JSON lines. A hostile or
damaged run file is one line naming it, in milliseconds, never a traceback or a stall (docs/reliability.md)."""

import time
from pathlib import Path

import pytest

from cegppo.cli import main
from cegppo.engine.rundir import RunDir
from cegppo.io import read_jsonl
from fixtures.cli import error_line

# a 6-level alias bomb: 9**6 (half a million) nodes from a file of about 300 bytes
LAUGHS = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcde", "bcdef"))
GOOD_ROW = '{"step": 1, "entropy": 1.0, "reward/mean": 0.1}\n'


CASES = {
    # name: (file, content, what the line says after the file's path)
    "alias-bomb": ("config.yaml", LAUGHS, "config.yaml: YAML expands to more than 100000 nodes"),
    "alias-bomb-in-hparams": ("config.yaml", LAUGHS + "algorithm: {hparams: {h: *f}}\n",
                              "config.yaml: YAML expands to more than 100000 nodes"),
    "list-config": ("config.yaml", "- 1\n- 2\n", "config.yaml: the top level must be a mapping of config sections, "
                                                 "got list [1, 2]"),
    "algorithm-list": ("config.yaml", "algorithm: [1]\n", "config.yaml: algorithm must be a mapping, got list [1]"),
    "hparams-list": ("config.yaml", "algorithm: {hparams: [1, 2]}\n",
                     "config.yaml: algorithm.hparams must be a mapping of names to values"),
    "objective-number": ("config.yaml", "algorithm: {objective: 3}\n", "config.yaml: algorithm.objective must be a name"),
    "bad-yaml": ("config.yaml", "a: [\n", "config.yaml: not valid YAML"),
    "list-row": ("metrics.jsonl", GOOD_ROW + "[1, 2]\n", "metrics.jsonl:2: expected a JSON object (one row per line), "
                                                         "got list [1, 2]"),
    "number-row": ("metrics.jsonl", "3\n" + GOOD_ROW, "metrics.jsonl:1: expected a JSON object"),
    "no-step": ("metrics.jsonl", '{"entropy": 1.0}\n', "metrics.jsonl:1: 'step' must be an integer >= 0, got None"),
    "text-step": ("metrics.jsonl", '{"step": "1", "entropy": 1.0}\n', "metrics.jsonl:1: 'step' must be an integer"),
    "latin1": ("metrics.jsonl", GOOD_ROW.encode() + b'{"x": "\xe9"}\n', "metrics.jsonl:2: not UTF-8 text (byte 0xe9)"),
    "deep": ("metrics.jsonl", "[" * 100_000 + "]" * 100_000 + "\n", "metrics.jsonl:1: not readable JSON"),
    "eval-row": ("eval.jsonl", '"final"\n', "eval.jsonl:1: expected a JSON object"),
    "eval-step": ("eval.jsonl", '{"tag": "final", "accuracy": 0.5}\n', "eval.jsonl:1: 'step' must be an integer"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_compare_refuses_a_hostile_run_file_naming_it(case, tmp_path, capsys):
    name, content, says = CASES[case]
    runs = []
    for r in ("good", "bad"):
        (tmp_path / r).mkdir()
        (tmp_path / r / "metrics.jsonl").write_text(GOOD_ROW)
        runs.append(tmp_path / r)
    target = runs[1] / name
    target.write_bytes(content if isinstance(content, bytes) else content.encode())
    out = tmp_path / "cmp"
    t0 = time.perf_counter()
    assert main(["compare", *map(str, runs), "--out", str(out)]) == 2
    assert time.perf_counter() - t0 < 10  # the alias bomb stalled plain yaml.safe_load for minutes
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = error_line(err)
    assert line.startswith("cegppo compare: error: ") and f"{runs[1]}/{says}" in line, line
    assert not out.exists()  # nothing written


def test_read_jsonl_keeps_a_torn_last_line_rule():
    """The torn final append of a killed run is still skipped; a bad line before it is not."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.jsonl"
        p.write_text(GOOD_ROW + '{"step": 2, "entr')
        assert read_jsonl(p, int_keys=("step",)) == [{"step": 1, "entropy": 1.0, "reward/mean": 0.1}]
        p.write_text('{"step": 2, "entr\n' + GOOD_ROW)
        with pytest.raises(ValueError, match=r"m\.jsonl:1: not valid JSON"):
            read_jsonl(p)


def test_resume_reads_the_run_config_through_the_bounded_loader(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(LAUGHS)
    rd = RunDir(run)
    try:
        t0 = time.perf_counter()
        assert rd.read_config() is None
        assert time.perf_counter() - t0 < 2
        assert any("YAML expands to more than 100000 nodes" in r.getMessage() for r in caplog.records)
        (run / "config.yaml").write_text("train: {steps: 3}\n")
        assert rd.read_config() == {"train": {"steps": 3}}
    finally:
        rd.close()
