"""The documentation holds together: the README stays a front page with the CI's test command, every relative link in
the README, the Hub card and docs/ reaches an existing file and heading, every tuning-log pointer in the code reaches
an entry, every target of benchmarks/report.py is stated in docs/targets.md, the generated results pages are what
the committed CSVs give, and the README's op map names every public op. No build or GPU needed."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CARD = ROOT / "CARD.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, CARD, ROOT / "benchmarks" / "README.md", *DOCS]
START, END = "<!-- results:start -->", "<!-- results:end -->"

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose(text: str) -> list[str]:
    """The lines of a markdown text outside fenced code blocks."""
    out, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            out.append(line)
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to
    hyphens."""
    return "".join(c for c in heading.strip().lower() if c.isalnum() or c in " -_").replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(page.read_text()):
        m = HEADING.match(line)
        if not m:
            continue
        base = _slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def _links(page: Path) -> list[str]:
    return [m.group(1) for line in _prose(page.read_text()) for m in LINK.finditer(line)]


def _broken(page: Path, target: str) -> str | None:
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
        return f"{page.relative_to(ROOT)}: link to {target}: no such file"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{page.relative_to(ROOT)}: link to {target}: no heading with that anchor in {dest.name}"
    return None


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move detail to docs/ (limit 200)"


def test_readme_has_the_ci_test_command():
    """.ci/run runs the first line of the code block that follows the marker (its awk), so it must be there."""
    lines = README.read_text().splitlines()
    assert "<!-- ci:test-command -->" in lines, "README.md lost the <!-- ci:test-command --> marker that .ci/run reads"
    i = lines.index("<!-- ci:test-command -->") + 1
    while i < len(lines) and lines[i].startswith("```"):
        i += 1
    assert i < len(lines) and "pytest tests" in lines[i], f"no test command after the marker: {lines[i:i + 1]}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    problems = [p for t in _links(page) if not re.match(r"[a-z]+:", t) and (p := _broken(page, t))]
    assert not problems, "\n".join(problems)


def test_the_card_stands_alone():
    """CARD.md is uploaded as the Hub repository's README, where docs/ and the sources do not exist."""
    relative = [t for t in _links(CARD) if not re.match(r"[a-z]+:", t)]
    assert not relative, f"CARD.md links into the tree, which the Hub does not have: {relative}"


def test_the_card_is_a_kernels_hub_card():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import hub_tree
        from build_config import load_build_config
    finally:
        sys.path.pop(0)
    pytest.importorskip("huggingface_hub")
    assert hub_tree.card_problems(CARD, load_build_config(ROOT / "build.toml")) == []


def test_tuning_log_pointers_in_the_code_resolve():
    pointer = re.compile(r"docs/([\w-]+\.md)#([\w-]+)")
    problems, found = [], 0
    for d in ("kernels_src", "torch-ext", "benchmarks", "tools"):
        for f in sorted((ROOT / d).rglob("*")):
            if f.suffix not in {".cu", ".cuh", ".cpp", ".h", ".py", ".sh"}:
                continue
            for n, line in enumerate(f.read_text().splitlines(), 1):
                for page, anchor in pointer.findall(line):
                    found += 1
                    if not (ROOT / "docs" / page).exists() or anchor not in anchors(ROOT / "docs" / page):
                        problems.append(f"{f.relative_to(ROOT)}:{n}: docs/{page}#{anchor} does not exist")
    assert found, "no docs/...md#anchor pointer found in the code: the pattern is wrong"
    assert not problems, "\n".join(problems)


