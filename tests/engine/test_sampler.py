"""The sampler's array functions against plain numpy and Hugging Face: the arg-max, the draw
from the cumulative distribution, penalties, and truncation by top-k, min-p and top-p."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.worker.sampler import SamplingBatch, apply_penalties, argmax, inverse_cdf, truncate
from tests.hf_torch import require_torch


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 5), vocab=st.integers(1, 700), levels=st.integers(1, 4), seed=st.integers(0, 2**16),
       masked=st.floats(0, 1))
def test_greedy_picks_the_first_of_the_highest_logits(rows, vocab, levels, seed, masked):
    """Ties (few distinct values) go to the lowest token id, as with numpy and torch; -inf
    (banned) logits and vocabularies that are no multiple of the search's chunk included."""
    rng = np.random.default_rng(seed)
    logits = rng.integers(0, levels, (rows, vocab)).astype(np.float32)
    logits[rng.random((rows, vocab)) < masked] = -np.inf
    np.testing.assert_array_equal(np.asarray(argmax(jnp.asarray(logits))), logits.argmax(axis=-1))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(1, 700), seed=st.integers(0, 2**16), zeros=st.floats(0, 0.95))
def test_the_draw_picks_where_the_running_sum_passes_the_target(rows, vocab, seed, zeros):
    """The chunked inverse of the cumulative distribution against numpy's over the whole row:
    the first token whose running sum exceeds the target, so zero-weight (truncated or
    banned) tokens are never drawn, even for a target of exactly 0 or one at the very top.
    Small integer weights keep every sum exact."""
    rng = np.random.default_rng(seed)
    weights = rng.integers(0, 4, (rows, vocab)).astype(np.float32)
    weights[rng.random((rows, vocab)) < zeros] = 0
    weights[np.arange(rows), rng.integers(0, vocab, rows)] = 1  # every row keeps a token
    totals = weights.sum(axis=-1)
    targets = np.floor(rng.random(rows) * (totals + 1)).astype(np.float32)  # 0 ... total, inclusive
    expected = [min(np.searchsorted(np.cumsum(w), t, side="right"), np.flatnonzero(w).max())
                for w, t in zip(weights, targets)]
    drawn = np.asarray(inverse_cdf(jnp.asarray(weights), jnp.asarray(targets)))
    np.testing.assert_array_equal(drawn, expected)
    assert (weights[np.arange(rows), drawn] > 0).all()


@settings(max_examples=30, deadline=None)
@given(vocab=st.integers(129, 3000), seed=st.integers(0, 2**16), zeros=st.floats(0, 0.9), spread=st.floats(0.5, 8))
def test_the_draw_never_picks_a_zero_weight_token(vocab, seed, zeros, spread):
    """Float weights as a softmax makes them, with zeros (truncated or banned tokens, among them
    the first of every 128), and targets at and just past the boundaries of the chunked running
    sum as XLA rounds it: the drawn token has weight, and its running sum crosses the target
    up to rounding."""
    rng = np.random.default_rng(seed)
    rows = 32
    logits = rng.standard_normal((rows, vocab)) * spread
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True)).astype(np.float32)
    weights[:, ::128] = 0
    weights[rng.random((rows, vocab)) < zeros] = 0
    weights[np.arange(rows), rng.integers(0, vocab, rows)] = 1
    chunk_sums = np.pad(weights, ((0, 0), (0, -vocab % 128))).reshape(rows, -1, 128).sum(axis=-1)
    ends = np.asarray(jnp.cumsum(jnp.asarray(chunk_sums), axis=-1))
    targets = ends[np.arange(rows), rng.integers(0, ends.shape[1], rows)]
    targets = np.where(rng.random(rows) < 0.5, targets, np.nextafter(targets, np.float32(np.inf))).astype(np.float32)
    drawn = np.asarray(inverse_cdf(jnp.asarray(weights), jnp.asarray(targets)))
    assert (weights[np.arange(rows), drawn] > 0).all()
    running = np.cumsum(weights.astype(np.float64), axis=-1)
    slack = 1e-5 * running[:, -1]
    through = running[np.arange(rows), drawn]
    before = through - weights[np.arange(rows), drawn]
    assert ((before <= targets + slack) & ((through >= targets - slack) | (drawn == vocab - 1 - np.argmax(
        weights[:, ::-1] > 0, axis=-1)))).all()


