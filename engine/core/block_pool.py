"""A pool of physical KV blocks: a reference count per block and a free list.

On the device pool, a block whose last reference goes away while it holds a prefix-cache entry
is not freed but becomes evictable (see `engine.core.prefix_cache`); `take_device` and
`release_device` implement that split. The host pool (swap space) has no cache.
"""

import dataclasses
from collections.abc import Iterable

from engine.core import prefix_cache
from engine.core.prefix_cache import PrefixCache


@dataclasses.dataclass(frozen=True)
class BlockPool:
    """Reference count per physical block, and the free list (refcount 0, not prefix-cached)."""

    refcounts: tuple[int, ...]
    free: tuple[int, ...]


def empty_pool(num_blocks: int) -> BlockPool:
    """`num_blocks` blocks, all free, handed out in ascending order."""
    return BlockPool(refcounts=(0,) * num_blocks, free=tuple(range(num_blocks)))


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Number of blocks needed to hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def add_refs(pool: BlockPool, blocks: Iterable[int]) -> BlockPool:
    """One more reference to each listed block (a block listed twice gets two)."""
    refcounts = list(pool.refcounts)
    for block in blocks:
        refcounts[block] += 1
    return dataclasses.replace(pool, refcounts=tuple(refcounts))


def _drop_refs(pool: BlockPool, blocks: Iterable[int]) -> tuple[BlockPool, tuple[int, ...]]:
    """One reference fewer to each listed block; also returns the blocks that reached zero."""
    refcounts = list(pool.refcounts)
    released = []
    for block in blocks:
        assert refcounts[block] > 0, f"block {block} released more often than referenced"
        refcounts[block] -= 1
        if refcounts[block] == 0:
            released.append(block)
    return dataclasses.replace(pool, refcounts=tuple(refcounts)), tuple(released)


def take(pool: BlockPool, num_blocks: int) -> tuple[BlockPool, tuple[int, ...]]:
    """Remove `num_blocks` blocks from the free list (their refcount is still 0)."""
    assert num_blocks <= len(pool.free), "pool exhausted"
    return dataclasses.replace(pool, free=pool.free[num_blocks:]), pool.free[:num_blocks]


def take_run(pool: BlockPool, first: int, num_blocks: int) -> BlockPool:
    """Remove the free blocks ``first .. first + num_blocks - 1`` from the free list."""
    run = range(first, first + num_blocks)
    assert all(pool.refcounts[block] == 0 for block in run), "run holds a referenced block"
    free = tuple(block for block in pool.free if not first <= block < first + num_blocks)
    assert len(free) == len(pool.free) - num_blocks, "run holds a block that is not free"
    return dataclasses.replace(pool, free=free)


def release(pool: BlockPool, blocks: Iterable[int]) -> BlockPool:
    """Drop one reference per listed block; blocks left unreferenced go to the free list."""
    pool, released = _drop_refs(pool, blocks)
    return dataclasses.replace(pool, free=pool.free + released)


def num_available(pool: BlockPool, cache: PrefixCache) -> int:
    """Blocks a device pool can hand out: the free list plus evictable cached blocks."""
    return len(pool.free) + len(cache.evictable)


def take_device(
    pool: BlockPool, cache: PrefixCache, num_blocks: int
) -> tuple[BlockPool, PrefixCache, tuple[int, ...]]:
    """Unreferenced blocks: from the free list, then by evicting cached blocks (LRU)."""
    assert num_blocks <= num_available(pool, cache), "device pool exhausted"
    pool, from_free = take(pool, min(num_blocks, len(pool.free)))
    cache, evicted = prefix_cache.evict(cache, num_blocks - len(from_free))
    return pool, cache, from_free + evicted


def release_device(
    pool: BlockPool, cache: PrefixCache, blocks: Iterable[int]
) -> tuple[BlockPool, PrefixCache]:
    """Drop references; unreferenced cached blocks become evictable (in the order listed), the
    others free."""
    pool, released = _drop_refs(pool, blocks)
    uncached = tuple(b for b in released if not prefix_cache.is_cached(cache, b))
    cache = prefix_cache.release(cache, (b for b in released if prefix_cache.is_cached(cache, b)))
    return dataclasses.replace(pool, free=pool.free + uncached), cache
