"""The block manager's records: its configuration, what each sequence holds, and the whole state.

They sit below every module that reads them (`block_manager`, `block_swap`, `allocation`,
`block_stats`), as `scheduler_state` does for the scheduler.
"""

import enum
from collections.abc import Mapping

from engine.core.block_pool import BlockPool
from engine.core.prefix_cache import PrefixCache
from engine.core.records import record

RESERVATIONS = ("paged", "orca-max", "orca-pow2", "orca-oracle")


class ConfigError(ValueError):
    """A configuration value is out of range; the message says which and what is allowed."""


class AllocStatus(enum.Enum):
    """Whether a request fits: now, after some blocks are freed, or never (too big for the pool)."""

    OK = enum.auto()
    LATER = enum.auto()
    NEVER = enum.auto()


@record
class BlockManagerConfig:
    """Pool sizes and policies; `watermark`: fraction of device blocks admissions leave free."""

    block_size: int
    num_device_blocks: int
    num_host_blocks: int
    max_model_len: int
    watermark: float = 0.01
    enable_prefix_caching: bool = False
    reservation: str = "paged"

    def __post_init__(self):
        for name in ("block_size", "num_device_blocks", "max_model_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_host_blocks < 0:
            raise ConfigError(f"num_host_blocks must be >= 0, got {self.num_host_blocks}")
        if not 0 <= self.watermark < 1:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.reservation not in RESERVATIONS:
            raise ConfigError(
                f"reservation must be one of {RESERVATIONS}, got {self.reservation!r}"
            )
        if self.enable_prefix_caching and self.reservation != "paged":
            raise ConfigError(
                f"reservation={self.reservation!r} reproduces a baseline of the paper, which has "
                "no prefix cache; use reservation='paged' with enable_prefix_caching"
            )

    @property
    def watermark_blocks(self) -> int:
        """Device blocks that admissions and swap-ins leave free."""
        return int(self.watermark * self.num_device_blocks)

    @property
    def longest_sequence(self) -> int:
        """Tokens one sequence can hold and still be admitted (or swapped back in) alone."""
        return (self.num_device_blocks - self.watermark_blocks) * self.block_size


@record
class SeqBlocks:
    """The blocks one sequence holds.

    `reserved` are blocks held for its future tokens (orca reservation policies).
    `cache_entry_ids` name, in the prefix cache, the contents of its leading computed full
    blocks.
    """

    block_table: tuple[int, ...]
    on_device: bool
    reserved: tuple[int, ...] = ()
    cache_entry_ids: tuple[int, ...] = ()

    def changed(self, *, block_table: tuple[int, ...] | None = None, reserved: tuple[int, ...] | None = None,
                cache_entry_ids: tuple[int, ...] | None = None) -> "SeqBlocks":
        """These blocks with the given fields changed: what `dataclasses.replace` makes, at a
        third of its cost (decodes remake one per sequence at every block they open)."""
        return SeqBlocks(self.block_table if block_table is None else block_table, self.on_device,
                         self.reserved if reserved is None else reserved,
                         self.cache_entry_ids if cache_entry_ids is None else cache_entry_ids)


@record
class BlockManagerState:
    """Both pools, every sequence's blocks (by seq_id) and the prefix cache."""

    config: BlockManagerConfig
    device: BlockPool
    host: BlockPool
    seqs: Mapping[int, SeqBlocks]
    prefix_cache: PrefixCache
