"""Whole fresh prompts through cuDNN on Hopper (:mod:`pallas_paged.prompts`): when a step
qualifies, the packed layout cuDNN is given, and when GPUs choose it. cuDNN itself runs only
on a GPU (``make test-gpu``); ``make test-accel`` compiles it for an H100."""

from __future__ import annotations

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


def test_new_kv_changes_nothing_off_a_gpu():
    """A CPU ignores the step's own K and V: the same kernel, the same output."""
    seqs = [(20, 20), (7, 7)]
    s = make(seqs, q_heads=4, kv_heads=2, head_dim=64, block_size=16, dtype=jnp.bfloat16)
    new_kv = (jnp.zeros((27, 2, 64), jnp.bfloat16),) * 2  # wrong on purpose: unused here
    got = pallas_paged.ragged_paged_attention(*s.ragged_args, new_kv=new_kv)
    assert_close(got, reference.ragged_paged_attention(*s.ragged_args), jnp.bfloat16)


@pytest.mark.parametrize("env,capability,default,dtype,expected", [
    (None, 9.0, True, jnp.bfloat16, True),
    (None, 9.0, False, jnp.bfloat16, False),
    (None, 8.0, True, jnp.bfloat16, False),  # cuDNN's packed layout needs a Hopper
    (None, None, True, jnp.bfloat16, False),
    ("1", None, False, jnp.bfloat16, True),
    ("0", 9.0, True, jnp.bfloat16, False),
    ("1", 9.0, True, jnp.float32, False),  # cuDNN's flash attention is 16-bit
])
def test_when_gpus_take_cudnn_for_fresh_prompts(monkeypatch, env, capability, default, dtype, expected):
    if env is None:
        monkeypatch.delenv("PALLAS_PAGED_CUDNN_PROMPTS", raising=False)
    else:
        monkeypatch.setenv("PALLAS_PAGED_CUDNN_PROMPTS", env)
    monkeypatch.setattr(pallas_paged, "cuda_capability", lambda: capability)
    monkeypatch.setattr(tiling, "HOPPER", tiling.HopperTiling(**{**tiling.HOPPER.__dict__, "cudnn_prompts": default}))
    assert pallas_paged.cudnn_prompts(jnp.zeros((4, 8, 128), dtype)) == expected


def test_a_bad_setting_says_what_is_allowed(monkeypatch):
    monkeypatch.setenv("PALLAS_PAGED_CUDNN_PROMPTS", "yes")
    with pytest.raises(ValueError, match="PALLAS_PAGED_CUDNN_PROMPTS must be 0 or 1"):
        pallas_paged.cudnn_prompts(jnp.zeros((4, 8, 128), jnp.bfloat16))
