"""``make bench`` copies each results table into the docs pages between their markers."""

import re
import shutil
import subprocess

import pytest

from benchmarks import fill_docs


def test_fill_replaces_written_tables_and_keeps_pending_ones(tmp_path):
    (tmp_path / "chat.md").write_text("| a |\n|---|\n| 1 |\n")
    text = ("intro\n<!-- results: chat -->\nold table\n<!-- /results -->\nmiddle\n"
            "<!-- results: serving -->\n_Pending_\n<!-- /results -->\n")
    filled = fill_docs.fill(text, tmp_path, source=lambda table: f"_from {table.name}_")
    assert filled == ("intro\n<!-- results: chat -->\n\n| a |\n|---|\n| 1 |\n\n_from chat.md_\n\n<!-- /results -->\n"
                      "middle\n<!-- results: serving -->\n_Pending_\n<!-- /results -->\n")
    assert fill_docs.fill(filled, tmp_path, source=lambda table: f"_from {table.name}_") == filled  # idempotent


def test_source_line_names_the_file_and_a_day(tmp_path):
    table = tmp_path / "chat.md"  # outside git: the day it was written
    table.write_text("| a |\n")
    assert re.fullmatch(r"_Measured \d{4}-\d\d-\d\d; from `benchmarks/results/chat.md` \(`make bench` rewrites it\)._",
                        fill_docs.source_line(table))


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_committed_tables_are_dated_by_their_commit():
    table = fill_docs.RESULTS / "kernels.md"
    git = subprocess.run(["git", "log", "-1", "--format=%cs", "--", table.name], cwd=table.parent,
                         capture_output=True, text=True)
    if git.returncode or not git.stdout.strip():
        pytest.skip("not a git checkout")
    if subprocess.run(["git", "status", "--porcelain", "--", table.name], cwd=table.parent,
                      capture_output=True, text=True).stdout.strip():
        pytest.skip("kernels.md has changed since its commit (make bench): dated by the file instead")
    assert fill_docs.measured(table) == git.stdout.strip()


def test_the_docs_hold_every_committed_table_as_the_fill_step_writes_it():
    """docs/ holds what ``python -m benchmarks.fill_docs`` would write: no page shows a stale
    table (the days aside: a table committed after the fill step ran is dated by its commit)."""
    def undated(text):
        return re.sub(r"_Measured [\d-]+;", "_Measured DAY;", text)

    pages = {page: page.read_text() for page in sorted(fill_docs.DOCS.glob("*.md"))}
    named = {m["name"] for text in pages.values() for m in fill_docs._BLOCK.finditer(text)}
    committed = {table.stem for table in fill_docs.RESULTS.glob("*.md") if not table.stem.endswith("_quick")}
    assert committed <= named, f"tables no page shows: {sorted(committed - named)}"
    for page, text in pages.items():
        assert undated(fill_docs.fill(text)) == undated(text), f"{page.name} is stale: python -m benchmarks.fill_docs"


def test_the_readme_results_come_from_the_files_they_name():
    """README's headline table is typed in: each number of its Result column must be in the
    results file its row names, and the row's day the day that file was measured."""
    readme = (fill_docs.DOCS.parent / "README.md").read_text()
    table = re.search(r"<!-- headline results:.*?-->\n(.*?)<!-- /headline results -->", readme, re.DOTALL)
    assert table, "README.md has no headline results table"
    rows = [line.strip("|").split("|") for line in table.group(1).splitlines()[2:]]
    assert rows
    number = re.compile(r"\d+(?:\.\d+)?")
    for measure, result, source in rows:
        name, day = re.fullmatch(r"\s*`(\w+\.md)`, (\d{4}-\d\d-\d\d)\s*", source).groups()
        path = fill_docs.RESULTS / name
        measured = set(number.findall(path.read_text()))
        missing = [n for n in number.findall(result) if n not in measured]
        assert not missing, f"README row {measure.strip()!r}: {missing} not in {name}"
        if shutil.which("git"):
            assert day == fill_docs.measured(path), f"README row {measure.strip()!r}: {name} is from another day"
