"""The scheduler's records: configuration, per-step output, update actions and state.

`engine.core.scheduler` holds the functions over them (and re-exports these names).
"""

import dataclasses

import numpy as np
from rpds import HashTrieSet

from engine.core import decode_rows
from engine.core.block_manager import BlockManagerConfig, BlockManagerState, ConfigError
from engine.core.block_stats import BlockManagerStats
from engine.core.decode_rows import NO_ROWS, DecodeRows
from engine.core.records import record
from engine.core.sequence import SequenceGroup, SequenceStatus

PREEMPTION_MODES = (None, "recompute", "swap")
POLICIES = ("fcfs", "static")


class InvalidRequestError(ValueError):
    """A request the scheduler cannot accept; the message says what to change."""


class SchedulerUsageError(RuntimeError):
    """schedule() / update() called out of order or with actions that do not match the step."""


@record(kw_only=True)
class SchedulerConfig:
    """Budgets per step and policies.

    `preemption_mode` None picks per group: recompute for one running sequence, swap for
    several (they share blocks). A swap that the host pool cannot take falls back to recompute.
    `policy` "static" admits a batch only when nothing runs and keeps it until all its members
    finish (FasterTransformer-style); "fcfs" is continuous batching.
    With `reserve_next_block` (the engine's async scheduling), a decoding sequence of a group
    that does not fork (`SequenceGroup.may_fork`: not beam search) whose next token will open a
    block gets that block one step early, when the step admits whatever waits and fits (so
    nothing waiting enters the step after unless a sequence ends or a request arrives:
    `SchedulerOutput.queue_tried`) and a block is free or evictable (the least recently
    released cached block, as the next step would evict): the step after
    can then be dispatched before this one's tokens are known (`engine.async_scheduling`),
    across block boundaries too. Unless the sequence stops at this step (a stop token), the
    block would be taken at the next step anyway, before any admission: it costs one empty
    block for a step (and, if it stops, the cached block evicted for it).
    """

    max_num_batched_tokens: int
    max_model_len: int
    block_manager: BlockManagerConfig
    max_num_seqs: int = 256
    preemption_mode: str | None = None
    policy: str = "fcfs"
    reserve_next_block: bool = False

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode"
            )
        if self.max_model_len != self.block_manager.max_model_len:
            raise ConfigError(
                f"max_model_len ({self.max_model_len}) differs from block_manager.max_model_len "
                f"({self.block_manager.max_model_len}); set both to the same value"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(f"preemption_mode must be one of {PREEMPTION_MODES}")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, got {self.policy!r}")


@record
class ScheduledGroupWork:
    """Tokens whose KV is computed this step, for the sequences `seq_ids`.

    `token_ids` sit at positions start .. start + len(token_ids) - 1 and are written through
    `block_table`, the blocks holding positions 0 .. context_len - 1 (the same physical blocks
    for all of `seq_ids`), and for a decode, the block of the token after it if reserved
    already (`SchedulerConfig.reserve_next_block`). `is_prefill` marks a group that has not sampled since admission: its
    prompt, or, after preemption by recompute, its prompt and generated tokens; decodes compute
    the one token sampled last step. With `do_sample`, the engine samples one token per seq_id
    from the logits of the last token (False for a chunk that does not reach the end).
    A decode of `num_steps` > 1 (multi-step decode: `schedule(..., num_steps=)`) goes on for
    `num_steps - 1` more tokens, each the one sampled from the step before, at the positions
    after `start`; `block_table` holds all their slots.
    """

    request_id: str
    seq_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    start: int
    block_table: tuple[int, ...]
    is_prefill: bool
    do_sample: bool
    num_steps: int = 1

    @property
    def context_len(self) -> int:
        """Tokens in the cache once this work's first step is done: what its last token attends to."""
        return self.start + len(self.token_ids)

    def changed(self, *, token_ids: tuple[int, ...] | None = None, start: int | None = None,
                block_table: tuple[int, ...] | None = None, num_steps: int | None = None) -> "ScheduledGroupWork":
        """This work with the given fields changed: what `dataclasses.replace` makes, at a third
        of its cost (the scheduler and the engine's lookaheads remake one per sequence per step)."""
        return ScheduledGroupWork(
            self.request_id, self.seq_ids, self.token_ids if token_ids is None else token_ids,
            self.start if start is None else start, self.block_table if block_table is None else block_table,
            self.is_prefill, self.do_sample, self.num_steps if num_steps is None else num_steps)

    @property
    def write_end(self) -> int:
        """One past the last position whose KV this work writes (over all its steps)."""
        return self.context_len + self.num_steps - 1


@record
class SchedulerOutput:
    """One step's plan. Apply swap_out, then swap_in, then copy, then run `scheduled`.

    `queue_tried`: the step swapped in and admitted every group it could (it was asked to
    admit, and preempted none), so a group still waiting or swapped out does not fit now. If
    the step only decodes, the next one admits none either unless a running sequence ends or
    is aborted, or a request arrives: without them, free blocks only shrink, and the seats
    and the token budget stay taken (`SchedulerState.queue_settled`)."""

    scheduled: tuple[ScheduledGroupWork, ...] = ()
    blocks_to_swap_in: tuple[tuple[int, int], ...] = ()
    blocks_to_swap_out: tuple[tuple[int, int], ...] = ()
    blocks_to_copy: tuple[tuple[int, int], ...] = ()
    preempted: tuple[str, ...] = ()
    ignored: tuple[tuple[str, str], ...] = ()
    queue_tried: bool = False

    @property
    def num_batched_tokens(self) -> int:
        """Tokens the model runs this step."""
        from engine.core import scheduled_rows  # it builds on this module's records

        return scheduled_rows.num_tokens(self.scheduled)

    @property
    def num_steps(self) -> int:
        """Model steps the plan runs: more than one for a multi-step decode."""
        from engine.core import scheduled_rows  # it builds on this module's records

        rows, others = scheduled_rows.rows_of(self.scheduled)
        return max([1 if rows is None else rows.num_steps, *(work.num_steps for work in others)])


@record
class Append:
    """Add the sampled `token_id` to sequence `seq_id`."""

    seq_id: int
    token_id: int


@record(eq=False)
class AppendEach:
    """A step's tokens for many sequences in one action, in order: an `Append` of
    `token_ids[i]` to sequence `seq_ids[i]` for every i (int64 [M] each); or, after a
    multi-step decode, an `AppendMany` of `token_ids[i, :counts[i]]` to each (token_ids int64
    [M, k], counts int64 [M])."""

    seq_ids: np.ndarray
    token_ids: np.ndarray
    counts: np.ndarray | None = None

    def __post_init__(self):
        rows, tokens, counts = len(self.seq_ids), self.token_ids, self.counts
        if (tokens.shape != (rows,) if counts is None else (
                tokens.ndim != 2 or len(tokens) != rows or counts.shape != (rows,)
                or (rows and counts.max() > tokens.shape[1]))):
            raise SchedulerUsageError(
                f"AppendEach of {rows} sequences needs token_ids [{rows}] (one each), or [{rows}, k] and counts "
                f"[{rows}] of at most k; got token_ids {tokens.shape} and counts "
                f"{None if counts is None else counts.tolist()}")

    def appends(self) -> list:
        """The same as one `Append` (or `AppendMany`) each."""
        if self.counts is None:
            return list(map(Append, self.seq_ids.tolist(), self.token_ids.tolist()))
        return [AppendMany(seq_id, tuple(tokens[:count])) for seq_id, tokens, count in zip(
            self.seq_ids.tolist(), self.token_ids.tolist(), self.counts.tolist())]

    def __eq__(self, other) -> bool:
        if not isinstance(other, AppendEach):
            return NotImplemented
        return self.appends() == other.appends()

    def __hash__(self) -> int:
        return hash(tuple(self.appends()))


@record
class AppendMany:
    """Add the tokens a multi-step decode sampled for sequence `seq_id`, in order: at most the
    work's `num_steps`, fewer when the sequence stopped (the tokens after the stop are dropped)."""

    seq_id: int
    token_ids: tuple[int, ...]

    def fits(self, num_steps: int) -> bool:
        """Whether its tokens fit a work of `num_steps` steps: at least one, at most that many."""
        return 1 <= len(self.token_ids) <= num_steps


@record
class Fork:
    """A new sequence sharing all of the parent's blocks, continuing with `token_id`."""

    parent_seq_id: int
    child_seq_id: int | None
    token_id: int


@record
class Finish:
    """End sequence `seq_id` with a FINISHED_* `status` and free its blocks."""

    seq_id: int
    status: SequenceStatus

    @property
    def has_valid_status(self) -> bool:
        """Whether `status` is one update() takes: FINISHED_*, but not FINISHED_IGNORED (the
        scheduler's own, for a request it refuses)."""
        return self.status.is_finished and self.status is not SequenceStatus.FINISHED_IGNORED


@record
class Drop:
    """Remove sequence `seq_id` from its group and free its blocks (a beam that lost)."""

    seq_id: int


Action = Append | AppendEach | AppendMany | Fork | Finish | Drop


@record
class SchedulerState:
    """Queues ordered by arrival, the block manager, and counters.

    The running groups are `rows` (those whose sequences all decode, as columns, a row per
    sequence: `engine.core.decode_rows`) and `running_groups` (the others: prefilling, beam
    search, a sequence stopped or writing into a shared block), each in arrival order;
    `running` gives them all as records. `finished` holds the groups that left during the
    last schedule() (ignored) and the update() / abort() calls since. `pending` is the output
    of schedule() not yet recorded by update(); `pending_rows` the rows whose decodes it plans
    first, one work each in order, when schedule() planned them from the columns. `live_ids`
    holds the request ids of the waiting, running and swapped groups (a persistent set: an
    arrival checks its id without a scan of every live group).
    """

    config: SchedulerConfig
    blocks: BlockManagerState
    waiting: tuple[SequenceGroup, ...] = ()
    running_groups: tuple[SequenceGroup, ...] = ()
    rows: DecodeRows = NO_ROWS
    swapped: tuple[SequenceGroup, ...] = ()
    finished: tuple[SequenceGroup, ...] = ()
    pending: SchedulerOutput | None = None
    pending_rows: DecodeRows | None = None
    next_seq_id: int = 0
    next_arrival: int = 0
    num_preemptions: int = 0
    num_swap_outs: int = 0
    live_ids: HashTrieSet = HashTrieSet()

    @property
    def running(self) -> tuple[SequenceGroup, ...]:
        """Every running group as a record, in arrival order (the rows' made afresh: for the
        paths that want them all, not for a step's)."""
        return decode_rows.merged(self.rows, self.running_groups)

    @property
    def running_request_ids(self) -> tuple[str, ...]:
        """The request ids of the running groups, rows first (no record made)."""
        rows, ids = self.rows, self.rows.request_ids
        if len(ids) != decode_rows.num_groups(rows):  # a group of several sequences: its first row's
            ids = tuple(ids[i] for i in decode_rows.first_rows(rows))
        return ids + tuple(group.request_id for group in self.running_groups)

    @property
    def num_running(self) -> int:
        """Running groups, rows included."""
        return decode_rows.num_groups(self.rows) + len(self.running_groups)

    @property
    def queue_settled(self) -> bool:
        """Whether, if the pending step (planned, not yet recorded) only decodes, the step
        after it admits and swaps in nothing unless a running sequence ends or is aborted, or
        a request arrives: nothing waits or is swapped out, or the pending step tried them
        all (`SchedulerOutput.queue_tried`)."""
        return not (self.waiting or self.swapped) or (self.pending is not None and self.pending.queue_tried)

    def without_rows(self) -> "SchedulerState":
        """This state with every running group a record (none held as a row)."""
        if not len(self.rows):
            return self
        return dataclasses.replace(self, running_groups=self.running, rows=NO_ROWS)


def without_ids(live_ids: HashTrieSet, groups: tuple[SequenceGroup, ...]) -> HashTrieSet:
    """`live_ids` without the request ids of `groups` (groups that left the queues)."""
    for group in groups:
        live_ids = live_ids.remove(group.request_id)
    return live_ids


@record
class SchedulerStats:
    """Queue lengths (in groups), running sequences, preemptions, device KV usage, block stats."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_running_seqs: int
    num_preemptions: int
    num_swap_outs: int
    kv_usage: float
    blocks: BlockManagerStats
