"""From one step's logits to sampled tokens: which rows to sample and with what parameters.

Every sequence that samples this step gets one row; the rows of a prefill shared by ``n``
sequences all read the logits of its last token. Row arrays are padded to a power of two
(padding rows are greedy and discarded), at least to the logits' row count, so the sampler
compiles for few shapes, ahead of the steps that need them (:func:`warm_up`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from engine import structured_output
from engine.core import scheduled_rows
from engine.core.records import record
from engine.core.scheduler import ScheduledGroupWork
from engine.request_state import RequestState
from engine.sampling_params import SamplingParams
from engine.worker import stages
from engine.worker.sampler import SamplerOutput, SamplingBatch, appended_history, pick_rows, sample

# Biases (and allowed lists) of up to this many tokens share one sampler program per row count.
_MIN_BIAS_WIDTH = 16
# A padding row's (empty) token list, and bias arrays.
_NO_TOKENS = np.zeros(0, np.int32)
_NO_BIAS = (_NO_TOKENS, np.zeros(0, np.float32))


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@record
class Row:
    """One sampled row: the logits row it reads, its request and sequence."""

    logits_row: int
    request: RequestState
    seq_id: int


def logits_plan(works: Sequence[ScheduledGroupWork], requests: dict[str, RequestState]
                ) -> tuple[list[int], list[Row], list[tuple[RequestState, ScheduledGroupWork, int]]]:
    """Which of ``works``' tokens (indices into their concatenation) need logits: the last of
    every sampling work, read by one row per sequence (the returned ``Row``s), and every token
    of prefills whose request wants prompt log-probabilities (``(request, work, first logits
    row)`` each)."""
    logits_tokens, rows, prompt_rows, cursor = [], [], [], 0
    planned, works = scheduled_rows.rows_of(works)
    if planned is not None:  # the rows' decodes, from their columns: a token each, sampled
        for request_id, seq_id in zip(planned.rows.request_ids, planned.rows.seq_ids.tolist()):
            request = requests.get(request_id)
            if request is not None:
                logits_tokens.append(cursor)
                rows.append(Row(len(logits_tokens) - 1, request, seq_id))
            cursor += 1
    for work in works:
        request = requests.get(work.request_id)
        n = len(work.token_ids)
        if request is not None and work.is_prefill and request.prompt_logprobs is not None:
            prompt_rows.append((request, work, len(logits_tokens)))
            logits_tokens += range(cursor, cursor + n)
        elif request is not None and work.do_sample:
            logits_tokens.append(cursor + n - 1)
        if request is not None and work.do_sample:
            rows += [Row(len(logits_tokens) - 1, request, seq_id) for seq_id in work.seq_ids]
        cursor += n
    return logits_tokens, rows, prompt_rows


def _padded(token_lists, *, when: bool, fill=-1, dtype=np.int32, min_width: int = 1, room: int = 0) -> np.ndarray:
    """[rows, max(min_width, pow2(longest + room))] of token ids (or other values), ``fill``
    padded ([rows, 0] unless ``when``)."""
    width = max(min_width, _pow2(max((len(t) for t in token_lists), default=1) + room)) if when else 0
    out = np.full((len(token_lists), width), fill, dtype)
    if when:
        for i, tokens in enumerate(token_lists):
            out[i, : len(tokens)] = tokens
    return out


def batch_for(rows: list[Row], num_top: int, vocab_size: int, size: int = 1, steps: int = 1) -> SamplingBatch:
    """The sampler's per-row parameters for ``rows``, padded to ``size`` rows or the next
    power of two of their number, whichever is more. The tokens the penalties count have room
    for as many again as the longest output has (at least ``steps``, those of a step or loop
    dispatched ahead: :func:`next_batch`), so lookaheads rebuild them a logarithmic number of times.

    A top_k of the vocabulary's size or more keeps every token, so it is off; tokens outside
    the vocabulary can never be sampled, so they are not banned."""
    size = max(size, _pow2(len(rows)))
    params = [row.request.params for row in rows]
    sampling = [p if isinstance(p, SamplingParams) else SamplingParams(temperature=0.0) for p in params]
    pad = size - len(rows)

    def column(values, dtype, fill):
        return np.array(list(values) + [fill] * pad, dtype)

    penalties = any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in sampling)
    outputs = [row.request.generated(row.seq_id) for row in rows] + [[]] * pad
    prompts = [row.request.prompt_token_ids for row in rows] + [()] * pad
    banned = [[t for t in row.request.banned_tokens(row.seq_id) if t < vocab_size] for row in rows] + [()] * pad
    biases = [p.logit_bias_arrays for p in sampling] + [_NO_BIAS] * pad
    biased = any(len(tokens) for tokens, _ in biases)
    allowed = [p.allowed_array for p in sampling] + [_NO_TOKENS] * pad
    top_ks = [p.top_k if p.top_k < vocab_size else 0 for p in sampling]
    top_k = max(top_ks, default=0)
    return SamplingBatch(
        temperature=column((p.temperature for p in sampling), np.float32, 0.0),
        top_p=column((p.top_p for p in sampling), np.float32, 1.0),
        top_k=column(top_ks, np.int32, 0),
        min_p=column((p.min_p for p in sampling), np.float32, 0.0),
        presence_penalty=column((p.presence_penalty for p in sampling), np.float32, 0.0),
        frequency_penalty=column((p.frequency_penalty for p in sampling), np.float32, 0.0),
        repetition_penalty=column((p.repetition_penalty for p in sampling), np.float32, 1.0),
        seed=column((row.request.seed for row in rows), np.uint32, 0),
        sample_index=column((row.request.sample_index(row.seq_id) for row in rows), np.int32, 0),
        step=column((len(tokens) for tokens in outputs[: len(rows)]), np.int32, 0),
        output_tokens=_padded(outputs, when=penalties, room=max(steps, max(map(len, outputs))) if penalties else 0),
        prompt_tokens=_padded(prompts, when=penalties),
        banned=_padded(banned, when=any(banned)),
        bias_tokens=_padded([tokens for tokens, _ in biases], when=biased, min_width=_MIN_BIAS_WIDTH),
        bias_values=_padded([values for _, values in biases], when=biased, fill=0.0, dtype=np.float32,
                                   min_width=_MIN_BIAS_WIDTH),
        allowed=_padded(allowed, when=any(len(ids) for ids in allowed), min_width=_MIN_BIAS_WIDTH),
        token_bitmask=_constraint_masks(rows, size, vocab_size),
        penalties=penalties,
        top_p_or_min_p=any(p.top_p < 1.0 or p.min_p > 0.0 for p in sampling if not p.greedy),
        max_top_k=min(_pow2(top_k), vocab_size) if top_k else 0,
        all_greedy=all(p.greedy for p in sampling),
        num_top_logprobs=_pow2(num_top) if num_top else 0,
        ranks=any(p.logprobs is not None for p in params if isinstance(p, SamplingParams)),
        logprobs=any(row.request.tracks_logprob for row in rows),
    )


def _constraint_masks(rows: list[Row], size: int, vocab_size: int) -> np.ndarray:
    """int32 [size, words]: each constrained row's allowed next tokens as a bitmask
    (:mod:`engine.structured_output`), every bit set in the other rows; [size, 0] when no row
    is constrained, so that their batches run the sampler's programs without a mask."""
    matchers = [(i, matcher) for i, row in enumerate(rows)
                if (matcher := row.request.matcher(row.seq_id)) is not None]
    if not matchers:
        return np.zeros((size, 0), np.int32)
    bitmask = np.full((size, structured_output.bitmask_width(vocab_size)), -1, np.int32)
    structured_output.fill_bitmasks(matchers, bitmask)
    return bitmask


