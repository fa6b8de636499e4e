"""Immutable records of requests and their sequences.

A request becomes a `SequenceGroup`: one prompt and `num_seqs` sequences (n parallel samples,
best_of candidates or beam-search beams) that all start from that prompt. Every change is a new
record made with `dataclasses.replace`; the scheduler owns the transitions between statuses.
"""

import dataclasses
import enum
import operator

from engine.core.records import record


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life: queued, computing, on host, or done (and why).
    ``is_finished`` is True for the four terminal statuses (an attribute of each member, read
    several times per sequence per step: a property, or a set of the members, costs a Python
    call each)."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    is_finished: bool


for _status in SequenceStatus:
    _status.is_finished = _status.name.startswith("FINISHED_")


@record
class Sequence:
    """One token stream. `num_computed_tokens` counts the tokens whose KV is in the cache."""

    seq_id: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...] = ()
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The prompt followed by the generated tokens."""
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, stop: int) -> tuple[int, ...]:
        """`token_ids[start:stop]` (0 <= start <= stop), without building all of `token_ids`
        (a decode step reads one token of each sequence)."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : stop - prompt_len]
        if stop <= prompt_len:
            return self.prompt_token_ids[start:stop]
        return self.token_ids[start:stop]

    @property
    def len(self) -> int:
        """Number of tokens: prompt plus output."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to be run through the model before the next sample."""
        return self.len - self.num_computed_tokens


@record
class SequenceGroup:
    """A request: its sequences, gang-scheduled together.

    `arrival` orders requests first-come-first-served. `num_seqs` is the number of sequences the
    request was created with; an update's forks may only replace sequences that end in the same
    update, so a group never runs more sequences than it was admitted with.
    `expected_output_len` is used only by the orca-pow2 / orca-oracle reservation baselines.
    `in_prefill` is true from admission until the group first samples. `ignored_reason` says why
    a request was refused (FINISHED_IGNORED). `use_prefix_cache` False computes the whole prompt
    even when the prefix cache holds part of it (a request that wants every prompt token's logits).
    `may_fork` marks a group whose updates may fork sequences (beam search): a block reserved
    ahead for one of them would only be shared, then copied.
    """

    request_id: str
    seqs: tuple[Sequence, ...]
    arrival: int
    max_tokens: int
    num_seqs: int
    expected_output_len: int | None = None
    in_prefill: bool = True
    ignored_reason: str | None = None
    use_prefix_cache: bool = True
    may_fork: bool = False

    def with_seqs(self, seqs: tuple[Sequence, ...], in_prefill: bool) -> "SequenceGroup":
        """This group with `seqs` and `in_prefill`: what `dataclasses.replace` makes, at a
        third of its cost (the scheduler makes one per running group per step)."""
        return SequenceGroup(self.request_id, seqs, self.arrival, self.max_tokens, self.num_seqs,
                             self.expected_output_len, in_prefill, self.ignored_reason, self.use_prefix_cache,
                             self.may_fork)

    @property
    def unfinished_seqs(self) -> tuple[Sequence, ...]:
        """The sequences still generating (they hold or will hold KV blocks)."""
        seqs = self.seqs
        if len(seqs) == 1:  # most groups
            return () if seqs[0].status.is_finished else seqs
        return tuple(seq for seq in seqs if not seq.status.is_finished)

    @property
    def is_finished(self) -> bool:
        """True when no sequence is still generating."""
        return not self.unfinished_seqs

    @property
    def prompt_len(self) -> int:
        """Length of the request's prompt (shared by all its sequences)."""
        return len(self.seqs[0].prompt_token_ids)


def set_unfinished_status(group: SequenceGroup, status: SequenceStatus) -> SequenceGroup:
    """Give every unfinished sequence of `group` the status `status`."""
    seqs = tuple(
        seq if seq.status.is_finished else dataclasses.replace(seq, status=status)
        for seq in group.seqs
    )
    return dataclasses.replace(group, seqs=seqs)


_ARRIVAL = operator.attrgetter("arrival")


def by_arrival(groups: tuple[SequenceGroup, ...]) -> tuple[SequenceGroup, ...]:
    """`groups` in arrival order (first come, first served)."""
    return tuple(sorted(groups, key=_ARRIVAL))
