"""Checkpoints loaded once and shared: every engine of the same files uses the same
(immutable) parameters while one is alive; and compiled programs kept on disk."""

from __future__ import annotations

import weakref
from pathlib import Path

import jax

import models
import pallas_paged
from models import gguf_cache


def use_compilation_cache() -> None:
    """Keep compiled programs on disk (``xla/`` under the cache root of
    :func:`models.gguf_cache.cache_root`), so a restart skips most of the warm-up."""
    root = gguf_cache.cache_root()
    if root is not None and jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(root / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


class SharedModel:
    """A loaded model that every engine of the same checkpoint uses while one is alive."""

    __slots__ = ("loaded", "__weakref__")

    def __init__(self, loaded: models.LoadedModel):
        self.loaded = loaded


_shared_models: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _checkpoint_version(path: Path) -> tuple:
    """Names, sizes and modification times of a checkpoint's files: what changes when it is re-saved."""
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file())


def load_shared(model: str | None, dtype: str, *, tensor_parallel_size: int) -> SharedModel:
    """The checkpoint's parameters, loaded once while some engine uses them: engines of the
    same files share them (they are immutable), a re-saved checkpoint is read afresh, and
    they are freed with the last engine. Engines without a device mesh, where
    :func:`pallas_paged.packing_enabled`, pack the weights for the native CPU product
    (:func:`models.packed_for_cpu`) and keep only the packed ones. A checkpoint no engine
    holds is read while the native kernels build or load (on a first start, g++ takes
    seconds), as whether to pack depends on them."""
    path = models.resolve(model)
    base = (str(path.resolve()), dtype, _checkpoint_version(path))
    loaded = None
    if not any(key[:3] == base for key in list(_shared_models.keys())):
        pallas_paged.native.start_loading()
        loaded = models.load_model(path, dtype=dtype)
    packed = tensor_parallel_size == 1 and pallas_paged.packing_enabled()
    key = (*base, packed)
    shared = _shared_models.get(key)
    if shared is None:
        loaded = loaded or models.load_model(path, dtype=dtype)
        if packed:
            loaded = loaded._replace(params=models.packed_for_cpu(loaded.params, consume=True))
        shared = _shared_models[key] = SharedModel(loaded)
    return shared
