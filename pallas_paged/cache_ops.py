"""Writing, copying and swapping whole KV blocks (plain XLA scatters and gathers).

These move memory rather than compute, so XLA's scatter and gather are already
the right tool on every platform; under ``jit`` with the caches donated they
update the cache in place (on CPU, compile 16-bit caches' programs with
:func:`pallas_paged.compiler_options`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_paged.xla_options import compiler_options


def _set(cache, ids, values):
    """``cache.at[:, ids].set(values, mode="drop")``: ids past the end of axis 1 write nothing;
    in place under ``jit`` with the cache donated (for 16-bit caches on CPU, with
    :func:`pallas_paged.compiler_options`).

    A single id is padded with a dropped second one: XLA rewrites a one-row scatter as a
    dynamic-update-slice, and on CPU then copies the whole cache around it (about 70 us
    per call here, whatever the cache's size, so 4 ms of every one-sequence decode step).
    """
    if ids.shape[0] == 1:
        ids = jnp.pad(ids, (0, 1), constant_values=cache.shape[1])
        values = jnp.pad(values, [(0, 0), (0, 1)] + [(0, 0)] * (values.ndim - 2))
    return cache.at[:, ids].set(values.astype(cache.dtype), mode="drop")


def _drop_negative(index, size):
    """Map padding entries (< 0) past the end, where ``mode="drop"`` ignores them."""
    return jnp.where(index < 0, size, index)


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """Store one step's keys and values in their slots.

    k_cache, v_cache: [kv_heads, blocks, block_size, d]; k, v: [tokens,
    kv_heads, d]; slot_mapping: int32[tokens], ``block * block_size + offset``,
    -1 for padding tokens (nothing written). Returns the updated caches.
    """
    kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    slots = _drop_negative(slot_mapping, num_blocks * block_size)

    def write(cache, new):
        flat = cache.reshape(kv_heads, num_blocks * block_size, head_dim)
        return _set(flat, slots, new.swapaxes(0, 1)).reshape(cache.shape)

    return write(k_cache, k), write(v_cache, v)


def copy_blocks(k_cache, v_cache, src, dst):
    """Copy-on-write: block ``src[i]`` → block ``dst[i]`` for every pair, in one scatter.

    src, dst: int32[pairs]; pairs with a negative entry are padding. No ``dst``
    may also appear in ``src``. Returns the updated caches.
    """
    num_blocks = k_cache.shape[1]
    dst = _drop_negative(jnp.where(src < 0, -1, dst), num_blocks)
    src = jnp.maximum(src, 0)

    def copy(cache):
        return _set(cache, dst, cache[:, src])

    return copy(k_cache), copy(v_cache)


def gather_blocks(cache, block_ids):
    """cache: [kv_heads, blocks, block_size, d]; block_ids: int32[n] → [kv_heads, n, block_size, d]."""
    return cache[:, block_ids]


def scatter_blocks(cache, blocks, block_ids):
    """Write ``blocks[:, i]`` into block ``block_ids[i]``; ids past the last block are padding
    and write nothing (negative ids would wrap around). Returns the cache."""
    return _set(cache, block_ids, blocks)


def host_sharding(device: jax.Device | None = None) -> jax.sharding.Sharding:
    """Where swapped-out blocks live: the device's pinned host memory."""
    device = device or jax.devices()[0]
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


def _device_of(array) -> jax.Device:
    return next(iter(array.devices()))


def swap_out(k_cache, v_cache, block_ids):
    """Copy whole blocks to host memory.

    block_ids: int32[n] device blocks. Returns ``(host_k, host_v)``, each
    ``[kv_heads, n, block_size, d]`` in the ``pinned_host`` memory kind.
    """
    block_ids = jnp.asarray(block_ids)
    return jax.device_put((gather_blocks(k_cache, block_ids), gather_blocks(v_cache, block_ids)),
                          host_sharding(_device_of(k_cache)))


def swap_in(k_cache, v_cache, host_k, host_v, block_ids):
    """Copy whole blocks from host memory back into the caches.

    host_k, host_v: [kv_heads, n, block_size, d] (any memory kind); block_ids:
    int32[n] device blocks to fill. The input caches are donated (updated in
    place); use the returned ones.
    """
    device = jax.sharding.SingleDeviceSharding(_device_of(k_cache))
    host_k, host_v = jax.device_put((host_k, host_v), device)
    block_ids = _drop_negative(jnp.asarray(block_ids), k_cache.shape[1])
    return _scatter_both()(k_cache, v_cache, host_k, host_v, block_ids)


@functools.cache
def _scatter_both():
    """Both caches' scatter, compiled with :func:`compiler_options` (in place for 16-bit caches)."""

    def scatter(k_cache, v_cache, k_blocks, v_blocks, block_ids):
        return scatter_blocks(k_cache, k_blocks, block_ids), scatter_blocks(v_cache, v_blocks, block_ids)

    return jax.jit(scatter, donate_argnums=(0, 1), compiler_options=compiler_options(jax.default_backend()))
