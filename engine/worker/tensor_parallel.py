"""Tensor parallelism (the paper's §4.6): one scheduler, the model split Megatron-style over a mesh.

Every device holds the same block ids but only its own attention heads' share of each block;
weights follow :mod:`models.sharding` (heads and MLP columns, then rows; embedding and LM head
split over the vocabulary, so the largest matrix is never replicated). XLA's SPMD partitioner
inserts the communication: an all-reduce after the attention output projection and one after
the MLP, two per layer. The kernels run per device under ``jax.shard_map``.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
from models.sharding import AXIS


def make_mesh(size: int) -> jax.sharding.Mesh | None:
    """A mesh of ``size`` devices along ``"tp"``, or None for a single device."""
    if size == 1:
        return None
    devices = jax.devices()
    if len(devices) < size:
        raise ValueError(f"tensor_parallel_size={size} needs {size} devices but {len(devices)} are visible; on a "
                         f"CPU set XLA_FLAGS=--xla_force_host_platform_device_count={size} before starting")
    return jax.sharding.Mesh(np.array(devices[:size]), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def check_divisible(config: models.ModelConfig, size: int) -> None:
    """Refuse a split that would cut a head, an MLP column block or the vocabulary unevenly."""
    parts = {"attention heads": config.num_heads, "KV heads": config.num_kv_heads,
             "MLP intermediate size": config.intermediate_size, "vocabulary": config.vocab_size}
    uneven = [f"{name} ({count})" for name, count in parts.items() if count % size]
    if uneven:
        raise ValueError(f"tensor_parallel_size={size} must divide the model's {', '.join(uneven)}; choose a "
                         f"size that divides all of them")


def place_params(params, mesh):
    """Parameters split per :func:`models.param_specs` (unchanged without a mesh)."""
    if mesh is None:
        return params
    return jax.device_put(params, models.named_shardings(mesh, models.param_specs(params)))


def cache_sharding(mesh):
    """KV caches split over their KV-head axis (None: the default device)."""
    return None if mesh is None else NamedSharding(mesh, P(AXIS, None, None, None))


def replicated(mesh):
    """Where step inputs go: every device of the mesh (None: the default device)."""
    return None if mesh is None else NamedSharding(mesh, P())
