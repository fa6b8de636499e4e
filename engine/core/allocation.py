"""How an admitted group's blocks are laid out: sharing, prefix-cache hits and reservations.

Reservation policies reproduce the paper's baselines inside this one engine: `paged` allocates
on demand; `orca-max`, `orca-pow2` and `orca-oracle` also reserve, at admission, the blocks for
max_model_len slots, for the prompt plus the next power of two of the true output length, or
for exactly the prompt plus the true output length. Reserved blocks count as used and feed the
sequence's later appends; a sequence that outgrows its reservation allocates on demand, and a
forked child or a swapped-in sequence has no reservation. Like the paper's Orca, the baselines
place each sequence's blocks with a buddy allocator (`engine.core.buddy`): its blocks are rounded up
to a power of two (the rounding is reserved too) and must find an aligned free run. Their cost
shows up as reserved-but-empty slots (`BlockManagerStats.kv_waste`) and as requests that wait
for a free run while enough blocks are free.
"""

import dataclasses

from engine.core import buddy, prefix_cache
from engine.core.block_manager_state import BlockManagerConfig
from engine.core.block_pool import blocks_for
from engine.core.prefix_cache import PrefixCache
from engine.core.sequence import Sequence, SequenceGroup


def _next_power_of_two(n: int) -> int:
    return 1 << buddy.order_for(n)


def uses_buddy(config: BlockManagerConfig) -> bool:
    """Whether sequences' blocks are placed by the buddy allocator (the Orca baselines)."""
    return config.reservation != "paged"


def reserved_len(config: BlockManagerConfig, group: SequenceGroup) -> int:
    """Slots per sequence the reservation policy holds from admission (0 for `paged`)."""
    if config.reservation == "paged":
        return 0
    if config.reservation == "orca-max":
        return config.max_model_len
    assert group.expected_output_len is not None, "orca-pow2/oracle need expected_output_len"
    output_len = group.expected_output_len
    if config.reservation == "orca-pow2":
        output_len = _next_power_of_two(output_len)
    return min(config.max_model_len, group.prompt_len + output_len)


def _common_prefix_len(seqs: tuple[Sequence, ...]) -> int:
    first = seqs[0].token_ids
    length = min(seq.len for seq in seqs)
    for seq in seqs[1:]:
        length = next(
            (i for i, (a, b) in enumerate(zip(first[:length], seq.token_ids)) if a != b), length
        )
    return length


@dataclasses.dataclass(frozen=True)
class AllocationPlan:
    """How `allocate` lays out a group: shared leading blocks (some found in the prefix cache:
    `hits` cached, then `scheduled_hits` that this step's earlier work computes), then private
    blocks and reserved blocks per sequence. `num_queried` blocks were looked up."""

    num_shared: int
    hits: tuple[prefix_cache.CachedBlock, ...]
    num_queried: int
    num_private: tuple[int, ...]
    num_reserved: tuple[int, ...]
    scheduled_hits: tuple[int, ...] = ()

    @property
    def hit_blocks(self) -> tuple[int, ...]:
        """The leading blocks found, cached then scheduled: their tokens count as computed."""
        return tuple(hit.block for hit in self.hits) + self.scheduled_hits

    @property
    def num_blocks(self) -> int:
        """Device blocks the group holds once admitted, prefix-cache hits included."""
        return self.num_shared + sum(self.num_private) + sum(self.num_reserved)

    @property
    def num_new_blocks(self) -> int:
        """Blocks taken from the pool (hits excluded)."""
        return self.num_blocks - len(self.hit_blocks)

    @property
    def chunks(self) -> tuple[int, ...]:
        """Blocks each sequence takes from the pool, in one piece (the first sequence's piece
        also holds the shared blocks not found in the prefix cache)."""
        shared_new = self.num_shared - len(self.hit_blocks)
        return _own_blocks(shared_new, self.num_private, self.num_reserved)


def plan_allocation(
    config: BlockManagerConfig, cache: PrefixCache, group: SequenceGroup
) -> AllocationPlan:
    """Sequences with identical tokens share every block; sequences that differ (a recomputed
    group with diverged outputs) share the full blocks of their common prefix."""
    seqs = group.unfinished_seqs
    size = config.block_size
    if all(seq.token_ids == seqs[0].token_ids for seq in seqs):
        num_shared, num_shared_full = blocks_for(seqs[0].len, size), seqs[0].len // size
    else:
        num_shared = num_shared_full = _common_prefix_len(seqs) // size
    num_queried = 0
    hits, scheduled_hits = (), ()
    if config.enable_prefix_caching and group.use_prefix_cache:
        num_queried = min(num_shared_full, (min(seq.len for seq in seqs) - 1) // size)
        hits = prefix_cache.lookup(cache, seqs[0].token_ids, num_queried, size)
        found = tuple(hit.block for hit in hits)
        scheduled_hits = prefix_cache.lookup_scheduled(cache, seqs[0].token_ids, found, num_queried, size)
    reserve_blocks = blocks_for(reserved_len(config, group), size)
    num_private = tuple(blocks_for(seq.len, size) - num_shared for seq in seqs)
    num_reserved = tuple(max(0, reserve_blocks - blocks_for(seq.len, size)) for seq in seqs)
    if uses_buddy(config):
        num_reserved = tuple(
            _next_power_of_two(own) - own + reserved if own else 0
            for own, reserved in zip(_own_blocks(num_shared, num_private, num_reserved), num_reserved)
        )
    return AllocationPlan(num_shared, hits, num_queried, num_private, num_reserved, scheduled_hits)


def _own_blocks(num_shared: int, num_private, num_reserved) -> tuple[int, ...]:
    """Blocks each sequence takes from the pool at admission: the first also takes the shared."""
    return tuple(
        (num_shared if i == 0 else 0) + private + reserved
        for i, (private, reserved) in enumerate(zip(num_private, num_reserved))
    )
