"""How many KV blocks the device pool gets, and why (the ready line says it).

In order: ``num_blocks`` exactly; else ``kv_cache_memory`` bytes; else, on a GPU or TPU,
vLLM's ``gpu_memory_utilization``: that fraction of the device's memory, less what the
process already holds there (the weights) and the most a step needs besides (the peak
activations, measured from the compiled programs of the largest steps); else (a CPU, or a
device whose allocator reports no limit) 1 GiB.

On a GPU JAX's allocator hands out at most ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the
device (0.75 unless set; with preallocation it reserves that much at start). The pool is
sized within that limit, from what is in use rather than what is reserved, so preallocation
is neither counted twice nor exceeded; ``python -m engine.serve`` raises the limit to
``gpu_memory_utilization`` when the variable is not set.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

_GIB = 2**30
DEFAULT_BYTES = _GIB  # the pool where no memory limit is known (CPUs)
JAX_GPU_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
_JAX_DEFAULT_GPU_FRACTION = 0.75


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """One device's memory in bytes: ``total``, the ``limit`` JAX's allocator may hand out,
    and what this process holds there now (``in_use``)."""

    total: int
    limit: int
    in_use: int

    @classmethod
    def of(cls, device) -> DeviceMemory | None:
        """What ``device``'s allocator reports; None on CPUs and where it reports no limit (a
        GPU under ``XLA_PYTHON_CLIENT_ALLOCATOR=platform``)."""
        stats = (device.memory_stats() if device.platform != "cpu" else None) or {}
        if "bytes_limit" not in stats:
            return None
        limit = int(stats["bytes_limit"])
        fraction = float(os.environ.get(JAX_GPU_FRACTION, _JAX_DEFAULT_GPU_FRACTION)) if device.platform == "gpu" else 1
        return cls(total=int(limit / fraction), limit=limit, in_use=int(stats.get("bytes_in_use", 0)))


@dataclasses.dataclass(frozen=True)
class KVCacheSize:
    """The pool's ``num_blocks`` and how they were chosen (for the ready line)."""

    num_blocks: int
    reason: str


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / _GIB:.2f} GiB"


def by_utilization(utilization: float, devices: Sequence[DeviceMemory], activation_bytes: int,
                   bytes_per_block: int) -> KVCacheSize:
    """``utilization`` of each device's memory (within JAX's limit), less what it holds and
    ``activation_bytes``, over ``devices`` (one per tensor-parallel shard; each holds
    1/len(devices) of every block). Raises ValueError when nothing is left for the pool."""
    budgets = [min(utilization * d.total, d.limit) for d in devices]
    free = min(budget - d.in_use - activation_bytes for budget, d in zip(budgets, devices))
    first, budget = devices[0], budgets[0]
    capped = budget < utilization * first.total
    spent = (f"{_gib(budget)} ({utilization:g} of {_gib(first.total)}"
             + (f", capped by JAX's allocator limit; set {JAX_GPU_FRACTION} higher to use more" if capped else "")
             + f") less {_gib(first.in_use)} in use (the weights) and {_gib(activation_bytes)} of peak activations")
    num_blocks = int(free * len(devices) // bytes_per_block)
    if num_blocks < 1:
        raise ValueError(f"gpu_memory_utilization={utilization:g} leaves no room for a KV block: {spent}; raise "
                         f"gpu_memory_utilization, lower max_num_batched_tokens or max_num_seqs, or set "
                         f"kv_cache_memory or num_blocks")
    return KVCacheSize(num_blocks, f"gpu_memory_utilization: {_gib(free)} per device = {spent}")


def choose(*, num_blocks: int | None, kv_cache_memory: float | None, utilization: float, bytes_per_block: int,
           devices: Sequence[DeviceMemory | None], activation_bytes: Callable[[], int]) -> KVCacheSize:
    """The pool for an engine over ``devices`` (their memory as :meth:`DeviceMemory.of` reads
    it, after the weights are placed); ``activation_bytes`` is called only when needed."""
    if num_blocks is not None:
        return KVCacheSize(num_blocks, "num_blocks")
    if kv_cache_memory is not None:
        return KVCacheSize(max(1, int(kv_cache_memory) // bytes_per_block), f"kv_cache_memory {_gib(kv_cache_memory)}")
    if devices and all(d is not None for d in devices):
        return by_utilization(utilization, devices, activation_bytes(), bytes_per_block)
    return KVCacheSize(max(1, DEFAULT_BYTES // bytes_per_block),
                       f"the default of {_gib(DEFAULT_BYTES)} where the device reports no memory limit "
                       f"(set kv_cache_memory or num_blocks to change it)")
