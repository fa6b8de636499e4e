"""Paged KV memory: refcounted physical blocks on device and host, and one block table per sequence.

A sequence's KV lives in fixed-size blocks; its block table maps logical block i (tokens
i*block_size .. (i+1)*block_size-1) to a physical block. Blocks are shared by reference counting:
the sequences of a request share their prompt's blocks, a fork shares all of the parent's
blocks, and the prefix cache shares full blocks across requests. A block that will receive a
token is made private first (copy-on-write), so shared KV is never overwritten.

Every function is pure: it takes a `BlockManagerState` and returns a new one, plus the block
operations the cache engine must carry out (copy pairs, swap mappings). Callers check first
(`can_allocate`, `can_append_slots`, `can_swap_out`, `can_swap_in`); the operations assert.
Reservation policies and the layout of an admitted group: `engine.core.allocation`; moving a
group between the device and host pools: `engine.core.block_swap`; the records:
`engine.core.block_manager_state`.
"""

import collections
import dataclasses
from collections.abc import Iterable, Mapping

from engine.core import block_pool, buddy, prefix_cache
from engine.core.allocation import plan_allocation, uses_buddy
from engine.core.block_manager_state import (  # noqa: F401 (the records are part of this interface)
    RESERVATIONS,
    AllocStatus,
    BlockManagerConfig,
    BlockManagerState,
    ConfigError,
    SeqBlocks,
)
from engine.core.block_pool import empty_pool
from engine.core.block_stats import BlockManagerStats, stats  # noqa: F401 (part of this interface)
from engine.core.prefix_cache import PrefixCache, assoc, dissoc, frozen_map
from engine.core.sequence import Sequence, SequenceGroup


def initial_state(config: BlockManagerConfig) -> BlockManagerState:
    """All blocks free, no sequences, an empty prefix cache."""
    return BlockManagerState(
        config=config,
        device=empty_pool(config.num_device_blocks),
        host=empty_pool(config.num_host_blocks),
        seqs=frozen_map(),
        prefix_cache=PrefixCache(),
    )


def block_table(state: BlockManagerState, seq_id: int) -> tuple[int, ...]:
    """The physical blocks of `seq_id`, in logical order (in the pool it currently lives in)."""
    return state.seqs[seq_id].block_table


def num_free_device_blocks(state: BlockManagerState) -> int:
    """Device blocks available to allocate: the free list plus evictable prefix-cache blocks."""
    return block_pool.num_available(state.device, state.prefix_cache)


# --- pool primitives (also used by engine.core.block_swap) -------------------------------


def take_device(state: BlockManagerState, num_blocks: int) -> tuple[BlockManagerState, tuple]:
    """`num_blocks` unreferenced device blocks (one buddy run of one block each, under an Orca
    reservation)."""
    if uses_buddy(state.config):
        blocks = ()
        for _ in range(num_blocks):
            state, run = _take_run(state, 1)
            blocks += run
        return state, blocks
    device, cache, blocks = block_pool.take_device(state.device, state.prefix_cache, num_blocks)
    return dataclasses.replace(state, device=device, prefix_cache=cache), blocks


def _take_run(state: BlockManagerState, num_blocks: int) -> tuple[BlockManagerState, tuple]:
    """The aligned run of `num_blocks` (a power of two) free device blocks the buddy allocator
    picks."""
    config, order = state.config, buddy.order_for(num_blocks)
    assert num_blocks == 1 << order, f"a buddy run has a power-of-two size, not {num_blocks}"
    first = buddy.find_run(state.device.free, config.num_device_blocks, order)
    assert first is not None, f"no free run of {num_blocks} blocks"
    device = block_pool.take_run(state.device, first, num_blocks)
    return dataclasses.replace(state, device=device), tuple(range(first, first + num_blocks))


def _take_chunk(state: BlockManagerState, num_blocks: int) -> tuple[BlockManagerState, tuple]:
    """One sequence's blocks at admission: one buddy run under an Orca reservation."""
    if uses_buddy(state.config) and num_blocks:
        return _take_run(state, num_blocks)
    return take_device(state, num_blocks)


def take_host(state: BlockManagerState, num_blocks: int) -> tuple[BlockManagerState, tuple]:
    host, blocks = block_pool.take(state.host, num_blocks)
    return dataclasses.replace(state, host=host), blocks


def release_device(state: BlockManagerState, blocks: Iterable[int]) -> BlockManagerState:
    device, cache = block_pool.release_device(state.device, state.prefix_cache, blocks)
    return dataclasses.replace(state, device=device, prefix_cache=cache)


