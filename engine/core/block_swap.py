"""Swapping: a preempted group's blocks move to the host pool and back, keeping their sharing.

Pure functions over `BlockManagerState`, like `engine.core.block_manager`, whose pool
primitives they use. Each returns the block pairs the cache engine copies.
"""

import dataclasses

from engine.core import block_pool
from engine.core.block_manager import (
    add_device_refs,
    fits,
    release_device,
    release_host,
    set_seqs,
    take_device,
    take_host,
)
from engine.core.block_manager_state import AllocStatus, BlockManagerState
from engine.core.sequence import SequenceGroup


def _distinct_blocks(state: BlockManagerState, group: SequenceGroup) -> tuple[int, ...]:
    tables = (state.seqs[seq.seq_id].block_table for seq in group.unfinished_seqs)
    return tuple(dict.fromkeys(block for table in tables for block in table))


def can_swap_out(state: BlockManagerState, group: SequenceGroup) -> bool:
    """Whether the host pool can take all of the group's device blocks."""
    return len(_distinct_blocks(state, group)) <= len(state.host.free)


def num_swap_in_blocks(state: BlockManagerState, group: SequenceGroup) -> int:
    """Device blocks a swap-in needs: the group's blocks plus one per sequence for its next
    token. That is more than the next step takes wherever a table already holds its last
    token's slot (a last block with room, a block appended ahead), as in vLLM: the slack keeps
    a group just swapped in from being preempted again at once. (Counting exactly refused no
    fewer requests in random runs, only later, after more swapping.)"""
    return len(_distinct_blocks(state, group)) + len(group.unfinished_seqs)


def can_swap_in(state: BlockManagerState, group: SequenceGroup) -> AllocStatus:
    """Whether `num_swap_in_blocks` fit on the device above the watermark (NEVER: not even in
    an empty pool)."""
    need = num_swap_in_blocks(state, group)
    return fits(state, need, need)


def _move_to_pool(
    state: BlockManagerState, group: SequenceGroup, to_device: bool
) -> tuple[BlockManagerState, tuple[tuple[int, int], ...]]:
    """Move all of the group's blocks to the other pool, keeping their sharing."""
    sources = _distinct_blocks(state, group)
    take = take_device if to_device else take_host
    state, targets = take(state, len(sources))
    mapping = dict(zip(sources, targets))
    old = {seq.seq_id: state.seqs[seq.seq_id] for seq in group.unfinished_seqs}
    new = {
        seq_id: dataclasses.replace(
            entry,
            block_table=tuple(mapping[b] for b in entry.block_table),
            on_device=to_device,
            reserved=(),
        )
        for seq_id, entry in old.items()
    }
    released = [b for entry in old.values() for b in entry.reserved + entry.block_table[::-1]]
    held = [b for entry in new.values() for b in entry.block_table]
    if to_device:
        state = release_host(state, released)
        state = add_device_refs(state, held)
    else:
        state = release_device(state, released)
        state = dataclasses.replace(state, host=block_pool.add_refs(state.host, held))
    return set_seqs(state, new), tuple(mapping.items())


def swap_out(
    state: BlockManagerState, group: SequenceGroup
) -> tuple[BlockManagerState, tuple[tuple[int, int], ...]]:
    """Move the group's blocks to host, all or nothing; returns (device, host) block pairs.

    Reserved blocks (`SeqBlocks.reserved`, the Orca baselines') are released: they hold no KV.
    A block appended ahead (`append_blocks`) is in the table, for the last token, and moves with
    it. Freed device blocks may be reused in the same step, so the cache engine must copy these
    pairs out before any other block operation.
    """
    assert can_swap_out(state, group)
    return _move_to_pool(state, group, to_device=False)


def swap_in(
    state: BlockManagerState, group: SequenceGroup
) -> tuple[BlockManagerState, tuple[tuple[int, int], ...]]:
    """Move the group's blocks back to the device; returns (host, device) block pairs."""
    return _move_to_pool(state, group, to_device=True)
