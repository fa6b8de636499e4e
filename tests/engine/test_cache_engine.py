"""The cache engine carries out the scheduler's block moves: swaps and copy-on-write copies."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_paged
from engine.worker.cache_engine import CacheEngine

SPEC = pallas_paged.KVCacheSpec(num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8, num_layers=2)


def filled_cache_engine() -> CacheEngine:
    cache = CacheEngine(SPEC, num_host_blocks=4)
    rng = np.random.default_rng(0)
    cache.kv_caches = [tuple(jnp.asarray(rng.standard_normal(SPEC.layer_shape), jnp.float32) for _ in range(2))
                       for _ in range(SPEC.num_layers)]
    return cache


def device_arrays(cache: CacheEngine) -> list[np.ndarray]:
    return [np.asarray(array) for layer in cache.kv_caches for array in layer]


@pytest.mark.parametrize("num_blocks", [1, 2, 3])
def test_blocks_swapped_out_and_in_come_back_unchanged(num_blocks):
    """One block is the edge case: single-row updates take a different path in XLA."""
    cache = filled_cache_engine()
    before = device_arrays(cache)
    device_blocks, host_blocks, new_blocks = [0, 3, 6][:num_blocks], [3, 0, 2][:num_blocks], [7, 1, 4][:num_blocks]
    cache.apply(swap_out=list(zip(device_blocks, host_blocks)))
    cache.apply(swap_in=list(zip(host_blocks, new_blocks)))
    for old, new in zip(before, device_arrays(cache)):
        np.testing.assert_array_equal(new[:, new_blocks], old[:, device_blocks])


@pytest.mark.parametrize("num_pairs", [1, 2])
def test_copy_on_write_copies_only_the_named_blocks(num_pairs):
    cache = filled_cache_engine()
    before = device_arrays(cache)
    pairs = [(2, 5), (0, 7)][:num_pairs]
    cache.apply(copy=pairs)
    untouched = [block for block in range(SPEC.num_blocks) if block not in {dst for _, dst in pairs}]
    for old, new in zip(before, device_arrays(cache)):
        for src, dst in pairs:
            np.testing.assert_array_equal(new[:, dst], old[:, src])
        np.testing.assert_array_equal(new[:, untouched], old[:, untouched])
