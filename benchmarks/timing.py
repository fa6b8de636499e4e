"""Measuring and reporting: shared by every benchmark script.

This machine is shared and noisy, so variants are timed interleaved, round
after round, and the median per variant is reported; compare ratios from
one run, never absolute numbers across runs.
"""

from __future__ import annotations

import pathlib
import statistics
import time
from collections.abc import Callable

import jax

RESULTS = pathlib.Path(__file__).parent / "results"


def time_interleaved(variants: dict[str, Callable[[], object]], *, rounds: int = 7,
                     min_seconds: float = 0.05) -> dict[str, float]:
    """Median seconds per call of each zero-argument callable, run round-robin.

    Each callable is warmed up (compiled) first; within a round it is called
    enough times to take ``min_seconds``.
    """
    repeats = {}
    for name, fn in variants.items():
        jax.block_until_ready(fn())
        start = time.perf_counter()
        jax.block_until_ready(fn())
        once = max(time.perf_counter() - start, 1e-6)
        repeats[name] = max(1, int(min_seconds / once))
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            for _ in range(repeats[name]):
                out = fn()
            jax.block_until_ready(out)
            samples[name].append((time.perf_counter() - start) / repeats[name])
    return {name: statistics.median(values) for name, values in samples.items()}


def print_table(headers: list[str], rows: list[list[object]]) -> str:
    """Print (and return) a Markdown table."""
    def cell(value):
        return f"{value:.3g}" if isinstance(value, float) else str(value)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def save_figure(fig, name: str) -> pathlib.Path:
    """Write a matplotlib figure to ``benchmarks/results/<name>.png``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def save_text(text: str, name: str) -> pathlib.Path:
    """Write a table to ``benchmarks/results/<name>.md``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.md"
    path.write_text(text + "\n")
    return path


def result_name(name: str, quick: bool) -> str:
    """File name under ``benchmarks/results/``: quick runs never overwrite full results."""
    return f"{name}_quick" if quick else name
