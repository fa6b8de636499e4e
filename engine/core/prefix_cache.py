"""Prefix cache: full, computed KV blocks found again by their content.

A full block is identified by a hash of (its parent, its token ids), as in vLLM, except that
the parent is named by the entry id of the cached block before it (None for a sequence's first
block) instead of by the parent's hash. The key `(parent entry id, token ids)` is hashed by the
dict, which compares the token ids on a hash match, so a collision never returns the wrong
block; entry ids are never reused, so a parent id pins the entire prefix before the block. A key
thus names exactly one token prefix, which is what the block's KV depends on.

Only blocks whose KV has been computed are inserted (the block manager calls `insert_chains`
from `mark_computed`). Within one step, the full blocks that work already scheduled in it will
complete are *scheduled* entries, keyed by (the physical block before it, or None, token ids):
a request admitted later in the step shares them instead of computing the same KV again, as
vLLM V1 does. That is sound because the model writes every token's K and V of a layer before
any token of the step attends (`models.Metadata.write_and_attend`), and the step runs as one
forward pass. Scheduled entries last until the step is recorded.

A cached block that no sequence references is *evictable*: it counts as free, keeps its KV for
future hits, and is reused least-recently-released first once the free list is empty.

The persistent mapping helpers (`frozen_map`, `assoc`, `dissoc`) give the block manager's state
its maps too. They are hash array mapped tries (`rpds.HashTrieMap`): a new version with a few
keys changed shares the rest with the old one, so a step's updates cost what changed, not the
size of the map (a copied dict costs every sequence's or cached block's entry, per update).
"""

import dataclasses
from collections.abc import Iterable, Mapping

from rpds import HashTrieMap

from engine.core.records import record

Key = tuple[int | None, tuple[int, ...]]


def frozen_map(items: Mapping | Iterable[tuple] = ()) -> HashTrieMap:
    """A persistent mapping (compared by value with `==`) holding `items`."""
    return HashTrieMap(dict(items))


def assoc(mapping: HashTrieMap, updates: Mapping) -> HashTrieMap:
    """`mapping` with the keys of `updates` set to its values (sharing the rest)."""
    return mapping.update(updates) if updates else mapping


def dissoc(mapping: HashTrieMap, keys: Iterable) -> HashTrieMap:
    """`mapping` without `keys` (each must be there)."""
    for key in keys:
        mapping = mapping.remove(key)
    return mapping


@record
class CachedBlock:
    """One cache entry: physical device block `block` holds the tokens named by `key`."""

    entry_id: int
    block: int
    key: Key


@record
class PrefixCache:
    """Cache entries by key and by block, plus the LRU order of the evictable blocks.

    `num_queries` and `num_hits` count blocks looked up at admission and blocks found
    (cached or scheduled). `scheduled` maps (block before or None, token ids) to the block
    this step's work completes with them.
    """

    by_key: Mapping[Key, CachedBlock] = dataclasses.field(default_factory=frozen_map)
    by_block: Mapping[int, CachedBlock] = dataclasses.field(default_factory=frozen_map)
    scheduled: Mapping[tuple[int | None, tuple[int, ...]], int] = dataclasses.field(default_factory=frozen_map)
    evictable: tuple[int, ...] = ()
    next_entry_id: int = 0
    num_queries: int = 0
    num_hits: int = 0


def block_tokens(token_ids: tuple[int, ...], index: int, block_size: int) -> tuple[int, ...]:
    """The token ids stored in logical block `index` of a sequence."""
    return tuple(token_ids[index * block_size : (index + 1) * block_size])


def lookup(
    cache: PrefixCache, token_ids: tuple[int, ...], num_blocks: int, block_size: int
) -> tuple[CachedBlock, ...]:
    """The entries caching the leading full blocks of `token_ids`, stopping at the first miss.

    At most `num_blocks` blocks are looked up.
    """
    found: list[CachedBlock] = []
    parent = None
    for index in range(num_blocks):
        entry = cache.by_key.get((parent, block_tokens(token_ids, index, block_size)))
        if entry is None:
            break
        found.append(entry)
        parent = entry.entry_id
    return tuple(found)


def lookup_scheduled(
    cache: PrefixCache, token_ids: tuple[int, ...], found: tuple[int, ...], num_blocks: int, block_size: int
) -> tuple[int, ...]:
    """The scheduled blocks holding the leading full blocks of `token_ids` after the `found`
    ones (blocks already shared, in order), stopping at the first miss; at most `num_blocks`
    blocks in all."""
    blocks: list[int] = []
    parent = found[-1] if found else None
    for index in range(len(found), num_blocks):
        block = cache.scheduled.get((parent, block_tokens(token_ids, index, block_size)))
        if block is None:
            break
        blocks.append(block)
        parent = block
    return tuple(blocks)