def release_host(state: BlockManagerState, blocks: Iterable[int]) -> BlockManagerState:
    return dataclasses.replace(state, host=block_pool.release(state.host, blocks))


def add_device_refs(state: BlockManagerState, blocks: Iterable[int]) -> BlockManagerState:
    return dataclasses.replace(state, device=block_pool.add_refs(state.device, blocks))


def set_seqs(state: BlockManagerState, entries: Mapping[int, SeqBlocks]) -> BlockManagerState:
    return dataclasses.replace(state, seqs=assoc(state.seqs, entries))


# --- admission ------------------------------------------------------------------------------


def num_required_blocks(state: BlockManagerState, group: SequenceGroup) -> int:
    """Device blocks the group occupies once admitted (prefix-cache hits included)."""
    return plan_allocation(state.config, state.prefix_cache, group).num_blocks


def fits(state: BlockManagerState, num_total: int, num_new: int) -> AllocStatus:
    config = state.config
    if config.num_device_blocks - num_total < config.watermark_blocks:
        return AllocStatus.NEVER
    if num_free_device_blocks(state) - num_new < config.watermark_blocks:
        return AllocStatus.LATER
    return AllocStatus.OK


def _runs_fit(state: BlockManagerState, chunks: Iterable[int]) -> AllocStatus:
    """Whether the buddy allocator finds a free run for each chunk, one after the other."""
    num_blocks = state.config.num_device_blocks
    orders = [buddy.order_for(chunk) for chunk in chunks if chunk]
    if not all(buddy.fits_in_empty_pool(num_blocks, order) for order in orders):
        return AllocStatus.NEVER
    free = set(state.device.free)
    for order in orders:
        first = buddy.find_run(free, num_blocks, order)
        if first is None:
            return AllocStatus.LATER
        free -= set(range(first, first + (1 << order)))
    return AllocStatus.OK


def can_allocate(state: BlockManagerState, group: SequenceGroup) -> AllocStatus:
    """Whether the group's blocks fit now while keeping the watermark free (NEVER: not even
    in an empty pool); under an Orca reservation, also whether each sequence finds a free
    buddy run."""
    plan = plan_allocation(state.config, state.prefix_cache, group)
    evictable = set(state.prefix_cache.evictable)
    num_evictable_hits = sum(1 for hit in plan.hits if hit.block in evictable)
    status = fits(state, plan.num_blocks, plan.num_new_blocks + num_evictable_hits)
    if status is AllocStatus.NEVER or not uses_buddy(state.config):
        return status
    placed = _runs_fit(state, plan.chunks)
    return placed if placed is not AllocStatus.OK else status


def allocate(state: BlockManagerState, group: SequenceGroup) -> tuple[BlockManagerState, int]:
    """Give every unfinished sequence of `group` a block table covering all its tokens.

    Returns the new state and the number of leading tokens whose KV was found in the prefix
    cache (already computed; the same for every sequence of the group).
    """
    plan = plan_allocation(state.config, state.prefix_cache, group)
    seqs = group.unfinished_seqs
    hit_blocks = plan.hit_blocks
    cache = prefix_cache.acquire(state.prefix_cache, hit_blocks)
    cache = prefix_cache.count_lookup(cache, plan.num_queried, len(hit_blocks))
    state = dataclasses.replace(state, prefix_cache=cache)
    num_new_shared, shared, entries = plan.num_shared - len(hit_blocks), hit_blocks, {}
    for index, seq in enumerate(seqs):
        state, chunk = _take_chunk(state, plan.chunks[index])
        if index == 0:
            shared, chunk = shared + chunk[:num_new_shared], chunk[num_new_shared:]
        num_private = plan.num_private[index]
        private, reserved = chunk[:num_private], chunk[num_private:]
        entries[seq.seq_id] = SeqBlocks(
            block_table=shared + private,
            on_device=True,
            reserved=reserved,
            cache_entry_ids=tuple(hit.entry_id for hit in plan.hits),
        )
    held = [b for entry in entries.values() for b in entry.block_table + entry.reserved]
    state = add_device_refs(state, held)
    return set_seqs(state, entries), len(hit_blocks) * state.config.block_size


# --- decoding -------------------------------------------------------------------------------