def argmax_suffices(rows: list[Row]) -> bool:
    """Whether the sampler takes nothing but each row's arg-max of the model's logits: every row
    greedy, without penalties, logit biases, banned or allowed tokens or a constraint, and without
    log-probabilities (what :func:`batch_for` then switches off). The head may then compute
    exactly only the logits that can be the largest (``models.Metadata.argmax_rows``)."""
    return bool(rows) and all(_argmax_suffices(row) for row in rows)


def _argmax_suffices(row: Row) -> bool:
    request = row.request
    return request.samples_greedily and not request.bans_any(row.seq_id)


def sample_rows(logits, rows: list[Row], pad_to: int = 1) -> SamplerOutput:
    """Sample every row; returns numpy arrays (tokens, logprobs, top tokens, top logprobs).

    logits: float32[L, vocab]. The rows are padded to at least ``pad_to``: L, when it is one
    of the sizes :func:`warm_up` compiled, so the step runs a compiled program."""
    return fetch(dispatch(logits, rows, pad_to)[0], len(rows))


def dispatch(logits, rows: list[Row], pad_to: int = 1) -> tuple[SamplerOutput, SamplingBatch]:
    """:func:`sample_rows` without waiting: the sampler's device arrays, padded rows included
    (int32 tokens [pad], ...), and the batch of parameters it sampled with."""
    batch = batch_of(rows, logits.shape[-1], pad_to)
    return _sample(logits, rows, batch), batch


def batch_of(rows: list[Row], vocab_size: int, pad_to: int = 1, steps: int = 1) -> SamplingBatch:
    """:func:`batch_for` ``rows``, with as many alternatives as the most any of them wants."""
    num_top = max((_wanted_top(row.request) for row in rows), default=0)
    return batch_for(rows, num_top, vocab_size, size=pad_to, steps=steps)


