"""Buddy allocation over the device blocks: how the paper's Orca baselines place their KV.

The paper's Orca keeps each request's KV in one contiguous region and "uses the buddy
allocation algorithm to determine the memory address" (§6.1). A buddy allocator hands out
aligned runs of a power-of-two number of blocks: a request of 9 blocks gets 16, the 7 extra
blocks are internal fragmentation, and a free run of 16 must exist at an aligned address even
when 16 blocks are free in total (external fragmentation). Freed runs merge back with their
buddies.

With every merge done, a run of ``2**order`` blocks starting at a multiple of ``2**order`` is
allocatable exactly when all its blocks are free, so the free set alone is the allocator's
state. Like a buddy allocator, :func:`find_run` takes the run from the smallest free buddy that
holds one (splitting it), lowest address first, which keeps large buddies whole.
"""

from collections.abc import Collection

import numpy as np


def order_for(num_blocks: int) -> int:
    """The smallest order whose run of ``2**order`` blocks holds ``num_blocks`` (0 for 0 or 1)."""
    return max(0, num_blocks - 1).bit_length()


def find_run(free: Collection[int], num_blocks: int, order: int) -> int | None:
    """First block of the run of ``2**order`` free blocks a buddy allocator hands out from a
    pool of ``num_blocks`` blocks (ids ``0 .. num_blocks - 1``) whose free blocks are ``free``;
    None when no aligned run of that size is free."""
    levels = _free_runs(free, num_blocks)
    if order >= len(levels) or not levels[order].any():
        return None
    runs = np.flatnonzero(levels[order])
    # A free run's largest free enclosing buddy: every free ancestor adds one order.
    enclosing = np.full(runs.shape, order)
    for level in range(order + 1, len(levels)):
        ancestors = runs >> (level - order)
        inside = ancestors < levels[level].size
        enclosing += inside & levels[level][np.minimum(ancestors, levels[level].size - 1)]
    return int(runs[np.argmin(enclosing)]) << order  # argmin: the lowest address among ties


def _free_runs(free: Collection[int], num_blocks: int) -> list[np.ndarray]:
    """``levels[k][i]``: whether run ``i`` of ``2**k`` blocks (blocks ``i * 2**k`` onwards) is free."""
    level = np.zeros(num_blocks, bool)
    level[np.fromiter(free, np.int64, len(free))] = True
    levels = [level]
    while level.size > 1:
        level = level[: level.size // 2 * 2].reshape(-1, 2).all(axis=1)
        levels.append(level)
    return levels


def fits_in_empty_pool(num_blocks: int, order: int) -> bool:
    """Whether a pool of ``num_blocks`` blocks has any aligned run of ``2**order`` blocks."""
    return 1 << order <= num_blocks
