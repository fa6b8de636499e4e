"""The padded sizes a step's arrays are rounded up to, so that a few compiled programs serve
every step (:class:`engine.worker.model_runner.ModelRunner`'s buckets of rows and tokens)."""

from __future__ import annotations

from collections.abc import Sequence


def powers_of_two(low: int, high: int, *, factor: int = 2) -> tuple[int, ...]:
    """low, factor*low, ... up to the first of them >= high (inclusive)."""
    sizes = [low]
    while sizes[-1] < high:
        sizes.append(sizes[-1] * factor)
    return tuple(sizes)


def token_sizes(low: int, high: int) -> tuple[int, ...]:
    """The token buckets of steps with prompts: :func:`powers_of_two` from ``low``, and three
    quarters of each of them from 1024 on (768, 1536, ...). A step of 1100 prompt tokens then
    runs 1536 rows, not 2048: at these sizes a step costs time in proportion to its rows
    (about 0.65 ms per row in float32 here), while each extra size costs one more layer
    program to compile at start-up."""
    sizes = powers_of_two(low, high)
    extra = [size * 3 // 4 for size in sizes if size >= 1024 and size * 3 // 4 > low]
    return tuple(sorted({*sizes, *extra}))


def bucket(sizes: Sequence[int], n: int) -> int:
    """The smallest size that holds ``n``."""
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")
