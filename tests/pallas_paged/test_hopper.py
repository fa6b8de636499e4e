"""The Mosaic GPU kernels for Hopper (:mod:`pallas_paged.hopper`: decode and ragged) in Mosaic
GPU's interpret mode against the oracle, and which GPUs run them.

Interpret mode simulates shared memory, the TMA copies through the block table and the
barriers of the ring of tiles; its wgmma takes neither a transposed operand nor one in
registers, so there the two products are XLA's (``hopper._Layouts``). The wgmma
products themselves are checked where they lower (``test_lowering``) and, compiled, on a GPU
(``make test-gpu``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_paged
from pallas_paged import hopper, reference, tiling
from tests.pallas_paged.scenarios import assert_close, decode_seqs, make

CONTEXTS = [1, 63, 64, 65, 0, 200]  # within a step, a step exactly, one key over, a padding row, several steps


@pytest.mark.parametrize("heads,head_dim,block_size,splits,dtype", [
    pytest.param((8, 2), 64, 16, 1, jnp.bfloat16, id="gqa4-bf16"),
    pytest.param((9, 3), 64, 16, 3, jnp.bfloat16, id="gqa3-split3"),
    pytest.param((32, 8), 128, 32, 2, jnp.float16, id="gqa4-d128-block32-f16-split2"),
    pytest.param((4, 4), 128, 64, 1, jnp.bfloat16, id="mha-block64"),
])
def test_hopper_decode_matches_oracle_in_interpret_mode(heads, head_dim, block_size, splits, dtype):
    """Stale and unreferenced slots hold NaN (``make``): a read of one, or a NaN value row not
    zeroed in the last tile, shows in the output."""
    s = make(decode_seqs(CONTEXTS), q_heads=heads[0], kv_heads=heads[1], head_dim=head_dim, block_size=block_size,
             dtype=dtype, seed=head_dim + splits)
    actual = hopper.paged_attention(*s.decode_args, scale=head_dim**-0.5, keys_per_step=64, stages=2,
                                           splits=splits, interpret=True)
    assert_close(actual, reference.paged_attention(*s.decode_args), jnp.bfloat16)
    assert not actual[CONTEXTS.index(0)].astype(jnp.float32).any(), "a padding row must come out as zeros"


def test_more_splits_than_a_sequence_has_steps():
    """Splits past a short sequence's last step see no key and must not change its output."""
    s = make(decode_seqs([10, 130]), q_heads=4, kv_heads=2, head_dim=64, block_size=16, dtype=jnp.bfloat16)
    actual = hopper.paged_attention(*s.decode_args, scale=0.125, keys_per_step=64, stages=2, splits=4,
                                    interpret=True)
    assert_close(actual, reference.paged_attention(*s.decode_args), jnp.bfloat16)


@pytest.mark.parametrize("q_dtype,head_dim", [(jnp.bfloat16, 64), (jnp.float32, 64), (jnp.float32, 128)],
                         ids=["bf16-q", "f32-q", "f32-q-head128"])
def test_public_op_with_the_hopper_tiling_matches_oracle(q_dtype, head_dim):
    """The knobs and splits `pallas_paged` gives the kernel on a GPU (tiling.HOPPER); the
    engine's float32 queries (not exact in bfloat16) over a bfloat16 cache come back in float32."""
    s = make(decode_seqs([90, 33]), q_heads=8, kv_heads=2, head_dim=head_dim, block_size=16, dtype=jnp.bfloat16)
    q = s.q.astype(q_dtype)
    if q_dtype == jnp.float32:
        q = q + 1e-3 * jax.random.normal(jax.random.key(0), q.shape)
    args = (q, *s.decode_args[1:])
    actual = pallas_paged.hopper_paged_attention(*args, scale=head_dim**-0.5, interpret=True)
    assert actual.dtype == q_dtype
    assert_close(actual, reference.paged_attention(*args), jnp.bfloat16)


