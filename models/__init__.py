"""Functional models over a parameter pytree, calling the paged-attention kernels.

    config, params, tokenizer = load_model()              # SmolLM2-135M-Instruct
    step = jax.jit(forward_fn(config), donate_argnums=4)
    logits, kv_caches = step(params, input_ids, positions, metadata, kv_caches)
"""

from __future__ import annotations

import functools

from models.config import ModelConfig, ModelLoadError
from models.loader import ARCHITECTURES, LoadedModel, load_model
from models.metadata import Metadata
from models.sharding import kv_cache_specs, named_shardings, param_specs

__all__ = [
    "LoadedModel",
    "Metadata",
    "ModelConfig",
    "ModelLoadError",
    "forward_fn",
    "kv_cache_specs",
    "load_model",
    "named_shardings",
    "param_specs",
]

def forward_fn(config: ModelConfig):
    """The model step for ``config``: ``(params, input_ids, positions, metadata, kv_caches) → (logits, kv_caches)``.

    input_ids, positions: int32[T]; metadata: :class:`Metadata`; kv_caches: per
    layer (k_cache, v_cache) from ``KVCacheSpec.allocate()``. Returns float32
    logits [len(metadata.logits_indices), vocab] and the updated caches.
    """
    return functools.partial(ARCHITECTURES[config.architecture].forward, config)
