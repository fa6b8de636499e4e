"""The device KV caches and the host swap space, and the block operations of each step.

The scheduler decides which blocks move; this module only carries it out, one jitted call
per kind of operation covering every layer, with the destination donated so the caches are
updated in place. Block-id lists are padded to powers of two with an id past the end of
the pool, which gathers clamp and scatters skip, so a handful of compiled shapes serve
every step.
"""

from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on

import pallas_paged
from engine import huge_pages
from pallas_paged.cache_ops import gather_blocks, scatter_blocks

log = logging.getLogger(__name__)


def _padded(ids, pool_size: int) -> jax.Array:
    """int32 ids padded with ``pool_size`` (one past the last block) to the next power of two."""
    ids = np.asarray(ids, np.int32)
    size = 1 << max(len(ids) - 1, 0).bit_length()
    return jnp.asarray(np.pad(ids, (0, size - len(ids)), constant_values=pool_size))


def _copy(kv_caches, src, dst):
    return [pallas_paged.copy_blocks(k, v, src, dst) for k, v in kv_caches]


def _swap_out(host_caches, kv_caches, device_ids, host_ids):
    """Blocks ``device_ids`` of every layer → host blocks ``host_ids``: gather on the device,
    move only those blocks, scatter in host memory."""
    host_ids = jax.device_put(host_ids, jax.memory.Space.Host)
    out = []
    for host_layer, device_layer in zip(host_caches, kv_caches):
        moved = [jax.device_put(gather_blocks(cache, device_ids), jax.memory.Space.Host) for cache in device_layer]
        with compute_on("device_host"):
            out.append(tuple(scatter_blocks(h, m, host_ids) for h, m in zip(host_layer, moved)))
    return out


def _swap_in(kv_caches, host_caches, host_ids, device_ids):
    """Host blocks ``host_ids`` of every layer → device blocks ``device_ids`` (the inverse of ``_swap_out``)."""
    host_ids = jax.device_put(host_ids, jax.memory.Space.Host)
    out = []
    for device_layer, host_layer in zip(kv_caches, host_caches):
        with compute_on("device_host"):
            picked = [gather_blocks(h, host_ids) for h in host_layer]
        moved = [jax.device_put(p, jax.memory.Space.Device) for p in picked]
        out.append(tuple(scatter_blocks(d, m, device_ids) for d, m in zip(device_layer, moved)))
    return out


class CacheEngine:
    """Owns ``kv_caches`` (per layer ``(k, v)``, each ``[kv_heads, blocks, block_size, d]``)
    and ``host_caches`` (the same with ``num_host_blocks``, in pinned host memory), placed
    with ``sharding`` / ``host_sharding`` (for tensor parallelism). On a Linux CPU the device
    caches get huge pages (:mod:`engine.huge_pages`; ``_huge_pages`` is the thread asking),
    which the programs that update them in place keep."""

    def __init__(self, spec: pallas_paged.KVCacheSpec, num_host_blocks: int, sharding=None, host_sharding=None):
        self.spec = spec
        self._sharding = sharding
        self.kv_caches = spec.allocate(sharding)
        self._huge_pages = huge_pages.start(self.kv_caches, "KV cache")
        self._host_sharding = host_sharding
        host_spec = pallas_paged.KVCacheSpec(max(num_host_blocks, 1), spec.block_size, spec.num_kv_heads,
                                             spec.head_dim, spec.num_layers, spec.dtype)
        self.num_host_blocks = num_host_blocks
        self._host_spec = host_spec
        self._host_caches = None
        # Compiled with the kernels' options, under which 16-bit caches are updated in place.
        jit = functools.partial(jax.jit, donate_argnums=(0,),
                                compiler_options=pallas_paged.compiler_options(jax.default_backend()))
        self._swap_out, self._swap_in, self._copy = jit(_swap_out), jit(_swap_in), jit(_copy)
        log.info("KV cache: %d device blocks (%.1f MiB), %d host blocks (%.1f MiB)", spec.num_blocks,
                 spec.num_blocks * spec.bytes_per_block / 2**20, num_host_blocks,
                 num_host_blocks * spec.bytes_per_block / 2**20)

    @property
    def host_caches(self):
        """Per layer ``(k, v)`` of the swap space, in pinned host memory. Allocated at the first
        swap: gigabytes take seconds to allocate, and many runs never swap."""
        if self._host_caches is None:
            start = time.monotonic()
            self._host_caches = self._host_spec.allocate_on_host(self._host_sharding)
            log.info("allocated the swap space in %.1f s", time.monotonic() - start)
        return self._host_caches

    @host_caches.setter
    def host_caches(self, caches):
        self._host_caches = caches

    def apply(self, swap_out=(), swap_in=(), copy=()) -> None:
        """Carry out one step's block operations, in the order the scheduler requires.

        swap_out: (device_block, host_block) pairs; swap_in: (host_block, device_block) pairs;
        copy: (src, dst) device-block pairs for copy-on-write.
        """
        if swap_out:
            device_ids, host_ids = zip(*swap_out)
            self.host_caches = self._swap_out(self.host_caches, self.kv_caches, self._device_ids(device_ids),
                                              self._host_ids(host_ids))
        if swap_in:
            host_ids, device_ids = zip(*swap_in)
            self.kv_caches = self._swap_in(self.kv_caches, self.host_caches, self._host_ids(host_ids),
                                           self._device_ids(device_ids))
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
        self._host_caches = None

    def _device_ids(self, ids):
        return _padded(ids, self.spec.num_blocks)

    def _host_ids(self, ids):
        return _padded(ids, self.num_host_blocks)