def test_penalties_change_logits_as_hugging_face_and_openai_do():
    torch = require_torch("Hugging Face's repetition penalty")
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 32)).astype(np.float32) * 3
    prompt = np.array([[3, 4, 5, -1], [7, 7, 8, 9]], np.int32)
    output = np.array([[5, 5, 10, -1], [11, -1, -1, -1]], np.int32)
    batch = SamplingBatch(
        temperature=jnp.ones(2), top_p=jnp.ones(2), top_k=jnp.zeros(2, jnp.int32), min_p=jnp.zeros(2),
        presence_penalty=jnp.asarray([0.5, 0.0]), frequency_penalty=jnp.asarray([0.25, 1.0]),
        repetition_penalty=jnp.asarray([1.3, 0.8]), seed=jnp.zeros(2, jnp.uint32),
        sample_index=jnp.zeros(2, jnp.int32), step=jnp.zeros(2, jnp.int32), output_tokens=jnp.asarray(output),
        prompt_tokens=jnp.asarray(prompt), banned=jnp.zeros((2, 0), jnp.int32),
        bias_tokens=jnp.zeros((2, 0), jnp.int32), bias_values=jnp.zeros((2, 0)),
        allowed=jnp.zeros((2, 0), jnp.int32), token_bitmask=jnp.zeros((2, 0), jnp.int32), penalties=True)
    ours = np.asarray(apply_penalties(jnp.asarray(logits), batch))
    for row, (penalty, presence, frequency) in enumerate([(1.3, 0.5, 0.25), (0.8, 0.0, 1.0)]):
        seen = [t for t in list(prompt[row]) + list(output[row]) if t >= 0]
        expected = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([seen]), torch.tensor(logits[row:row + 1]))
        expected = expected[0].numpy()
        counts = np.bincount([t for t in output[row] if t >= 0], minlength=32)
        expected = expected - frequency * counts - presence * (counts > 0)
        np.testing.assert_allclose(ours[row], expected, rtol=1e-6, atol=1e-6)


def test_top_p_keeps_its_share_of_what_top_k_and_min_p_leave():
    """vLLM's order: top-p measures the probability left after top-k and min-p, renormalised
    (HF's too for top-k; HF applies min-p after top-p). Here the top two tokens hold 0.40 and
    0.35 of the whole vocabulary; of those two, the first alone holds 0.53, so top_p 0.5 after
    top_k 2 keeps only it (of the whole vocabulary it would need both)."""
    probs = np.array([0.40, 0.35, 0.10, 0.08, 0.07], np.float32)
    rows = 4
    logits = jnp.asarray(np.log(np.stack([probs] * rows)))
    zeros = {name: jnp.zeros((rows, 0), jnp.int32) for name in ("output_tokens", "prompt_tokens", "banned",
                                                                 "bias_tokens", "allowed", "token_bitmask")}
    batch = SamplingBatch(
        temperature=jnp.ones(rows), top_p=jnp.asarray([0.5, 0.5, 0.99, 0.5]),
        top_k=jnp.asarray([2, 0, 2, 0], jnp.int32), min_p=jnp.asarray([0.0, 0.0, 0.0, 0.8]),
        presence_penalty=jnp.zeros(rows), frequency_penalty=jnp.zeros(rows), repetition_penalty=jnp.ones(rows),
        seed=jnp.zeros(rows, jnp.uint32), sample_index=jnp.zeros(rows, jnp.int32), step=jnp.zeros(rows, jnp.int32),
        bias_values=jnp.zeros((rows, 0)), **zeros, top_p_or_min_p=True, max_top_k=2)
    kept = np.isfinite(np.asarray(truncate(logits, batch)))
    assert kept.tolist() == [[True, False, False, False, False],  # top_k 2, then top_p 0.5
                             [True, True, False, False, False],   # top_p 0.5 alone: 0.40 + 0.35
                             [True, True, False, False, False],   # top_k 2 alone
                             [True, False, False, False, False]]  # min_p 0.8 keeps two, then top_p 0.5