def append_needs(state: BlockManagerState, seqs: tuple[Sequence, ...]) -> int:
    """New device blocks `append_slot` takes from the pool for `seqs`, called in this order: one
    per full last block, one per copy-on-write (once the other holders of a shared block have
    copied, the last writes in place), none where a reservation covers it."""
    size, refcounts = state.config.block_size, state.device.refcounts
    if len(seqs) == 1:  # most groups: nothing shared to count
        (seq,) = seqs
        entry = state.seqs[seq.seq_id]
        last_index = (seq.len - 1) // size
        assert last_index <= len(entry.block_table)
        if entry.reserved:
            return 0
        return int(last_index == len(entry.block_table) or refcounts[entry.block_table[last_index]] > 1)
    need, copied = 0, collections.Counter()
    for seq in seqs:
        entry = state.seqs[seq.seq_id]
        last_index = (seq.len - 1) // size
        assert last_index <= len(entry.block_table)
        if last_index == len(entry.block_table):
            need += not entry.reserved
        elif refcounts[entry.block_table[last_index]] - copied[entry.block_table[last_index]] > 1:
            copied[entry.block_table[last_index]] += 1
            need += not entry.reserved
    return need


def writes_privately(state: BlockManagerState, seq: Sequence) -> bool:
    """Whether the slot of `seq`'s last token (position seq.len - 1) is in a block only `seq`
    holds, or past its table (a block to open): no copy-on-write before it is written."""
    entry = state.seqs[seq.seq_id]
    index = (seq.len - 1) // state.config.block_size
    return index >= len(entry.block_table) or state.device.refcounts[entry.block_table[index]] == 1


def can_append_slots(state: BlockManagerState, group: SequenceGroup) -> bool:
    """Whether every unfinished sequence of `group` can get a writable slot for its last token."""
    return append_needs(state, group.unfinished_seqs) <= num_free_device_blocks(state)


def _take_one(
    state: BlockManagerState, entry: SeqBlocks
) -> tuple[BlockManagerState, SeqBlocks, int]:
    """A private block for `entry`: from its reservation, else a fresh one (refcount 1)."""
    if entry.reserved:
        return state, entry.changed(reserved=entry.reserved[1:]), entry.reserved[0]
    state, (block,) = take_device(state, 1)
    return add_device_refs(state, [block]), entry, block


def append_slot(
    state: BlockManagerState, seq: Sequence
) -> tuple[BlockManagerState, tuple[int, int] | None]:
    """Make room for `seq`'s last token (position seq.len - 1) in a block only `seq` references.

    A new block when the table ends before it; copy-on-write when its block is shared: a
    private block replaces it in the table and `(src, dst)` is returned for the cache engine to
    copy before the token is written. (Its block is the table's last unless a block was
    appended ahead, `append_blocks`, and a fork shared both.)
    """
    entry = state.seqs[seq.seq_id]
    assert entry.on_device, f"seq {seq.seq_id} is swapped out"
    table, copy, index = entry.block_table, None, (seq.len - 1) // state.config.block_size
    if index == len(table):
        state, entry, block = _take_one(state, entry)
        table = table + (block,)
    elif state.device.refcounts[table[index]] > 1:
        state, entry, block = _take_one(state, entry)
        state = release_device(state, [table[index]])
        copy, table = (table[index], block), table[:index] + (block,) + table[index + 1 :]
    if table == entry.block_table:
        return state, None
    return set_seqs(state, {seq.seq_id: entry.changed(block_table=table)}), copy


def num_fresh_blocks(state: BlockManagerState, seq_id: int, num_blocks: int) -> int:
    """Of `num_blocks` more blocks for `seq_id` (`append_blocks`), how many its reservation
    does not hold: those come from the free list or the prefix cache's evictable blocks (least
    recently released first, as a later `append_slot` would take them: once the cache has
    filled the pool, every block comes from there), of which there are
    `num_free_device_blocks`."""
    return max(num_blocks - len(state.seqs[seq_id].reserved), 0)


def append_blocks(state: BlockManagerState, counts: Mapping[int, int]) -> BlockManagerState:
    """`counts[seq_id]` more private blocks at the end of each listed sequence's table, before
    any token needs them (`SchedulerConfig.reserve_next_block`, multi-step decodes): from its
    reservation first, the rest taken from the pool at once (see `num_fresh_blocks`)."""
    state, fresh = take_device(state, sum(num_fresh_blocks(state, seq_id, n) for seq_id, n in counts.items()))
    state, fresh, entries = add_device_refs(state, fresh), iter(fresh), {}
    for seq_id, num_blocks in counts.items():
        entry = state.seqs[seq_id]
        assert entry.on_device, f"seq {seq_id} is swapped out"
        own = entry.reserved[:num_blocks]
        new = own + tuple(next(fresh) for _ in range(num_blocks - len(own)))
        entries[seq_id] = entry.changed(block_table=entry.block_table + new, reserved=entry.reserved[len(own):])
    return set_seqs(state, entries)


