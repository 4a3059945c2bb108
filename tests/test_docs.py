"""The docs cannot show a removed API again: every ```python block of README.md and docs/*.md runs here, each in a
fresh namespace (a block that needs inputs defines them). A block that cannot run (a multi-GB download, pseudo-code)
is marked on the line right above it with ``<!-- docs-test: skip: REASON -->``; its imports are still executed, so a
name it imports that is gone still fails. And every citation of a section of docs/algorithm.md in the package
(``docs/algorithm.md §6.2``, ``docs/algorithm.md, "Objectives"``) and every ``*.md#anchor`` link in the docs names a
heading that exists.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"<!--\s*docs-test:\s*skip:\s*(.+?)\s*-->")
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)

# Blocks that run only as far as their imports, for files whose owners have not marked them yet: (file, sha1 of the
# block's text) -> reason. Keyed by content: once the block changes, it runs in full (or needs a mark in the file).
IMPORTS_ONLY: dict[tuple[str, str], str] = {}
# Blocks known to fail, reported to their owner: (file, sha1 prefix) -> why. strict: once fixed, the entry must go.
KNOWN_BROKEN: dict[tuple[str, str], str] = {}


def blocks() -> list[tuple[str, int, str, str | None]]:
    """(file, line, code, skip reason) of every ```python block."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = SKIP.search(before)
            out.append((str(path.relative_to(ROOT)), line, m.group(1), mark.group(1) if mark else None))
    return out


def digest(code: str) -> str:
    return hashlib.sha1(code.encode()).hexdigest()[:10]


BLOCKS = blocks()


def test_docs_have_python_blocks():
    assert any(f == "docs/algorithm.md" for f, *_ in BLOCKS), "docs/algorithm.md's API example is gone?"


def run_imports(code: str, where: str) -> None:
    tree = ast.parse(code, where)
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    exec(compile(ast.Module(body=imports, type_ignores=[]), where, "exec"), {"__name__": "__docs__"})


@pytest.mark.parametrize("file,line,code,skip", BLOCKS, ids=[f"{f}:{ln}" for f, ln, _, _ in BLOCKS])
def test_doc_block_runs(file, line, code, skip, tmp_path, monkeypatch, request):
    where = f"{file}:{line}"
    key = (file, digest(code))
    reason = skip or IMPORTS_ONLY.get(key)
    if key in KNOWN_BROKEN:
        request.applymarker(pytest.mark.xfail(reason=KNOWN_BROKEN[key], strict=True))
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    if reason:
        run_imports(code, where)  # the imports still have to exist
        pytest.skip(f"{where}: {reason} (imports checked)")
    exec(compile(code, where, "exec"), {"__name__": "__docs__"})


def test_skip_tables_name_existing_blocks():
    """An entry of IMPORTS_ONLY / KNOWN_BROKEN whose block changed is stale: remove it (the block runs now)."""
    present = {(f, digest(code)) for f, _, code, _ in BLOCKS}
    stale = [k for k in (*IMPORTS_ONLY, *KNOWN_BROKEN) if k not in present]
    assert not stale, f"no such block any more (edited?): {stale}; remove the entries"


# ------------------------------------------------------------------------------------ section citations and anchors
def headings(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text())
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6}\s+(.+)$", text, re.M)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


ALGORITHM = headings(ROOT / "docs" / "algorithm.md")
CITATION = re.compile(r"docs/algorithm\.md((?:[ ,]*(?:§[\d.]+(?:-§?[\d.]+)?|\"[^\"]+\"|and))*)")


def cited_sections(text: str) -> list[tuple[str, str]]:
    """('§', '6.2') / ('name', 'Objectives') for each section a citation of docs/algorithm.md names."""
    out = []
    for m in CITATION.finditer(text):
        tail = m.group(1)
        out += [("§", n.rstrip(".")) for n in re.findall(r"§([\d.]+)", tail)]
        out += [("name", n) for n in re.findall(r"\"([^\"]+)\"", tail)]
    return out


def resolves(kind: str, value: str) -> bool:
    if kind == "§":
        return any(re.match(rf"{re.escape(value)}\.?\s", h) for h in ALGORITHM)
    return any(value.lower() in h.lower() for h in ALGORITHM)


def source_files() -> list[Path]:
    src = ROOT / "src" / "cegppo"
    return sorted(p for ext in ("py", "yaml", "sh") for p in src.rglob(f"*.{ext}"))


def test_citation_parser():
    text = 'x (docs/algorithm.md §6.2), y (docs/algorithm.md, "Notation" and "Clip regions"), z docs/algorithm.md §2.1-§2.2'
    assert cited_sections(text) == [("§", "6.2"), ("name", "Notation"), ("name", "Clip regions"), ("§", "2.1"),
                                    ("§", "2.2")]
    assert resolves("§", "6.2") and resolves("name", "Notation") and not resolves("name", "Clip regions")
    assert not resolves("§", "13") and not resolves("§", "2.9")  # sections that do not exist


def test_every_algorithm_md_citation_in_the_package_resolves():
    bad, seen = [], 0
    for path in source_files():
        for kind, value in cited_sections(path.read_text(errors="replace")):
            seen += 1
            if not resolves(kind, value):
                bad.append(f"{path.relative_to(ROOT)}: docs/algorithm.md {kind if kind == '§' else ''}{value}")
    assert seen >= 5, "the citation pattern found almost nothing: is it still right?"
    assert not bad, "sections of docs/algorithm.md cited but missing:\n" + "\n".join(bad)


def test_every_markdown_anchor_link_resolves():
    link = re.compile(r"\b([\w./-]+\.md)#([\w-]+)")
    bad = []
    for path in [*DOCS, *source_files()]:
        for target, anchor in link.findall(path.read_text(errors="replace")):
            doc = (path.parent / target) if (path.parent / target).exists() else ROOT / "docs" / Path(target).name
            if not doc.exists():
                bad.append(f"{path.relative_to(ROOT)}: {target} does not exist")
            elif anchor not in {slug(h) for h in headings(doc)}:
                bad.append(f"{path.relative_to(ROOT)}: {target}#{anchor} names no heading")
    assert not bad, "\n".join(bad)


if os.environ.get("CEGPPO_PRINT_DOC_BLOCKS"):  # to fill the tables above: the digest of every block
    for f, ln, c, _ in BLOCKS:
        print(f, ln, digest(c))


def test_one_quickstart_duration_everywhere():
    """The quickstart's duration is one figure, from a results file (the runs of quickstart_seeds.json that had the
    machine to themselves), in the README, the CLI's help and the YAML."""
    import json

    from cegppo.cli import build_parser

    result = json.loads((ROOT / "benchmarks" / "results" / "quickstart_seeds.json").read_text())
    alone = result["summary"]["duration_alone_min"]
    assert alone, "quickstart_seeds.json has no run that was alone on the machine: no duration to quote"
    phrase = f"about {round(alone['mean'])} minutes"
    texts = {"README.md": (ROOT / "README.md").read_text(), "cegppo --help": build_parser().description,
             "quickstart.yaml": (ROOT / "src" / "cegppo" / "examples" / "quickstart.yaml").read_text()}
    for name, text in texts.items():
        assert phrase in " ".join(text.split()), f"{name} does not say {phrase!r}"
        others = set(re.findall(r"(\d+)[- ]minute", text)) - {phrase.split()[1]}
        assert not others, f"{name} quotes other durations: {others} minutes"