def offer_scheduled(
    cache: PrefixCache, token_ids: tuple[int, ...], block_table: tuple[int, ...], num_tokens: int, block_size: int
) -> PrefixCache:
    """Enter the full blocks among the first `num_tokens` of a sequence (`token_ids`, held in
    `block_table`) as scheduled: they are computed by the end of the step."""
    entries, parent = {}, None
    for index in range(num_tokens // block_size):
        entries[(parent, block_tokens(token_ids, index, block_size))] = parent = block_table[index]
    if not entries:
        return cache
    return dataclasses.replace(cache, scheduled=assoc(cache.scheduled, entries))


def end_step(cache: PrefixCache) -> PrefixCache:
    """Forget the step's scheduled blocks: computed now, they are cached or nothing."""
    return dataclasses.replace(cache, scheduled=frozen_map()) if cache.scheduled else cache


def count_lookup(cache: PrefixCache, num_queried: int, num_hit: int) -> PrefixCache:
    """Record one admission's lookup in the hit statistics."""
    return dataclasses.replace(
        cache,
        num_queries=cache.num_queries + num_queried,
        num_hits=cache.num_hits + num_hit,
    )


def insert_chains(
    cache: PrefixCache, chains: Iterable[tuple[int | None, Iterable[tuple[tuple[int, ...], int]]]]
) -> tuple[PrefixCache, list[list[int]]]:
    """Cache runs of consecutive full blocks; each chain is (entry id of the block before it, or
    None, [(token ids, block), ...]).

    Returns the new cache and, per chain, the entry ids that now name its blocks' contents.
    When a content is cached already (another sequence computed the same prefix into another
    block), the existing entry is kept, its id returned, and the block stays uncached. When
    the block itself is cached already under another key, that entry is kept and its id
    returned: two sequences share the block (a hit on work scheduled in the same step) but
    name its prefix by different entries, one of them evicted since the sequence holding it
    chained through it (the sequence kept an uncached copy of that content). Either entry id
    names the same tokens, so the chain stays sound.
    """
    by_key, by_block, next_id = cache.by_key, cache.by_block, cache.next_entry_id
    new_by_key, new_by_block, chain_ids = {}, {}, []  # this call's entries, set in the maps at once
    for parent, blocks in chains:
        ids = []
        for token_ids, block in blocks:
            key = (parent, token_ids)
            held = new_by_key.get(key) or by_key.get(key)
            if held is None:
                held = new_by_block.get(block) or by_block.get(block)
                assert held is None or held.key[1] == token_ids, f"block {block} is cached with other tokens"
            if held is None:
                held = new_by_key[key] = new_by_block[block] = CachedBlock(entry_id=next_id, block=block, key=key)
                next_id += 1
            parent = held.entry_id
            ids.append(parent)
        chain_ids.append(ids)
    if not new_by_key:
        return cache, chain_ids
    cache = dataclasses.replace(cache, by_key=by_key.update(new_by_key), by_block=by_block.update(new_by_block),
                                next_entry_id=next_id)
    return cache, chain_ids


def is_cached(cache: PrefixCache, block: int) -> bool:
    """True when `block` holds a cache entry."""
    return block in cache.by_block


def acquire(cache: PrefixCache, blocks: Iterable[int]) -> PrefixCache:
    """Take `blocks` off the evictable list: a sequence references them again."""
    taken = set(blocks)
    if not taken.intersection(cache.evictable):
        return cache
    evictable = tuple(block for block in cache.evictable if block not in taken)
    return dataclasses.replace(cache, evictable=evictable)


def release(cache: PrefixCache, blocks: Iterable[int]) -> PrefixCache:
    """Make `blocks` (cached, no longer referenced) evictable; the first is evicted first."""
    blocks = tuple(blocks)
    assert all(is_cached(cache, block) for block in blocks)
    return dataclasses.replace(cache, evictable=cache.evictable + blocks)


def evict(cache: PrefixCache, num_blocks: int) -> tuple[PrefixCache, tuple[int, ...]]:
    """Drop the `num_blocks` least recently released evictable entries; return their blocks."""
    assert num_blocks <= len(cache.evictable), "evicting more blocks than are evictable"
    if not num_blocks:
        return cache, ()
    blocks = cache.evictable[:num_blocks]
    entries = [cache.by_block[block] for block in blocks]
    cache = dataclasses.replace(
        cache,
        by_key=dissoc(cache.by_key, [entry.key for entry in entries]),
        by_block=dissoc(cache.by_block, blocks),
        evictable=cache.evictable[num_blocks:],
    )
    return cache, blocks
