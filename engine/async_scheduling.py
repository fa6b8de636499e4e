"""Async scheduling: the next decode step, dispatched before this one's tokens reach the host.

While the device runs step N, the host would otherwise wait for N's tokens, record them,
schedule N+1, build its arrays and dispatch it, with the device idle all that time (about a
quarter of a single-sequence step here). Instead, right after dispatching N, the engine
dispatches a *lookahead* step N+1 whose input tokens are N's sampled tokens still on the
device, then records N while N+1 runs. When the scheduler next decides, it normally decides
exactly the lookahead's work, and the engine takes the lookahead's tokens instead of running
the step again; otherwise the lookahead is dropped. Requests that arrive meanwhile enter a
step later (``LLMEngine._plan``) rather than drop it: a step of device time for every running
request, against the host's turnaround between two steps for the new ones.

A lookahead is only dispatched when it cannot disagree with the scheduler except by a
sequence stopping at N (a stop token, EOS, an abort): a decode-only step, nothing waiting or
swapped out (no admissions), no sequence at its length limit, every next token's slot already
in its block table (in its last token's block, or in the next block, which the scheduler
reserves a step early: ``SchedulerConfig.reserve_next_block``; so no allocation, preemption
or copy-on-write), and no sampling input that depends on the token still on the device
(penalties, bad words, ``min_tokens`` still to reach) or on the host's choices (beam search).
Dropping one is harmless: it wrote KV only one slot past each sequence's context, in a block
the sequence alone holds, where nothing reads before the slot is written again.

A lookahead whose work lost some sequences is dropped, not taken in part: its rows of
sequences that ended would go on into the next lookahead, writing KV past their freed blocks,
and the smaller batch the scheduler planned computes its logits differently in the last bits
(another program), so async scheduling would no longer give exactly the outputs without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from engine.core.records import record
from engine.core.scheduler import ScheduledGroupWork, SchedulerOutput, SchedulerState
from engine.request_state import RequestState
from engine.worker import sampling_rows
from engine.worker.model_runner import ModelRunner, StepInputs
from engine.worker.sampler import SamplerOutput, SamplingBatch
from engine.worker.sampling_rows import Row


@record
class InFlightStep:
    """A step's sampling, dispatched, its outputs not yet read: its rows, and the sampler's
    device arrays (whose first rows are ``rows``, in order); the model's inputs and the
    sampler's parameters, None when the tokens are the decode program's arg-max (what a
    lookahead after it starts from); the next decode's inputs if the decode program computed
    them (``ModelOutput.next_inputs``), and the block tables its inputs hold (those that
    decode's slots were found in)."""

    rows: tuple[Row, ...]
    sampled: SamplerOutput
    inputs: StepInputs
    batch: SamplingBatch | None
    next_inputs: StepInputs | None
    block_tables: tuple[tuple[int, ...], ...]  # those of ``inputs``, one per row


@record
class Lookahead:
    """A decode step (or a multi-step decode's loop: ``engine.multi_step``) dispatched before
    the scheduler decided it, and its sampling. Its works are ``works``, each ``positions_on``
    positions after its ``start`` (placeholder tokens): a single-step lookahead keeps the works
    of the step before it, rather than remaking every one of them each step."""

    works: tuple[ScheduledGroupWork, ...]
    in_flight: object  # InFlightStep, or multi_step.InFlightSteps
    positions_on: int = 0


def dispatch_next(runner: ModelRunner, kv_caches, works: Sequence[ScheduledGroupWork], in_flight: InFlightStep
                  ) -> tuple[Lookahead | None, list]:
    """Dispatch the decode after ``works`` (see :func:`eligible`), its input tokens
    ``in_flight``'s samples on the device. Returns the lookahead (None when the step picked its
    logits rows, or padded its samples to another size) and the caches after it."""
    tokens, inputs = in_flight.sampled.tokens, in_flight.inputs
    if inputs.pick or tokens.shape != inputs.input_ids.shape:
        return None, kv_caches
    next_inputs = in_flight.next_inputs if in_flight.next_inputs is not None else runner.advance(inputs)
    tables = tuple(work.block_table for work in works)
    if tables != in_flight.block_tables:  # the scheduler reserved blocks since: the next slots may be there
        next_inputs = runner.with_tables_of(next_inputs, works)
    inputs = next_inputs.replace(input_ids=tokens)
    out, kv_caches = runner.run(inputs, kv_caches)
    if in_flight.batch is None:  # the same program as ``in_flight``'s, so the arg-max is there
        sampled, batch = sampling_rows.model_argmax(out.argmax), None
    else:
        sampled, batch = sampling_rows.dispatch_next(out.logits, in_flight.batch)
    rows = in_flight.rows
    if any(row.logits_row != i for i, row in enumerate(rows)):
        rows = tuple(dataclasses.replace(row, logits_row=i) for i, row in enumerate(rows))
    in_flight = InFlightStep(rows, sampled, inputs, batch, out.next_inputs, tables)
    return Lookahead(tuple(works), in_flight, positions_on=1), kv_caches


def eligible(works: Sequence[ScheduledGroupWork], requests: dict[str, RequestState], state: SchedulerState,
             block_size: int) -> bool:
    """Whether the step after ``works`` (this step's scheduled work) can be dispatched now (see
    the module's docstring); ``state`` is the scheduler's after this step's ``schedule``."""
    if state.waiting or state.swapped or not works:
        return False
    for work in works:
        request = requests.get(work.request_id)
        if (request is None or work.is_prefill or not work.do_sample or len(work.token_ids) != 1
                or len(work.seq_ids) != 1 or not sampling_is_static(request, work.seq_ids[0])
                or work.start + 1 >= len(work.block_table) * block_size  # the next token's slot is not held
                or len(request.generated(work.seq_ids[0])) + 1 >= request.max_tokens):
            return False
    return True


def sampling_is_static(request: RequestState, seq_id: int) -> bool:
    """Whether the sampler's inputs for ``seq_id``'s next token do not depend on this step's
    token: the request's sampling does not (:attr:`RequestState.sampling_is_static`), and
    ``min_tokens`` is reached (the step after this one must not ban EOS)."""
    return request.sampling_is_static and len(request.generated(seq_id)) >= request.params.min_tokens


def computed(lookahead: Lookahead, plan: SchedulerOutput) -> bool:
    """Whether ``lookahead`` computed exactly the step ``plan`` plans: the same works, through
    the same blocks (the plan's tables may hold a block more, reserved since for later tokens)."""
    works, on = lookahead.works, lookahead.positions_on
    if (plan.blocks_to_swap_out or plan.blocks_to_swap_in or plan.blocks_to_copy or plan.preempted
            or len(plan.scheduled) != len(works)):
        return False
    for planned, work in zip(plan.scheduled, works):
        table = work.block_table
        if (planned.start != work.start + on or planned.seq_ids != work.seq_ids
                or planned.request_id != work.request_id or planned.num_steps != work.num_steps
                or planned.is_prefill != work.is_prefill or planned.do_sample != work.do_sample
                or planned.block_table[: len(table)] != table):
            return False
    return True