def next_batch(batch: SamplingBatch, tokens, num_steps: int = 1) -> SamplingBatch | None:
    """The parameters of the step (or multi-step loop) after the one ``batch`` sampled, for the
    same rows, each of which sampled ``num_steps`` ``tokens`` there (int32 [rows] or [rows, K],
    on the device): each row's step counts them, so its random numbers are those it would draw
    after recording them, and its penalties' tokens include them (written on the device:
    :func:`~engine.worker.sampler.appended_history`). None when those have no room for them
    (the host builds the next batch, wider: :func:`batch_for`)."""
    step = batch.step + np.int32(num_steps)
    if not batch.penalties:
        return batch.replace(step=step)
    if int(batch.step.max(initial=0)) + num_steps > batch.output_tokens.shape[1]:
        return None
    history = appended_history(batch.output_tokens, batch.step, tokens.reshape(tokens.shape[0], -1))
    return batch.replace(step=step, output_tokens=history)


def dispatch_next(logits, batch: SamplingBatch) -> SamplerOutput:
    """Sample the logits of a lookahead's rows (:mod:`engine.async_scheduling`), the logits'
    own in order, with ``batch`` (:func:`next_batch`)."""
    return sample(_committed(logits), batch)


def _committed(logits):
    """``logits`` placed on their device: the sampler's programs differ by whether they are,
    and :func:`warm_up` compiles the committed ones (whether a head's logits are depends on
    how it was compiled)."""
    return logits if logits.committed else jax.device_put(logits, next(iter(logits.devices())))


def _sample(logits, rows: list[Row], batch: SamplingBatch) -> SamplerOutput:
    """The sampler on the logits rows of ``rows`` (logits float32[L, vocab]), each picked into
    the batch's row of the same index; the batch's padding rows read row 0."""
    logits = _committed(logits)
    picked = [row.logits_row for row in rows]
    size = batch.temperature.shape[0]
    if size != logits.shape[0] or picked != list(range(len(rows))):
        index = np.zeros(size, np.int32)  # padding rows read row 0
        index[: len(rows)] = picked
        logits = pick_rows(logits, index)
    return sample(logits, batch)


def model_argmax(tokens) -> SamplerOutput:
    """What the sampler gives rows whose tokens are the model's arg-max (:func:`argmax_suffices`):
    ``tokens`` (int32 [rows], on the device), and the zeros it gives where no log-probability
    is asked for."""
    rows = tokens.shape[0]
    nothing = np.zeros((rows, 0), np.float32)
    return SamplerOutput(tokens, np.zeros(rows, np.float32), np.zeros(rows, np.int32), nothing.astype(np.int32),
                         nothing)


def fetch(out: SamplerOutput, num_rows: int) -> SamplerOutput:
    """The first ``num_rows`` rows of :func:`dispatch`'s arrays, as numpy (waits for them)."""
    return SamplerOutput(*(np.asarray(x)[:num_rows] for x in (out.tokens, out.logprobs, out.ranks, out.top_tokens,
                                                              out.top_logprobs)))


def warm_up(vocab_size: int, sizes, *, greedy: bool = True) -> None:
    """Compile the sampler for each row count in ``sizes``: the program of every step without
    logit biases, penalties, banned tokens, top-k, top-p, min-p or logprobs, either all greedy (about
    0.15 s each) or with a temperature (vLLM's and OpenAI's default; about 0.6 s each).

    The engine compiles the greedy ones at start-up, and the others when it has nothing to do
    (:meth:`engine.llm_engine.LLMEngine.warm_up_when_idle`): all of them at start-up would
    take a cold start here over its 30 s target. Those take long enough to be kept in the
    persistent compilation cache, so later processes load them in about 0.1 s each; greedy
    ones are too quick to be kept there, hence compiled at every start.
    """
    for size in sizes:
        batch = batch_for([], 0, vocab_size, size=size)
        if not greedy:
            batch = batch.replace(all_greedy=False)
        # Placed on the device, as the model's logits are: an uncommitted array compiles anew.
        logits = jax.device_put(np.zeros((size, vocab_size), np.float32), jax.devices()[0])
        jax.block_until_ready(sample(logits, batch))


def activation_bytes(vocab_size: int, size: int) -> int:
    """Device memory the sampler needs for ``size`` rows besides nothing resident: its heaviest
    program's (a temperature with top-k, top-p, penalties, ranks and 20 log-probabilities)
    arguments, results and scratch, from XLA's buffer assignment. Compiles it without keeping it."""
    batch = batch_for([], 0, vocab_size, size=size).replace(
        all_greedy=False, top_p_or_min_p=True, max_top_k=64, penalties=True, logprobs=True, ranks=True,
        num_top_logprobs=20)
    logits = jax.ShapeDtypeStruct((size, vocab_size), np.float32)
    return stages.footprint(sample.lower(logits, batch).compile())


def _wanted_top(request: RequestState) -> int:
    if request.is_beam_search:
        return 2 * request.params.beam_width
    return request.params.logprobs or 0