@cache
def _report():
    spec = importlib.util.spec_from_file_location("fused_mlp_report", ROOT / "benchmarks" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up while the module is being executed
    spec.loader.exec_module(mod)
    return mod


def _section(text: str, where: str) -> str:
    assert START in text and END in text, f"{where}: no {START} ... {END} section"
    return text.split(START, 1)[1].split(END, 1)[0].lstrip("\n")


def test_targets_page_states_every_target():
    """Each target report.py checks is listed (by id) under its group's heading in docs/targets.md."""
    report = _report()
    text = (ROOT / "docs" / "targets.md").read_text()
    sections: dict[str, str] = {}
    current = None
    for line in _prose(text):
        m = HEADING.match(line)
        if m and len(m.group(1)) == 2:
            current = m.group(2)
            sections[current] = ""
        elif current:
            sections[current] += line + "\n"
    assert list(sections) == list(report.GROUPS), "docs/targets.md's sections are not report.py's GROUPS, in order"
    missing = [t["id"] for t in report.TARGETS if f"`{t['id']}`" not in sections.get(t["group"], "")]
    assert not missing, f"targets in benchmarks/report.py not stated under their heading in docs/targets.md: {missing}"
    listed = set(re.findall(r"^\| `([\w-]+)` \|", text, re.M))
    extra = listed - {t["id"] for t in report.TARGETS}
    assert not extra, f"docs/targets.md lists targets report.py does not check: {sorted(extra)}"


def test_results_pages_are_generated_from_the_committed_csvs():
    """The command in benchmarks/README.md, replayed: RESULTS.md, docs/results.md's section and the README's status
    block are exactly what report.py makes of the committed CSVs (no number typed by hand, none stale)."""
    report = _report()
    rows = []
    for csv in sorted((ROOT / "benchmarks" / "results").glob("*/*.csv")):
        rows += report.read_rows(csv)
    out, results = ROOT / "benchmarks" / "results" / "RESULTS.md", ROOT / "docs" / "results.md"
    pages = report.generated(rows, out=out, results=results, readme=README)
    assert out.read_text() == pages[out], "benchmarks/results/RESULTS.md is stale: rerun benchmarks/report.py"
    for page in (results, README):
        assert _section(page.read_text(), page.name) == pages[page], (
            f"{page.relative_to(ROOT)}'s generated section is stale: rerun the command in benchmarks/README.md")


def test_readme_op_map_names_every_public_op():
    """From the README's "Find an op" table a reader reaches each op's code, tests, benchmark and tuning log."""
    tree = ast.parse((ROOT / "torch-ext" / "fused_mlp" / "__init__.py").read_text())
    public = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                  and any(getattr(t, "id", None) == "__all__" for t in node.targets))
    ops = [n for n in public if not n.endswith("_reference") and n != "layers"]
    text = README.read_text()
    assert "## Find an op" in text, "README.md lost its 'Find an op' table"
    table = text.split("## Find an op", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    missing = [op for op in ops if not any(f"`{op}`" in row.split("|")[1] for row in rows)]
    assert not missing, f"ops missing from the README's 'Find an op' table: {missing}"
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(cells[i] for i in (1, 4, 5, 6)), f"an op row needs its Python file, tests, benchmark and log: {row}"
        # the Python files linked for an op define its reference (so a split or moved op is noticed)
        code = "".join((ROOT / t).read_text() for t in re.findall(r"\]\(([^)#]+\.py)\)", cells[1]))
        for op in re.findall(r"`(\w+)`", cells[0]):
            assert f"def {op}_reference(" in code, f"README 'Find an op': {op}_reference is not in {cells[1]}"


def test_security_page_names_every_environment_variable():
    """SECURITY.md lists the environment variables the package reads: every `FUSED_MLP_*` name in the kernel
    sources (C++ `getenv`) and the Python package."""
    sources = [f for d in ("kernels_src", "torch-ext") for pattern in ("*.c*", "*.h", "*.py")
               for f in (ROOT / d).rglob(pattern)]
    names = {m for f in sources for m in re.findall(r"\"(FUSED_MLP_[A-Z0-9_]+)\"", f.read_text())}
    assert "FUSED_MLP_CPU_BASELINE" in names and len(names) > 10
    page = (ROOT / "SECURITY.md").read_text()
    missing = sorted(n for n in names if f"`{n}" not in page)
    assert not missing, f"SECURITY.md does not name {missing}"
