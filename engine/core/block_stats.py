"""Memory accounting of the block manager, for metrics and the paper's waste comparison."""

import collections
import dataclasses
from collections.abc import Mapping

from engine.core.block_manager_state import BlockManagerState
from engine.core.block_pool import num_available


@dataclasses.dataclass(frozen=True)
class BlockManagerStats:
    """Block counts per pool, KV waste, sharing savings and prefix-cache counts.

    `slots_allocated` counts the slots of used device blocks and `tokens_stored` the tokens
    they hold; the difference is KV waste (partly filled last blocks, reservations).
    `blocks_saved_by_sharing` is the sum of device block-table lengths minus the distinct blocks
    in them. Prefix-cache counts are in blocks: looked up at admission, found, and cached now.
    """

    device_blocks_total: int
    device_blocks_free: int
    device_blocks_used: int
    host_blocks_total: int
    host_blocks_free: int
    host_blocks_used: int
    slots_allocated: int
    tokens_stored: int
    blocks_saved_by_sharing: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_blocks: int

    @property
    def kv_waste(self) -> float:
        """Fraction of allocated device slots holding no token."""
        if not self.slots_allocated:
            return 0.0
        return 1 - self.tokens_stored / self.slots_allocated


def _tokens_per_device_block(
    state: BlockManagerState, num_tokens: Mapping[int, int]
) -> tuple[dict[int, int], int]:
    """Tokens held by each block of a device block table, and the summed table lengths."""
    size = state.config.block_size
    tokens: dict[int, int] = collections.defaultdict(int)
    table_len_sum = 0
    for seq_id, entry in state.seqs.items():
        if entry.on_device:
            table_len_sum += len(entry.block_table)
            for index, block in enumerate(entry.block_table):
                filled = max(0, min(size, num_tokens[seq_id] - index * size))
                tokens[block] = max(tokens[block], filled)
    return tokens, table_len_sum


def stats(state: BlockManagerState, num_tokens: Mapping[int, int]) -> BlockManagerStats:
    """Accounting snapshot of `state`; `num_tokens` gives, per seq_id on the device, how many
    of its tokens have their KV in the cache. Walks every block table: for metrics, not for
    per-step decisions."""
    config = state.config
    tokens, table_len_sum = _tokens_per_device_block(state, num_tokens)
    device_free = num_available(state.device, state.prefix_cache)
    device_used = config.num_device_blocks - device_free
    return BlockManagerStats(
        device_blocks_total=config.num_device_blocks,
        device_blocks_free=device_free,
        device_blocks_used=device_used,
        host_blocks_total=config.num_host_blocks,
        host_blocks_free=len(state.host.free),
        host_blocks_used=config.num_host_blocks - len(state.host.free),
        slots_allocated=device_used * config.block_size,
        tokens_stored=sum(tokens.values()),
        blocks_saved_by_sharing=table_len_sum - len(tokens),
        prefix_cache_queries=state.prefix_cache.num_queries,
        prefix_cache_hits=state.prefix_cache.num_hits,
        prefix_cache_blocks=len(state.prefix_cache.by_block),
    )
