"""Multi-step decode: several decode steps in one dispatch, sampled on the device.

A step that only decodes costs the host the same Python work whether the device computes one
token per sequence or eight: schedule, build the arrays, dispatch, wait, record, update. With
``num_scheduler_steps`` k > 1 (vLLM's name), such a step becomes one program that runs up to k
decode steps in a loop on the device (``stages._decode_steps``), each step's sampled tokens
the next step's inputs, so the host's work is paid once per k tokens per sequence:

    scheduler: a plan of decodes only, each reserving the slots of its next k tokens (fewer
    within max_tokens and max_model_len)  →  one loop program  →  the host reads k tokens per
    sequence and records them in order, up to a stop (EOS, stop token or string, max_tokens),
    dropping the tokens after it  →  the scheduler appends what was kept, frees what stopped.

Outputs are those of k = 1: each step samples with the parameters and the random stream the
sequence would have had (``SamplingBatch.step`` counts on; penalties count the loop's earlier
tokens), and tokens past a stop are never recorded, their KV written only in blocks the
sequence held alone and frees. What depends on the host between two tokens falls back to
single steps (:func:`allowed`): beam search, bad words, structured outputs, and ``min_tokens``
not reached (EOS is banned until then). Prompts, swaps and preemptions are never in a multi-step plan (the
scheduler's ``_only_decodes``), so a request that arrives waits for the loops on the device: the
one running, and with async scheduling the one dispatched after it (``LLMEngine._plan`` defers
an admission rather than drop a lookahead; no lookahead is dispatched while a request waits).

The rows' decodes (``engine.core.decode_rows``) go through all of it as columns: the plan's
``ScheduledRows`` with their steps, the inputs made from them, the loop after planned from
them (:func:`next_works`), and a loop of plain rows recorded at once (``engine.plain_rows``,
one ``AppendEach`` of every row's kept tokens).

With async scheduling (``engine.async_scheduling``), the loop after this one is dispatched
before this one's tokens reach the host (:func:`next_works`, :func:`dispatch_next`), its
input tokens this loop's last ones on the device, so that the host records a loop while the
device runs the next: when no admission can follow (``SchedulerState.queue_settled``), the
scheduler reserves the slots of both loops, and
the lookahead is taken when the next plan is exactly its work (no sequence stopped), as for
single steps. Its penalties count this loop's tokens, written into their history on the device
(``sampling_rows.next_batch``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine import async_scheduling
from engine.core import scheduled_rows
from engine.core.records import record
from engine.core.scheduled_rows import PlannedWorks, ScheduledRows
from engine.core.scheduler import ScheduledGroupWork, SchedulerState
from engine.request_state import RequestState
from engine.sampling_params import SamplingParams
from engine.worker import sampling_rows
from engine.worker.model_runner import ModelRunner
from engine.worker.sampler import SamplerOutput, SamplingBatch
from engine.worker.sampling_rows import Row


@record
class InFlightSteps:
    """A multi-step decode dispatched: its rows (row i is work i), the tokens on the device
    (int32 [padded rows, k], -1 past a row's steps), the sampler's outputs stacked per step,
    the parameters it sampled with, the last step's tokens on the device (int32 [padded
    rows]: the next loop's inputs), and whether the rows take their logits' arg-max alone
    (``sampling_rows.argmax_suffices``: the same for the loops after, whose sampling is static)."""

    rows: tuple[Row, ...]
    tokens: object
    sampled: SamplerOutput
    batch: SamplingBatch
    last: object
    argmax_only: bool


def allowed(request_ids: Sequence[str], requests: dict[str, RequestState]) -> bool:
    """Whether every running request (``request_ids``) can sample several tokens without the
    host in between: plain sampling (not beam search), no bad words or structured output,
    ``min_tokens`` reached by every sequence."""
    for request_id in request_ids:
        request = requests.get(request_id)
        if request is None or not isinstance(request.params, SamplingParams) or request.steered_by_each_token:
            return False
        if request.params.min_tokens and any(len(seq.token_ids) < request.params.min_tokens
                                             for seq in request.seqs.values()):
            return False
    return True


def dispatch(runner: ModelRunner, kv_caches, works: Sequence[ScheduledGroupWork], requests: dict[str, RequestState],
             num_steps: int, vocab_size: int) -> tuple[InFlightSteps, list]:
    """Dispatch the multi-step decode of ``works`` (decodes of one sequence each, as the
    scheduler plans them), ``num_steps`` wide (the loop's compiled width: the engine's
    ``num_scheduler_steps``, whatever the works' own). Returns it and the new caches."""
    planned = scheduled_rows.rows_alone(works)
    if planned is not None:
        rows = tuple(map(Row, range(len(planned)), map(requests.__getitem__, planned.rows.request_ids),
                         planned.rows.seq_ids.tolist()))
    else:
        rows = tuple(Row(i, requests[work.request_id], work.seq_ids[0]) for i, work in enumerate(works))
    argmax_only = sampling_rows.argmax_suffices(list(rows))
    inputs = runner.prepare(works, range(len(works)), argmax_only=argmax_only)
    batch = sampling_rows.batch_of(list(rows), vocab_size, pad_to=len(inputs.input_ids), steps=num_steps)
    return _run(runner, kv_caches, works, rows, inputs, batch, num_steps, argmax_only)


def _run(runner: ModelRunner, kv_caches, works, rows, inputs, batch: SamplingBatch, num_steps: int,
         argmax_only: bool):
    tokens, sampled, kv_caches, last = runner.run_steps(inputs, kv_caches, batch, _steps(works), num_steps)
    return InFlightSteps(rows, tokens, sampled, batch, last, argmax_only), kv_caches


def _steps(works: Sequence[ScheduledGroupWork]) -> Sequence[int]:
    """Each work's steps (the rows' from their column)."""
    planned = scheduled_rows.rows_alone(works)
    if planned is not None:
        return planned.steps_list()
    return [work.num_steps for work in works]


def dispatch_lookahead(runner: ModelRunner, kv_caches, works: Sequence[ScheduledGroupWork],
                       requests: dict[str, RequestState], state: SchedulerState, in_flight: InFlightSteps,
                       num_steps: int) -> tuple[async_scheduling.Lookahead | None, list]:
    """The loop after ``in_flight`` (the multi-step decode of ``works``) dispatched as a
    lookahead, if it can be (:func:`next_works`), and the caches after it."""
    following = next_works(works, requests, state, num_steps)
    batch = None if following is None else sampling_rows.next_batch(in_flight.batch, in_flight.tokens, num_steps)
    if batch is None:
        return None, kv_caches
    loop, kv_caches = dispatch_next(runner, kv_caches, following, in_flight, batch, num_steps)
    return async_scheduling.Lookahead(following, loop), kv_caches


def next_works(works: Sequence[ScheduledGroupWork], requests: dict[str, RequestState], state: SchedulerState,
               num_steps: int) -> tuple[ScheduledGroupWork, ...] | None:
    """The loop after the multi-step decode ``works`` (of ``num_steps`` each) as the scheduler
    will plan it unless a sequence stops (placeholder tokens, the same block tables), or None
    when it cannot be dispatched now: the scheduler may admit or swap in a group
    (``SchedulerState.queue_settled``), a sequence ends within this loop or runs fewer steps,
    its sampling depends on this loop's tokens, or the next loop's slots are not all in its
    table yet. ``state`` is the scheduler's after planning ``works``."""
    if not state.queue_settled:
        return None
    size, max_model_len, following = state.config.block_manager.block_size, state.config.max_model_len, []
    planned = scheduled_rows.rows_alone(works)
    if planned is not None:
        return _next_rows(planned, requests, num_steps, size, max_model_len)
    for work in works:
        request, seq_id = requests.get(work.request_id), work.seq_ids[0]
        if request is None or work.num_steps != num_steps or not async_scheduling.sampling_is_static(request, seq_id):
            return None
        start = work.start + num_steps
        steps = min(num_steps, request.max_tokens - len(request.generated(seq_id)) - num_steps,
                    max_model_len - start)
        if steps < 1 or start + steps > len(work.block_table) * size:
            return None
        following.append(work.changed(token_ids=(0,), start=start, num_steps=steps))
    return tuple(following)


def _next_rows(planned: ScheduledRows, requests: dict[str, RequestState], num_steps: int, size: int,
               max_model_len: int) -> PlannedWorks | None:
    """`next_works` for the rows' decodes, from their columns (a row's generated tokens are
    its sequence's output count in the scheduler's rows)."""
    rows = planned.rows
    static_from = async_scheduling.static_sampling_from(rows, requests)
    if (static_from is None or planned.steps is None or not np.all(planned.steps == num_steps)
            or np.any(rows.num_output < static_from)):
        return None
    starts = planned.starts + num_steps
    steps = np.minimum(np.minimum(num_steps, rows.max_tokens - rows.num_output - num_steps), max_model_len - starts)
    if np.any(steps < 1) or np.any(starts + steps > planned.table_lengths * size):
        return None
    return PlannedWorks(planned.following(num_steps, steps))


def dispatch_next(runner: ModelRunner, kv_caches, works: Sequence[ScheduledGroupWork], in_flight: InFlightSteps,
                  batch: SamplingBatch, num_steps: int) -> tuple[InFlightSteps, list]:
    """Dispatch the loop ``works`` (:func:`next_works`) after ``in_flight``, its input tokens
    ``in_flight``'s last ones on the device, sampled with ``batch`` (``in_flight``'s ``num_steps``
    on: ``sampling_rows.next_batch``). Returns it and the new caches."""
    inputs = runner.prepare(works, range(len(works)), argmax_only=in_flight.argmax_only)
    inputs = inputs.replace(input_ids=in_flight.last)
    return _run(runner, kv_caches, works, in_flight.rows, inputs, batch, num_steps, in_flight.argmax_only)


def fetch(in_flight: InFlightSteps) -> tuple[np.ndarray, SamplerOutput]:
    """Wait for the tokens (int32 [rows, k]) and the sampler's outputs ([k, rows, ...]) of the
    real rows, on the host."""
    n = len(in_flight.rows)
    sampled = in_flight.sampled
    return np.asarray(in_flight.tokens)[:n], SamplerOutput(
        *(np.asarray(x)[:, :n] for x in (sampled.tokens, sampled.logprobs, sampled.ranks, sampled.top_tokens,
                                         sampled.top_logprobs)))
