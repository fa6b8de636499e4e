"""Seconds from ``python -m engine.serve`` (default model, default settings) to a healthy
server: weights loaded and every bucket compiled.

    python -m benchmarks.startup [--rounds N] [--quick]

First start: a cache directory (``PALLAS_PAGED_CACHE_DIR``) holding only the native CPU
kernels, as ``make install`` leaves it (``make serve``'s first start), so the GGUF file is
converted and every program compiled. Cold: an empty cache directory, so the kernels are
built with the C++ compiler too (about 7 s here). Warm: the cold run's directory again, as on
every start after the first. The target is 30 s (vLLM's CPU build, whose kernels come
compiled in its wheel, takes 45-58 s on this machine). Rounds run the three in turn; the
table has the median and the slowest.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import tempfile
import time
from unittest import mock

from benchmarks import offline
from benchmarks.timing import print_table, result_name, save_text
from pallas_paged import native
from tests.engine.server import running_server

TARGET_SECONDS = 30.0


def cache_directory(path: str):
    """Run the servers started inside with ``path`` as their cache root."""
    return mock.patch.dict(os.environ, PALLAS_PAGED_CACHE_DIR=path)


def installed_kernels() -> pathlib.Path:
    """The directory of the native kernels that ``make install`` builds (built now if missing)."""
    root = os.environ.get("PALLAS_PAGED_CACHE_DIR")
    if root == "":
        raise SystemExit("the start-up benchmark copies the cached native kernels: unset PALLAS_PAGED_CACHE_DIR "
                         "or point it at a directory, rather than turning caching off")
    native.available()
    return pathlib.Path(root or pathlib.Path.home() / ".cache" / "pallas-paged") / "native"


def seconds_to_healthy() -> float:
    start = time.perf_counter()
    with running_server():
        return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one round, written to startup_quick.md")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    note = offline.machine_note()
    kernels = installed_kernels()
    times = {"first start": [], "cold": [], "warm": []}

    def measure(kind):
        times[kind].append(seconds_to_healthy())
        print(f"{kind}: {times[kind][-1]:.1f} s", flush=True)

    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as root, cache_directory(root):
            shutil.copytree(kernels, pathlib.Path(root) / "native")
            measure("first start")
        with tempfile.TemporaryDirectory() as root, cache_directory(root):
            measure("cold")
            measure("warm")
    rows = [[kind, len(values), statistics.median(values), max(values), TARGET_SECONDS,
             "met" if max(values) <= TARGET_SECONDS else "missed"] for kind, values in times.items()]
    table = print_table(["start", "runs", "median s", "slowest s", "target s", "target"], rows)
    save_text(f"`python -m engine.serve` until /health answers 200; {note}.\n\n{table}",
              result_name("startup", args.quick))


if __name__ == "__main__":
    main()
