"""The device KV caches and the host swap space, and the block operations of each step.

The scheduler decides which blocks move; this module only carries it out, one jitted call
per kind of operation covering every layer, with the device caches donated so they are
updated in place. Block-id lists are padded to powers of two with an id past the end of
the pool, which gathers clamp and scatters skip, so a handful of compiled shapes serve
every step.

The swap space is one NumPy array in host memory. A swap-out gathers the blocks of every
layer on the device in one program and copies them to the host in one transfer; a swap-in
sends the blocks back in one transfer and scatters them in one program. Only ``jit``,
``device_put`` and ``np.asarray`` take part, so the path is the same on every JAX version
and platform (the experimental ``compute_on("device_host")`` it replaced changed its
signature in JAX 0.11, and swapping failed there).
"""

from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_paged
from engine.worker import huge_pages
from pallas_paged.cache_ops import gather_blocks, scatter_blocks

log = logging.getLogger(__name__)


def kv_cache_spec(model, block_size: int, dtype, num_blocks: int = 1) -> pallas_paged.KVCacheSpec:
    """The device KV cache of ``num_blocks`` blocks of ``block_size`` tokens in ``dtype`` for
    ``model`` (a :class:`models.ModelConfig`; how many blocks: :mod:`engine.worker.kv_cache_size`)."""
    return pallas_paged.KVCacheSpec(num_blocks, block_size, model.num_kv_heads, model.head_dim, model.num_layers,
                                    jnp.dtype(dtype))


def _padded(ids, pool_size: int) -> jax.Array:
    """int32 ids padded with ``pool_size`` (one past the last block) to the next power of two."""
    ids = np.asarray(ids, np.int32)
    size = 1 << max(len(ids) - 1, 0).bit_length()
    return jnp.asarray(np.pad(ids, (0, size - len(ids)), constant_values=pool_size))


def _copy(kv_caches, src, dst):
    return [pallas_paged.copy_blocks(k, v, src, dst) for k, v in kv_caches]


def _gather(kv_caches, ids):
    """Blocks ``ids`` (int32[n]) of every layer's (k, v) → [layers, 2, kv_heads, n, block_size, d]."""
    return jnp.stack([jnp.stack([gather_blocks(k, ids), gather_blocks(v, ids)]) for k, v in kv_caches])


def _scatter(kv_caches, blocks, ids):
    """Write ``blocks`` ([layers, 2, kv_heads, n, block_size, d], as :func:`_gather` gives) into
    blocks ``ids`` (int32[n]; ids past the pool write nothing) of every layer. Returns the caches."""
    return [(scatter_blocks(k, blocks[i, 0], ids), scatter_blocks(v, blocks[i, 1], ids))
            for i, (k, v) in enumerate(kv_caches)]


def _blocks_sharding(cache_sharding):
    """Where swapped-in blocks go: split over KV heads as the caches are (None: the default device)."""
    if isinstance(cache_sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(cache_sharding.mesh, jax.sharding.PartitionSpec(None, None,
                                                                                           *cache_sharding.spec))
    return cache_sharding


class CacheEngine:
    """Owns ``kv_caches`` (per layer ``(k, v)``, each ``[kv_heads, blocks, block_size, d]``,
    placed with ``sharding`` for tensor parallelism) and the swap space ``host_blocks``
    (``[layers, 2, kv_heads, num_host_blocks, block_size, d]`` in host memory). On a Linux CPU
    the device caches get huge pages (:mod:`engine.worker.huge_pages`; ``_huge_pages`` is the thread
    asking), which the programs that update them in place keep."""

    def __init__(self, spec: pallas_paged.KVCacheSpec, num_host_blocks: int, sharding=None):
        self.spec = spec
        self._sharding = sharding
        self._blocks_sharding = _blocks_sharding(sharding)
        self.kv_caches = spec.allocate(sharding)
        self._huge_pages = huge_pages.start(self.kv_caches, "KV cache")
        self.num_host_blocks = num_host_blocks
        self._host_blocks = None
        # Compiled with the kernels' options, under which 16-bit caches are updated in place.
        jit = functools.partial(jax.jit, compiler_options=pallas_paged.compiler_options(jax.default_backend()))
        self._gather = jit(_gather)
        self._scatter, self._copy = jit(_scatter, donate_argnums=(0,)), jit(_copy, donate_argnums=(0,))
        log.info("KV cache: %d device blocks (%.1f MiB), %d host blocks (%.1f MiB)", spec.num_blocks,
                 spec.num_blocks * spec.bytes_per_block / 2**20, num_host_blocks,
                 num_host_blocks * spec.bytes_per_block / 2**20)

    @property
    def host_blocks(self) -> np.ndarray:
        """The swap space, ``[layers, 2, kv_heads, num_host_blocks, block_size, d]``. Allocated
        at the first swap, and its pages only when written: many runs never swap."""
        if self._host_blocks is None:
            start = time.monotonic()
            spec = self.spec
            self._host_blocks = np.zeros((spec.num_layers, 2, spec.num_kv_heads, max(self.num_host_blocks, 1),
                                          spec.block_size, spec.head_dim), spec.dtype)
            log.info("allocated the swap space in %.1f s", time.monotonic() - start)
        return self._host_blocks

    def apply(self, swap_out=(), swap_in=(), copy=()) -> None:
        """Carry out one step's block operations, in the order the scheduler requires.

        swap_out: (device_block, host_block) pairs; swap_in: (host_block, device_block) pairs;
        copy: (src, dst) device-block pairs for copy-on-write.
        """
        if swap_out:
            device_ids, host_ids = zip(*swap_out)
            moved = np.asarray(self._gather(self.kv_caches, self._device_ids(device_ids)))
            self.host_blocks[:, :, :, list(host_ids)] = moved[:, :, :, : len(host_ids)]
        if swap_in:
            host_ids, device_ids = zip(*swap_in)
            padded = self._device_ids(device_ids)
            picked = np.pad(list(host_ids), (0, len(padded) - len(host_ids)))  # the padding's blocks are dropped
            blocks = jax.device_put(self.host_blocks[:, :, :, picked], self._blocks_sharding)
            self.kv_caches = self._scatter(self.kv_caches, blocks, padded)
        if copy:
            src, dst = zip(*copy)
            self.kv_caches = self._copy(self.kv_caches, self._device_ids(src), self._device_ids(dst))

    @property
    def lost(self) -> bool:
        """True when a device cache was donated to a program that never returned (a step
        interrupted part-way): what the blocks held is gone."""
        return any(cache.is_deleted() for layer in self.kv_caches for cache in layer)

    def reset(self) -> None:
        """Fresh zeroed device caches and an empty swap space, after their contents were lost."""
        self.kv_caches = self.spec.allocate(self._sharding)
        self._huge_pages = huge_pages.start(self.kv_caches, "KV cache")
        self._host_blocks = None

    def _device_ids(self, ids):
        return _padded(ids, self.spec.num_blocks)
