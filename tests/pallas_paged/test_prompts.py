"""Whole fresh prompts through cuDNN on Hopper (:mod:`pallas_paged.prompts`): when a step
qualifies, the packed layout cuDNN is given, and when GPUs choose it. cuDNN itself runs only
on a GPU (``make test-gpu``); ``make test-accel`` compiles it for an H100."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_paged
from pallas_paged import prompts, reference, tiling
from tests.pallas_paged.scenarios import assert_close, make


def test_a_step_is_fresh_only_when_every_context_is_its_own_queries():
    starts = jnp.array([0, 5, 12, 12, 12], jnp.int32)  # 5 and 7 tokens, then two padding sequences
    assert prompts.all_fresh(jnp.array([5, 7, 0, 0], jnp.int32), starts)
    assert not prompts.all_fresh(jnp.array([5, 9, 0, 0], jnp.int32), starts)  # a cached prefix of 2
    assert not prompts.all_fresh(jnp.array([5, 7, 3, 0], jnp.int32), starts)  # a sequence with no query this step


def test_packed_segments_put_sequences_with_tokens_first_and_mark_the_rest():
    seqlens, offsets = prompts.packed_segments(jnp.array([0, 5, 5, 12, 12], jnp.int32))
    np.testing.assert_array_equal(seqlens, [[5, 7, -1, -1]])
    np.testing.assert_array_equal(offsets, [[0, 5, 12, -1, -1]])
    seqlens, offsets = prompts.packed_segments(jnp.array([0, 3, 4], jnp.int32))
    np.testing.assert_array_equal(seqlens, [[3, 1]])
    np.testing.assert_array_equal(offsets, [[0, 3, 4]])


@pytest.mark.parametrize("seqs,fresh", [([(20, 20), (7, 7), (0, 0)], True), ([(20, 20), (30, 7)], False)],
                         ids=["whole-prompts", "a-cached-prefix"])
@pytest.mark.parametrize("q_dtype", [jnp.bfloat16, jnp.float32], ids=["bf16-q", "f32-q"])
def test_each_step_takes_cudnn_only_when_all_its_prompts_are_fresh(monkeypatch, seqs, fresh, q_dtype):
    """`or_paged` on the device: cuDNN (here a stand-in that answers the dense oracle over the
    step's own K and V, as cuDNN would) for a step of whole prompts, the paged kernel
    otherwise. Each path is given inputs only it can use: for the fresh step the cache holds
    NaN, for the other the step's K and V are zeros. The engine's float32 queries and K and V
    reach cuDNN in the cache's bfloat16; the output comes back in q's dtype."""
    s = make(seqs, q_heads=4, kv_heads=2, head_dim=64, block_size=16, dtype=jnp.bfloat16, padding_tokens=3)
    expected = reference.ragged_paged_attention(*s.ragged_args)
    q, k_cache, v_cache, *rest = s.ragged_args
    q = q.astype(q_dtype)
    taken = []

    def stand_in(q, k, v, query_start_loc, *, scale):
        taken.append("cudnn")
        assert {q.dtype, k.dtype, v.dtype} == {jnp.dtype(jnp.bfloat16)}, "cuDNN takes the cache's dtype"
        return dense_prompts_attention(q, k, v, query_start_loc, scale=scale)

    def paged(*arrays):
        taken.append("paged")
        return pallas_paged.ragged_paged_attention(*arrays, scale=64**-0.5)

    monkeypatch.setattr(prompts, "cudnn_attention", stand_in)
    if fresh:
        k_cache, v_cache, new_kv = jnp.full_like(k_cache, jnp.nan), jnp.full_like(v_cache, jnp.nan), s.new_kv()
    else:
        new_kv = tuple(jnp.zeros_like(x) for x in s.new_kv())
    new_kv = tuple(x.astype(q_dtype) for x in new_kv)  # as the model computes them, before the cache rounds them
    got = prompts.or_paged(paged, new_kv, scale=64**-0.5)(q, k_cache, v_cache, *rest)
    assert sorted(taken) == ["cudnn", "paged"]  # lax.cond traces both
    assert got.dtype == q_dtype
    assert_close(got, expected, jnp.bfloat16)


def dense_prompts_attention(q, k, v, query_start_loc, *, scale):
    """What cuDNN computes for whole prompts, in plain JAX (traceable, as under ``lax.cond``):
    each token attends causally to the tokens of its own sequence, from the step's own keys
    and values. q: [tokens, q_heads, d]; k, v: [tokens, kv_heads, d] → like q, padding zeros."""
    tokens, group = q.shape[0], q.shape[1] // k.shape[1]
    position = jnp.arange(tokens)
    segment = jnp.searchsorted(query_start_loc, position, side="right") - 1
    visible = (segment[:, None] == segment[None, :]) & (position[None, :] <= position[:, None])
    k, v = (jnp.repeat(x.astype(jnp.float32), group, axis=1) for x in (k, v))
    scores = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k) * scale
    weights = jax.nn.softmax(jnp.where(visible[None], scores, -jnp.inf), axis=-1)
    out = jnp.einsum("hqk,khd->qhd", weights, v)
    return jnp.where((position < query_start_loc[-1])[:, None, None], out, 0).astype(q.dtype)


@pytest.mark.parametrize("env,capability,default,dtype,expected", [
    (None, 9.0, True, jnp.bfloat16, True),
    (None, 9.0, True, (jnp.float32, jnp.bfloat16), True),  # the engine's float32 queries, cast to the cache's
    (None, 9.0, False, jnp.bfloat16, False),
    (None, 8.0, True, jnp.bfloat16, False),  # cuDNN's packed layout needs a Hopper
    (None, None, True, jnp.bfloat16, False),
    ("1", None, False, jnp.bfloat16, True),
    ("0", 9.0, True, jnp.bfloat16, False),
    ("1", 9.0, True, jnp.float32, False),  # cuDNN's flash attention is 16-bit: a float32 cache stays paged
    ("1", 9.0, True, (jnp.float16, jnp.bfloat16), False),
])
def test_when_gpus_take_cudnn_for_fresh_prompts(monkeypatch, env, capability, default, dtype, expected):
    """``dtype``: q's and the cache's, or (q's, the cache's)."""
    if env is None:
        monkeypatch.delenv("PALLAS_PAGED_CUDNN_PROMPTS", raising=False)
    else:
        monkeypatch.setenv("PALLAS_PAGED_CUDNN_PROMPTS", env)
    monkeypatch.setattr(pallas_paged, "cuda_capability", lambda: capability)
    monkeypatch.setattr(tiling, "HOPPER", tiling.HopperTiling(**{**tiling.HOPPER.__dict__, "cudnn_prompts": default}))
    q_dtype, cache_dtype = dtype if isinstance(dtype, tuple) else (dtype, dtype)
    q, cache = jnp.zeros((4, 8, 128), q_dtype), jnp.zeros((2, 4, 16, 128), cache_dtype)
    assert pallas_paged.cudnn_prompts(q, cache) == expected


def test_a_bad_setting_says_what_is_allowed(monkeypatch):
    monkeypatch.setenv("PALLAS_PAGED_CUDNN_PROMPTS", "yes")
    with pytest.raises(ValueError, match="PALLAS_PAGED_CUDNN_PROMPTS must be 0 or 1"):
        pallas_paged.cudnn_prompts(jnp.zeros((4, 8, 128), jnp.bfloat16), jnp.zeros((2, 4, 16, 128), jnp.bfloat16))


def test_gqa_keys_get_a_head_per_query_head_where_jax_needs_it(monkeypatch):
    """JAX before 0.12 strides packed K and V by the query heads (prompts.KV_OFFSETS_BY_QUERY_HEADS):
    there cuDNN must be given K and V repeated to every query head, in GQA order."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    seen = {}

    def record(q, k, v, **options):
        seen.update(k=k, v=v)
        return jnp.zeros_like(q)

    monkeypatch.setattr(cudnn, "dot_product_attention", record)
    k = jnp.arange(2 * 2 * 4, dtype=jnp.float32).reshape(2, 2, 4).astype(jnp.bfloat16)  # [tokens, kv_heads, d]
    prompts.cudnn_attention(jnp.zeros((2, 6, 4), jnp.bfloat16), k, k, jnp.array([0, 2], jnp.int32), scale=0.5)
    if prompts.KV_OFFSETS_BY_QUERY_HEADS:
        np.testing.assert_array_equal(seen["k"][0], jnp.repeat(k, 3, axis=1))
    else:
        np.testing.assert_array_equal(seen["k"][0], k)
