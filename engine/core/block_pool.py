"""A pool of physical KV blocks: a reference count per block and a free list.

On the device pool, a block whose last reference goes away while it holds a prefix-cache entry
is not freed but becomes evictable (see `engine.core.prefix_cache`); `take_device` and
`release_device` implement that split. The host pool (swap space) has no cache.
"""

import dataclasses
from collections.abc import Iterable, Iterator, Mapping

from rpds import HashTrieMap

from engine.core import prefix_cache
from engine.core.prefix_cache import PrefixCache
from engine.core.records import record


@record(eq=False)
class FreeList:
    """Free blocks in the order they are handed out, first in first out. Persistent: the blocks
    sit at positions ``head ..`` of a hash trie, so taking or returning k blocks costs k small
    updates, never a copy of a list as long as the pool (a GPU's holds 10^5 blocks)."""

    slots: HashTrieMap = HashTrieMap()
    head: int = 0

    @classmethod
    def of(cls, blocks: Iterable[int]) -> "FreeList":
        """A free list of ``blocks``, in order (built at once: a whole pool's list in 0.1 s)."""
        return cls(HashTrieMap(dict(enumerate(blocks))))

    def __len__(self) -> int:
        return len(self.slots)

    def __iter__(self) -> Iterator[int]:
        return (self.slots[i] for i in range(self.head, self.head + len(self.slots)))

    def __eq__(self, other) -> bool:
        return isinstance(other, FreeList) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"FreeList({list(self)})"

    def take(self, num_blocks: int) -> tuple["FreeList", tuple[int, ...]]:
        """The first ``num_blocks`` blocks, and the list without them."""
        positions = range(self.head, self.head + num_blocks)
        slots = self.slots
        for position in positions:
            slots = slots.remove(position)
        return FreeList(slots, self.head + num_blocks), tuple(self.slots[i] for i in positions)

    def extend(self, blocks: Iterable[int]) -> "FreeList":
        """The list with ``blocks`` at its end, in order."""
        tail = self.head + len(self.slots)
        updates = {tail + i: block for i, block in enumerate(blocks)}
        return FreeList(self.slots.update(updates), self.head) if updates else self


@record
class BlockPool:
    """Reference count per physical block (a persistent map over every block id), and the
    free list (refcount 0, not prefix-cached)."""

    refcounts: Mapping[int, int]
    free: FreeList


def empty_pool(num_blocks: int) -> BlockPool:
    """`num_blocks` blocks, all free, handed out in ascending order."""
    return BlockPool(refcounts=HashTrieMap(dict.fromkeys(range(num_blocks), 0)), free=FreeList.of(range(num_blocks)))


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Number of blocks needed to hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def add_refs(pool: BlockPool, blocks: Iterable[int]) -> BlockPool:
    """One more reference to each listed block (a block listed twice gets two)."""
    counts = {}
    for block in blocks:
        counts[block] = counts.get(block, pool.refcounts[block]) + 1
    return dataclasses.replace(pool, refcounts=pool.refcounts.update(counts)) if counts else pool


def _drop_refs(pool: BlockPool, blocks: Iterable[int]) -> tuple[BlockPool, tuple[int, ...]]:
    """One reference fewer to each listed block; also returns the blocks that reached zero."""
    counts, released = {}, []
    for block in blocks:
        count = counts.get(block, pool.refcounts[block])
        assert count > 0, f"block {block} released more often than referenced"
        counts[block] = count - 1
        if count == 1:
            released.append(block)
    if not counts:
        return pool, ()
    return dataclasses.replace(pool, refcounts=pool.refcounts.update(counts)), tuple(released)


def take(pool: BlockPool, num_blocks: int) -> tuple[BlockPool, tuple[int, ...]]:
    """Remove `num_blocks` blocks from the free list (their refcount is still 0)."""
    assert num_blocks <= len(pool.free), "pool exhausted"
    if not num_blocks:
        return pool, ()
    free, blocks = pool.free.take(num_blocks)
    return dataclasses.replace(pool, free=free), blocks


def take_run(pool: BlockPool, first: int, num_blocks: int) -> BlockPool:
    """Remove the free blocks ``first .. first + num_blocks - 1`` from the free list."""
    run = range(first, first + num_blocks)
    assert all(pool.refcounts[block] == 0 for block in run), "run holds a referenced block"
    free = FreeList.of(block for block in pool.free if not first <= block < first + num_blocks)
    assert len(free) == len(pool.free) - num_blocks, "run holds a block that is not free"
    return dataclasses.replace(pool, free=free)


def release(pool: BlockPool, blocks: Iterable[int]) -> BlockPool:
    """Drop one reference per listed block; blocks left unreferenced go to the free list."""
    pool, released = _drop_refs(pool, blocks)
    return dataclasses.replace(pool, free=pool.free.extend(released))


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
    return dataclasses.replace(pool, free=pool.free.extend(uncached)), cache
