"""The kernels as the GPU compiles them (Triton; Mosaic GPU's on a Hopper), against the
dense oracle: float32 at the oracle's tight tolerance (full-precision products, not TF32),
16-bit at bfloat16's; and the cache and swap operations, exact."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_paged
from engine.worker.cache_engine import CacheEngine
from pallas_paged import reference
from tests.gpu.conftest import gpu_only, hopper_or_skip
from tests.pallas_paged.scenarios import assert_close, decode_seqs, make

TRITON = "__gpu$xla.gpu.triton"
DTYPES = pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
HEADS = pytest.mark.parametrize("heads", [(8, 8), (9, 3), (32, 8)], ids=["mha", "gqa9-3", "gqa32-8"])


@DTYPES
@HEADS
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_matches_oracle(dtype, heads, head_dim, block_size):
    s = make(decode_seqs([1, block_size, 5 * block_size + 1, 1037, 77]), q_heads=heads[0], kv_heads=heads[1],
             head_dim=head_dim, block_size=block_size, dtype=dtype, seed=block_size + head_dim)
    assert_close(jax.jit(pallas_paged.paged_attention)(*s.decode_args), reference.paged_attention(*s.decode_args),
                 dtype)


@DTYPES
@HEADS
@pytest.mark.parametrize("block_size", [8, 16])
def test_ragged_matches_oracle(dtype, heads, block_size):
    """Whole prompts, a chunk after a cached prefix, decodes, an idle sequence and padding."""
    seqs = [(1, 1), (45, 45), (4 * block_size, 4 * block_size), (1100, 60), (3 * block_size + 5, 1),
            (2 * block_size, 0), (250, 17)]
    s = make(seqs, q_heads=heads[0], kv_heads=heads[1], head_dim=64, block_size=block_size, dtype=dtype,
             padding_tokens=5, seed=block_size)
    actual = jax.jit(pallas_paged.ragged_paged_attention)(*s.ragged_args)
    assert_close(actual, reference.ragged_paged_attention(*s.ragged_args), dtype)
    assert not np.asarray(actual[-5:].astype(jnp.float32)).any(), "padding rows must come out as zeros"


# A few cases each (a device check has minutes): GQA 4 and 3 (padded), MHA, both head sizes, both
# dtypes, and the engine's float32 queries over a bfloat16 cache.
HOPPER_CASES = pytest.mark.parametrize(
    "dtype,heads,head_dim,q_dtype", [(jnp.bfloat16, (32, 8), 128, None), (jnp.bfloat16, (9, 3), 64, None),
                                     (jnp.float16, (8, 8), 128, None), (jnp.bfloat16, (32, 8), 64, jnp.float32)],
    ids=["gqa4", "gqa3", "mha-f16", "gqa4-f32-q"])


def _queries(args, q_dtype):
    """``args`` (an op's arrays, q first) with q in ``q_dtype`` (None: as made), not exact in
    the cache's dtype."""
    if q_dtype is None:
        return args
    q = args[0].astype(q_dtype) + 1e-3 * jax.random.normal(jax.random.key(1), args[0].shape, q_dtype)
    return (q, *args[1:])


@HOPPER_CASES
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("many", [False, True], ids=["split", "one-program-each"])
def test_hopper_decode_compiled_matches_oracle(dtype, heads, head_dim, q_dtype, block_size, many):
    """The Mosaic GPU kernel (wgmma, TMA) compiled, whether or not ``tiling.HOPPER`` is enabled:
    a few sequences split their keys over programs; 300 fill the GPU one program each."""
    hopper_or_skip()
    contexts = list(np.random.default_rng(head_dim).integers(1, 700, 300)) if many else [1, 64, 5 * block_size + 1,
                                                                                          1037, 77]
    s = make(decode_seqs(contexts), q_heads=heads[0], kv_heads=heads[1], head_dim=head_dim, block_size=block_size,
             dtype=dtype, seed=block_size + head_dim)
    args = _queries(s.decode_args, q_dtype)
    hopper = jax.jit(functools.partial(pallas_paged.hopper_paged_attention, scale=head_dim**-0.5))
    assert "mosaic_gpu" in hopper.lower(*args).as_text()
    assert_close(hopper(*args), reference.paged_attention(*args), jnp.bfloat16)


@HOPPER_CASES
def test_hopper_ragged_compiled_matches_oracle(dtype, heads, head_dim, q_dtype):
    """The Mosaic GPU ragged kernel compiled: whole prompts, a chunk after a cached prefix,
    decodes, an idle sequence and padding rows."""
    hopper_or_skip()
    seqs = [(1, 1), (45, 45), (64, 64), (1100, 60), (53, 1), (32, 0), (250, 17), (700, 700)]
    s = make(seqs, q_heads=heads[0], kv_heads=heads[1], head_dim=head_dim, block_size=16, dtype=dtype,
             padding_tokens=5, seed=head_dim)
    args = _queries(s.ragged_args, q_dtype)
    hopper = jax.jit(functools.partial(pallas_paged.hopper_ragged_paged_attention, scale=head_dim**-0.5))
    assert "mosaic_gpu" in hopper.lower(*args).as_text()
    actual = hopper(*args)
    assert_close(actual, reference.ragged_paged_attention(*args), jnp.bfloat16)
    assert not np.asarray(actual[-5:].astype(jnp.float32)).any(), "padding rows must come out as zeros"


@HOPPER_CASES
@pytest.mark.parametrize("fresh", [True, False], ids=["whole-prompts:cudnn", "cached-prefix:paged"])
def test_cudnn_for_fresh_prompts_matches_oracle(monkeypatch, dtype, heads, head_dim, q_dtype, fresh):
    """With PALLAS_PAGED_CUDNN_PROMPTS=1, a step of whole prompts (and padding) runs cuDNN's
    flash attention over the step's own K and V; a step with a cached prefix, the paged kernel.
    Both as the oracle, each given inputs only its own path can use: the fresh step a cache of
    NaN, the other zeros for its own K and V."""
    hopper_or_skip()
    monkeypatch.setenv("PALLAS_PAGED_CUDNN_PROMPTS", "1")
    seqs = [(45, 45), (64, 64), (700, 700), (1, 1), (0, 0)] if fresh else [(45, 45), (300, 60), (1, 1)]
    s = make(seqs, q_heads=heads[0], kv_heads=heads[1], head_dim=head_dim, block_size=16, dtype=dtype,
             padding_tokens=5)
    args = _queries(s.ragged_args, q_dtype)
    expected = reference.ragged_paged_attention(*args)
    q, k_cache, v_cache, *rest = args
    if fresh:
        k_cache, v_cache, new_kv = jnp.full_like(k_cache, jnp.nan), jnp.full_like(v_cache, jnp.nan), s.new_kv()
    else:
        new_kv = tuple(jnp.zeros_like(x) for x in s.new_kv())
    new_kv = tuple(x.astype(q.dtype) for x in new_kv)  # the engine's, before the cache rounds them
    step = jax.jit(lambda *arrays: pallas_paged.ragged_paged_attention(*arrays[:6], new_kv=arrays[6:]))
    actual = step(q, k_cache, v_cache, *rest, *new_kv)
    assert_close(actual, expected, jnp.bfloat16)
    assert not np.asarray(actual[-5:].astype(jnp.float32)).any(), "padding rows must come out as zeros"


@gpu_only
@pytest.mark.parametrize("op", ["decode", "ragged"])
def test_the_gpu_runs_the_triton_kernels(op):
    s = make(decode_seqs([20, 3]), q_heads=4, kv_heads=2, head_dim=64, block_size=8)
    fn, args = ((pallas_paged.paged_attention, s.decode_args) if op == "decode"
                else (pallas_paged.ragged_paged_attention, s.ragged_args))
    with pallas_paged.lowering.quietly():
        assert TRITON in jax.jit(fn).lower(*args).as_text()


@DTYPES
def test_write_copy_and_swap_blocks_are_exact(dtype):
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal((2, 8, 4, 64)), dtype) for _ in range(2))
    new_k, new_v = (jnp.asarray(rng.standard_normal((3, 2, 64)), dtype) for _ in range(2))
    k, v = jax.jit(pallas_paged.write_kv)(k, v, new_k, new_v, jnp.array([5, -1, 30], jnp.int32))
    np.testing.assert_array_equal(np.asarray(k[:, 1, 1]), np.asarray(new_k[0]))
    np.testing.assert_array_equal(np.asarray(v[:, 7, 2]), np.asarray(new_v[2]))
    k, v = jax.jit(pallas_paged.copy_blocks)(k, v, jnp.array([1, 7], jnp.int32), jnp.array([3, 0], jnp.int32))
    np.testing.assert_array_equal(np.asarray(k[:, 3]), np.asarray(k[:, 1]))
    host_k, host_v = pallas_paged.swap_out(k, v, jnp.array([3, 0], jnp.int32))
    assert host_k.sharding.memory_kind == "pinned_host"
    back_k, _ = pallas_paged.swap_in(jnp.zeros_like(k), jnp.zeros_like(v), host_k, host_v, jnp.array([6, 2]))
    np.testing.assert_array_equal(np.asarray(back_k[:, [6, 2]]), np.asarray(k[:, [3, 0]]))


@DTYPES
def test_the_cache_engine_swaps_blocks_out_and_back_exactly(dtype):
    spec = pallas_paged.KVCacheSpec(num_blocks=8, block_size=4, num_kv_heads=2, head_dim=64, num_layers=2, dtype=dtype)
    cache = CacheEngine(spec, num_host_blocks=4)
    rng = np.random.default_rng(1)
    cache.kv_caches = [tuple(jnp.asarray(rng.standard_normal(spec.layer_shape), dtype) for _ in range(2))
                       for _ in range(spec.num_layers)]
    before = [np.asarray(a) for layer in cache.kv_caches for a in layer]
    cache.apply(swap_out=[(0, 3), (6, 1)])
    cache.apply(swap_in=[(3, 7), (1, 2)], copy=[(7, 5)])
    for old, new in zip(before, [np.asarray(a) for layer in cache.kv_caches for a in layer]):
        np.testing.assert_array_equal(new[:, [7, 2, 5]], old[:, [0, 6, 0]])