def test_a_float16_cache_takes_the_query_scaled_before_it_is_rounded():
    """A float32 query past float16's range whose scaled value is within it: the kernels get
    the Triton kernels' operand (scaled in float32, then rounded), not an infinity."""
    s = make(decode_seqs([40, 7]), q_heads=4, kv_heads=2, head_dim=64, block_size=16, dtype=jnp.float16)
    q = s.q.astype(jnp.float32).at[0, 0, 0].set(1e5)
    args = (q, *s.decode_args[1:])
    actual = pallas_paged.hopper_paged_attention(*args, scale=0.125, interpret=True)
    assert np.isfinite(np.asarray(actual)).all()
    assert_close(actual, reference.paged_attention(*args), jnp.bfloat16)  # 16-bit operands


@pytest.mark.parametrize("heads,block_size", [((8, 2), 16), ((9, 3), 16), ((4, 4), 32)],
                         ids=["gqa4", "gqa3-padded-to-4", "mha-block32"])
def test_hopper_ragged_matches_oracle_in_interpret_mode(heads, block_size):
    """Whole prompts, a chunk after a cached prefix, decodes, an idle sequence and padding rows;
    a tile holds 64 // 4 tokens (GQA 4 and 3) or 64 (MHA)."""
    seqs = [(1, 1), (45, 45), (4 * block_size, 4 * block_size), (300, 60), (3 * block_size + 5, 1),
            (2 * block_size, 0), (130, 17)]
    s = make(seqs, q_heads=heads[0], kv_heads=heads[1], head_dim=64, block_size=block_size, dtype=jnp.bfloat16,
             padding_tokens=5, seed=block_size)
    actual = pallas_paged.hopper_ragged_paged_attention(*s.ragged_args, scale=0.125, interpret=True)
    assert_close(actual, reference.ragged_paged_attention(*s.ragged_args, scale=0.125), jnp.bfloat16)
    assert not actual[-5:].astype(jnp.float32).any(), "padding rows must come out as zeros"
    if heads == (8, 2):  # the engine's float32 queries
        args = (s.q.astype(jnp.float32), *s.ragged_args[1:])
        actual = pallas_paged.hopper_ragged_paged_attention(*args, scale=0.125, interpret=True)
        assert actual.dtype == jnp.float32
        assert_close(actual, reference.ragged_paged_attention(*args, scale=0.125), jnp.bfloat16)


def _kernel_for(dtype=jnp.bfloat16, heads=(32, 8), head_dim=128, block_size=16, q_dtype=None):
    q = jax.ShapeDtypeStruct((4, heads[0], head_dim), q_dtype or dtype)
    cache = jax.ShapeDtypeStruct((heads[1], 64, block_size, head_dim), dtype)
    return pallas_paged.gpu_kernel(q, cache)


@pytest.mark.parametrize("capability,enabled,expected", [
    (9.0, True, "mosaic"), (10.0, True, "triton"), (8.9, True, "triton"), (9.0, False, "triton"),  # 10: Blackwell
    (None, True, "triton"),
])
def test_gpu_generation_chooses_the_kernels(monkeypatch, capability, enabled, expected):
    monkeypatch.delenv("PALLAS_PAGED_GPU_ATTENTION", raising=False)
    monkeypatch.setattr(pallas_paged, "cuda_capability", lambda: capability)
    monkeypatch.setattr(tiling, "HOPPER", tiling.HopperTiling(**{**tiling.HOPPER.__dict__, "enabled": enabled}))
    assert _kernel_for() == expected


def test_the_environment_chooses_and_shapes_mosaic_cannot_take_stay_on_triton(monkeypatch):
    monkeypatch.setattr(pallas_paged, "cuda_capability", lambda: 9.0)
    monkeypatch.setenv("PALLAS_PAGED_GPU_ATTENTION", "triton")
    assert _kernel_for() == "triton"
    monkeypatch.setenv("PALLAS_PAGED_GPU_ATTENTION", "mosaic")
    assert _kernel_for() == "mosaic"
    assert _kernel_for(q_dtype=jnp.float32) == "mosaic"  # the engine's queries over a bfloat16 cache
    assert [_kernel_for(dtype=jnp.float32), _kernel_for(q_dtype=jnp.float16), _kernel_for(head_dim=32),
            _kernel_for(head_dim=256), _kernel_for(heads=(8, 8), block_size=48)] == ["triton"] * 5
    monkeypatch.setenv("PALLAS_PAGED_GPU_ATTENTION", "hopper")
    with pytest.raises(ValueError, match="PALLAS_PAGED_GPU_ATTENTION must be auto, mosaic or triton"):
        _kernel_for()