def fork(state: BlockManagerState, parent_seq_id: int, child_seq_id: int) -> BlockManagerState:
    """The child shares all of the parent's blocks (one more reference each)."""
    parent = state.seqs[parent_seq_id]
    assert parent.on_device and child_seq_id not in state.seqs
    child = dataclasses.replace(parent, reserved=())
    state = add_device_refs(state, parent.block_table)
    return set_seqs(state, {child_seq_id: child})


def free(state: BlockManagerState, seq_id: int) -> BlockManagerState:
    """Release every block `seq_id` holds (no-op for a sequence without blocks)."""
    return free_each(state, (seq_id,))


def free_each(state: BlockManagerState, seq_ids: Iterable[int]) -> BlockManagerState:
    """`free` of each of `seq_ids` in turn, the pools and maps updated once."""
    device, host, freed = [], [], []
    for seq_id in dict.fromkeys(seq_ids):  # a sequence named twice is freed once, as by `free` twice
        entry = state.seqs.get(seq_id)
        if entry is not None:
            (device if entry.on_device else host).extend(entry.reserved + entry.block_table[::-1])
            freed.append(seq_id)
    if not freed:
        return state
    state = release_device(state, device) if device else state
    state = release_host(state, host) if host else state
    return dataclasses.replace(state, seqs=dissoc(state.seqs, freed))


def num_shared_tokens(state: BlockManagerState, seqs: tuple[Sequence, ...]) -> int:
    """Leading token positions whose blocks are the same physical blocks for all of `seqs`.

    A prefill writes these once for every sequence (see the scheduler's prefill stages).
    """
    tables = [state.seqs[seq.seq_id].block_table for seq in seqs]
    if all(table == tables[0] for table in tables):
        return min(seq.len for seq in seqs)
    num_same = next(
        (i for i, blocks in enumerate(zip(*tables)) if len(set(blocks)) > 1),
        min(len(table) for table in tables),
    )
    return num_same * state.config.block_size


def mark_scheduled(state: BlockManagerState, seq: Sequence, num_tokens: int) -> BlockManagerState:
    """This step computes `seq`'s first `num_tokens` tokens: offer its full blocks among them to
    groups admitted later in the step (when caching is on; see `engine.core.prefix_cache`)."""
    if not state.config.enable_prefix_caching:
        return state
    cache = prefix_cache.offer_scheduled(
        state.prefix_cache, seq.token_ids, state.seqs[seq.seq_id].block_table, num_tokens, state.config.block_size
    )
    return dataclasses.replace(state, prefix_cache=cache)


def mark_computed(state: BlockManagerState, seqs: Iterable[Sequence]) -> BlockManagerState:
    """The step is done: enter the newly computed full blocks of `seqs` in the prefix cache and
    forget the step's scheduled blocks (when caching is on)."""
    if not state.config.enable_prefix_caching:
        return state
    state = dataclasses.replace(state, prefix_cache=prefix_cache.end_step(state.prefix_cache))
    size, chains, entries = state.config.block_size, [], []
    for seq in seqs:
        entry = state.seqs[seq.seq_id]
        known, full = len(entry.cache_entry_ids), seq.num_computed_tokens // size
        if full <= known:  # most sequences most steps: no block filled
            continue
        new = [(prefix_cache.block_tokens(seq.token_ids, index, size), entry.block_table[index])
               for index in range(known, full)]
        chains.append((entry.cache_entry_ids[-1] if known else None, new))
        entries.append((seq.seq_id, entry))
    if not chains:
        return state
    cache, chain_ids = prefix_cache.insert_chains(state.prefix_cache, chains)
    updated = {
        seq_id: entry.changed(cache_entry_ids=entry.cache_entry_ids + tuple(ids))
        for (seq_id, entry), ids in zip(entries, chain_ids)
    }
    return set_seqs(dataclasses.replace(state, prefix_cache=cache), updated)


def reset_prefix_cache(state: BlockManagerState) -> BlockManagerState:
    """Forget every cached block, returning it to the free list; no sequence may hold blocks
    (an entry it names would dangle). The hit counts stay."""
    assert not state.seqs, "the prefix cache is reset only while no sequence holds blocks"
    cache, blocks = prefix_cache.evict(state.prefix_cache, len(state.prefix_cache.evictable))
    assert not cache.by_block, "a cached block is not evictable"
    device = dataclasses.replace(state.device, free=state.device.free.extend(blocks))
    return dataclasses.replace(state, device=device, prefix_cache=cache)
