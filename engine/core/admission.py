"""Whether a waiting or swapped-out group can enter the running batch now, later or never, and
for never, a message that says what to change. Part of `schedule()` (`engine.core.scheduler_plan`)."""

from engine.core import block_manager, block_swap
from engine.core.block_manager import AllocStatus, BlockManagerState
from engine.core.scheduler_state import SchedulerConfig
from engine.core.sequence import SequenceGroup


def _with_reason(
    blocks: BlockManagerState, group: SequenceGroup, status: AllocStatus, need, verb: str
) -> tuple[AllocStatus, str]:
    """`status` and, for NEVER, why: `need(blocks, group)` blocks exceed the device pool."""
    if status is not AllocStatus.NEVER:
        return status, ""
    config, seqs = blocks.config, group.unfinished_seqs
    return status, (
        f"request needs {need(blocks, group)} KV blocks of {config.block_size} tokens to {verb} "
        f"({seqs[0].len} tokens x {len(seqs)} sequences), but the device pool has "
        f"{config.num_device_blocks} blocks of which {config.watermark_blocks} stay free "
        f"(watermark); give the KV cache more blocks (LLM's num_blocks or kv_cache_memory, the "
        f"server's --num-blocks or --kv-cache-memory) or shorten the request"
    )


def swap_in_status(
    blocks: BlockManagerState, group: SequenceGroup, config: SchedulerConfig
) -> tuple[AllocStatus, str]:
    """Whether a swapped-out group's blocks fit back on the device; NEVER for a group larger
    than the whole device pool."""
    status = block_swap.can_swap_in(blocks, group)
    return _with_reason(blocks, group, status, block_swap.num_swap_in_blocks, "resume")


def admission_status(
    blocks: BlockManagerState, group: SequenceGroup, config: SchedulerConfig
) -> tuple[AllocStatus, str]:
    """Whether a waiting group fits; NEVER for a prompt longer than max_model_len or a group
    larger than the whole device pool."""
    if group.prompt_len > config.max_model_len:
        reason = (
            f"prompt of {group.prompt_len} tokens is longer than max_model_len="
            f"{config.max_model_len}; shorten the prompt or raise max_model_len"
        )
        return AllocStatus.NEVER, reason
    status = block_manager.can_allocate(blocks, group)
    return _with_reason(blocks, group, status, block_manager.num_required_blocks, "start")
