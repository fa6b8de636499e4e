"""Writing, copying and swapping KV blocks."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_paged
from pallas_paged import reference

SHAPE = (3, 12, 4, 8)  # kv_heads, blocks, block_size, head_dim


def random_caches(seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(SHAPE), dtype), jnp.asarray(rng.standard_normal(SHAPE), dtype))


def test_write_kv_skips_padding_slots():
    k_cache, v_cache = random_caches()
    rng = np.random.default_rng(1)
    k = jnp.asarray(rng.standard_normal((6, 3, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((6, 3, 8)), jnp.float32)
    slots = jnp.asarray([5, -1, 0, 47, -1, 20], jnp.int32)  # 47 = last slot of the last block
    actual = jax.jit(pallas_paged.write_kv)(k_cache, v_cache, k, v, slots)
    expected = reference.write_kv(k_cache, v_cache, k, v, slots)
    for a, e in zip(actual, expected):
        np.testing.assert_array_equal(a, e)
    untouched = np.ones(48, bool)
    untouched[[5, 0, 47, 20]] = False
    flat = np.asarray(actual[0]).reshape(3, 48, 8)
    np.testing.assert_array_equal(flat[:, untouched], np.asarray(k_cache).reshape(3, 48, 8)[:, untouched])


def test_write_kv_casts_to_cache_dtype():
    k_cache, v_cache = random_caches(dtype=jnp.bfloat16)
    k = jnp.ones((1, 3, 8), jnp.float32)
    out_k, _ = pallas_paged.write_kv(k_cache, v_cache, k, k, jnp.asarray([9], jnp.int32))
    assert out_k.dtype == jnp.bfloat16
    assert (np.asarray(out_k[:, 2, 1], np.float32) == 1).all()


def test_write_kv_updates_donated_cache_in_place():
    k_cache, v_cache = random_caches()
    pointers = (k_cache.unsafe_buffer_pointer(), v_cache.unsafe_buffer_pointer())
    step = jax.jit(pallas_paged.write_kv, donate_argnums=(0, 1))
    k = jnp.zeros((2, 3, 8), jnp.float32)
    out = step(k_cache, v_cache, k, k, jnp.asarray([1, 2], jnp.int32))
    assert (out[0].unsafe_buffer_pointer(), out[1].unsafe_buffer_pointer()) == pointers


def _largest_copy(compiled) -> int:
    """Elements in the largest array a compiled program copies."""
    shapes = re.findall(r"= \w+\[([\d,]*)\]\S* copy\(", compiled.as_text())
    return max((math.prod(int(d) for d in shape.split(",") if d) for shape in shapes), default=0)


@pytest.mark.parametrize("slot", [9, -1])
def test_one_token_write_kv_neither_copies_the_cache_nor_writes_padding(slot):
    """XLA turns a one-row scatter into a dynamic-update-slice and then copies the whole
    cache around it; a decode step of one sequence must not pay for that."""
    k_cache, v_cache = random_caches()
    k = jnp.full((1, 3, 8), 7.0, jnp.float32)
    slots = jnp.asarray([slot], jnp.int32)
    step = jax.jit(pallas_paged.write_kv, donate_argnums=(0, 1))
    compiled = step.lower(k_cache, v_cache, k, k, slots).compile(compiler_options=pallas_paged.compiler_options("cpu"))
    assert _largest_copy(compiled) < k_cache.size
    expected = reference.write_kv(k_cache, v_cache, k, k, slots)
    for actual, want in zip(compiled(k_cache, v_cache, k, k, slots), expected):
        np.testing.assert_array_equal(actual, want)


def test_copy_blocks_many_pairs_in_one_call():
    k_cache, v_cache = random_caches()
    src = jnp.asarray([0, 1, 2, 3, 0, -1, -1, 5], jnp.int32)
    dst = jnp.asarray([7, 8, 9, 10, 11, -1, 12, -1], jnp.int32)  # block 0 copied twice; the last three are padding
    actual = jax.jit(pallas_paged.copy_blocks)(k_cache, v_cache, src, dst)
    expected = reference.copy_blocks(k_cache, v_cache, src, dst)
    for a, e in zip(actual, expected):
        np.testing.assert_array_equal(a, e)


def test_swap_out_lands_in_pinned_host_memory_and_round_trips():
    k_cache, v_cache = random_caches()
    host_k, host_v = pallas_paged.swap_out(k_cache, v_cache, jnp.asarray([4, 1, 6], jnp.int32))
    assert host_k.sharding.memory_kind == "pinned_host"
    assert host_k.shape == (3, 3, 4, 8)
    expected = reference.swap_out(k_cache, v_cache, [4, 1, 6])
    np.testing.assert_array_equal(np.asarray(host_k), expected[0])
    np.testing.assert_array_equal(np.asarray(host_v), expected[1])

    target = jnp.zeros(SHAPE), jnp.zeros(SHAPE)
    back_k, back_v = pallas_paged.swap_in(*target, host_k, host_v, jnp.asarray([0, 2, 11], jnp.int32))
    expected = reference.swap_in(np.zeros(SHAPE), np.zeros(SHAPE), host_k, host_v, [0, 2, 11])
    np.testing.assert_array_equal(back_k, expected[0])
    np.testing.assert_array_equal(back_v, expected[1])
    np.testing.assert_array_equal(back_k[:, 2], k_cache[:, 1])


@pytest.mark.parametrize("field,value", [("num_blocks", 0), ("head_dim", -1)])
def test_cache_spec_rejects_bad_sizes(field, value):
    sizes = dict(num_blocks=4, block_size=16, num_kv_heads=2, head_dim=64, num_layers=2)
    sizes[field] = value
    with pytest.raises(ValueError, match=f"KVCacheSpec.{field} must be >= 1"):
        pallas_paged.KVCacheSpec(**sizes)


def test_cache_spec_allocates_every_layer():
    spec = pallas_paged.KVCacheSpec(num_blocks=5, block_size=16, num_kv_heads=3, head_dim=64, num_layers=2)
    caches = spec.allocate()
    assert len(caches) == 2
    assert all(c.shape == (3, 5, 16, 64) and not c.any() for layer in caches for c in layer)
    assert spec.bytes_per_block == 2 * 2 * 3 * 16 * 64 * 4


@pytest.mark.parametrize("op", ["write_kv", "copy_blocks"])
def test_16_bit_caches_are_updated_in_place_on_cpu(op):
    """Compiled with :func:`pallas_paged.compiler_options`, with the caches donated, writing a
    few slots or copying a few blocks of a bfloat16 cache needs no scratch the size of a cache
    (XLA:CPU's default passes convert and copy the whole cache on every call)."""
    caches = [jnp.zeros((3, 512, 16, 64), jnp.bfloat16)] * 2
    if op == "write_kv":
        new = jnp.zeros((8, 3, 64), jnp.bfloat16)
        fn, args = pallas_paged.write_kv, (*caches, new, new, jnp.arange(8, dtype=jnp.int32))
    else:
        src, dst = jnp.arange(4, dtype=jnp.int32), jnp.arange(4, 8, dtype=jnp.int32)
        fn, args = pallas_paged.copy_blocks, (*caches, src, dst)
    lowered = jax.jit(fn, donate_argnums=(0, 1)).lower(*args)
    compiled = lowered.compile(compiler_options=pallas_paged.compiler_options("cpu"))
    assert compiled.memory_analysis().temp_size_in_bytes < caches[0].nbytes
