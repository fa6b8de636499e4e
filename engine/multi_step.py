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
single steps (:func:`allowed`): beam search, bad words, and ``min_tokens`` not reached (EOS is
banned until then). Prompts, swaps and preemptions are never in a multi-step plan (the
scheduler's ``_only_decodes``), so a request that arrives waits at most for the loop running.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from engine.core.scheduler import ScheduledGroupWork, SequenceGroup
from engine.request_state import RequestState
from engine.sampling_params import SamplingParams
from engine.worker import sampling_rows
from engine.worker.model_runner import ModelRunner
from engine.worker.sampler import SamplerOutput
from engine.worker.sampling_rows import Row


@dataclasses.dataclass(frozen=True)
class InFlightSteps:
    """A multi-step decode dispatched: its rows (row i is work i), the tokens on the device
    (int32 [padded rows, k], -1 past a row's steps) and the sampler's outputs stacked per step."""

    rows: tuple[Row, ...]
    tokens: object
    sampled: SamplerOutput


def allowed(running: Sequence[SequenceGroup], requests: dict[str, RequestState]) -> bool:
    """Whether every running request can sample several tokens without the host in between:
    plain sampling (not beam search), no bad words, ``min_tokens`` reached by every sequence."""
    for group in running:
        request = requests.get(group.request_id)
        if request is None or not isinstance(request.params, SamplingParams) or request.bad_word_ids:
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
    rows = tuple(Row(i, requests[work.request_id], work.seq_ids[0]) for i, work in enumerate(works))
    argmax_only = sampling_rows.argmax_suffices(list(rows))
    inputs = runner.prepare(works, list(range(len(works))), argmax_only=argmax_only)
    batch = sampling_rows.batch_of(list(rows), vocab_size, pad_to=len(inputs.input_ids))
    tokens, sampled, kv_caches = runner.run_steps(inputs, kv_caches, batch, [w.num_steps for w in works], num_steps)
    return InFlightSteps(rows, tokens, sampled), kv_caches


def fetch(in_flight: InFlightSteps) -> tuple[np.ndarray, SamplerOutput]:
    """Wait for the tokens (int32 [rows, k]) and the sampler's outputs ([k, rows, ...]) of the
    real rows, on the host."""
    n = len(in_flight.rows)
    sampled = in_flight.sampled
    return np.asarray(in_flight.tokens)[:n], SamplerOutput(
        *(np.asarray(x)[:, :n] for x in (sampled.tokens, sampled.logprobs, sampled.ranks, sampled.top_tokens,
                                         sampled.top_logprobs)))
