"""Copy the benchmark tables into README.md's "Results on this machine" section.

    python -m benchmarks.readme        # the last step of ``make bench``

Each table sits in the README between ``<!-- results: NAME -->`` and ``<!-- /results -->``,
where ``benchmarks/results/NAME.md`` is the table a benchmark wrote; everything between the
markers is replaced. A table that has not been written yet leaves its placeholder alone.
"""

from __future__ import annotations

import pathlib
import re

from benchmarks.timing import RESULTS

README = pathlib.Path(__file__).parent.parent / "README.md"
_BLOCK = re.compile(r"(<!-- results: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.DOTALL)


def fill(text: str, results: pathlib.Path = RESULTS) -> str:
    """``text`` with every results block holding the current contents of its table."""
    def replace(match: re.Match) -> str:
        table = results / f"{match['name']}.md"
        if not table.exists():
            return match.group(0)
        return f"{match.group(1)}\n{table.read_text().strip()}\n\n{match.group(4)}"
    return _BLOCK.sub(replace, text)


def main() -> None:
    text = README.read_text()
    README.write_text(fill(text))
    print(f"updated {README} with {len(_BLOCK.findall(text))} tables from {RESULTS}")


if __name__ == "__main__":
    main()
