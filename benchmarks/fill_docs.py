"""Copy the benchmark tables into the documentation pages.

    python -m benchmarks.fill_docs        # the last step of ``make bench`` and ``make bench-gpu``

Each table sits in a page of ``docs/`` between ``<!-- results: NAME -->`` and
``<!-- /results -->``, where ``benchmarks/results/NAME.md`` is the table a benchmark wrote;
everything between the markers is replaced by the table and a line naming its file and the day
it was measured. A table that has not been written yet leaves its placeholder alone. The plots
(``NAME.png``) are not copied: the site publishes them from ``benchmarks/results/`` (docs/hooks.py).
"""

from __future__ import annotations

import datetime
import pathlib
import re
import subprocess
from collections.abc import Callable

from benchmarks.timing import RESULTS

DOCS = pathlib.Path(__file__).parent.parent / "docs"
_BLOCK = re.compile(r"(<!-- results: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.DOTALL)


def measured(table: pathlib.Path) -> str:
    """The day ``table`` was measured, as YYYY-MM-DD: the day of the commit that last changed it,
    or, when it has changed since (``make bench`` just rewrote it) or is outside git, the day
    the file was written."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args, "--", table.name], cwd=table.parent, capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        if not git("status", "--porcelain") and (day := git("log", "-1", "--format=%cs")):
            return day
    except (OSError, subprocess.CalledProcessError):  # no git, or not a repository
        pass
    return datetime.datetime.fromtimestamp(table.stat().st_mtime, datetime.UTC).date().isoformat()


def source_line(table: pathlib.Path) -> str:
    """The line under a copied table: which file it came from and when it was measured."""
    return f"_Measured {measured(table)}; from `benchmarks/results/{table.name}` (`make bench` rewrites it)._"


def fill(text: str, results: pathlib.Path = RESULTS,
         source: Callable[[pathlib.Path], str] = source_line) -> str:
    """``text`` with every results block holding the current contents of its table."""
    def replace(match: re.Match) -> str:
        table = results / f"{match['name']}.md"
        if not table.exists():
            return match.group(0)
        return f"{match.group(1)}\n{table.read_text().strip()}\n\n{source(table)}\n\n{match.group(4)}"
    return _BLOCK.sub(replace, text)


def main() -> None:
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        if blocks := len(_BLOCK.findall(text)):
            page.write_text(fill(text))
            print(f"updated {page.relative_to(DOCS.parent)} with {blocks} tables from {RESULTS}")


if __name__ == "__main__":
    main()
