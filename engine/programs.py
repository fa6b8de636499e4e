"""The compiled programs of the model's stages, one per input shape, shared by every engine.

The runner calls stages through :func:`call`, which looks the executable up by the shapes of
its arguments and compiles on a miss. :func:`compile_all` compiles a list of calls ahead of
time: lowering (Python, one at a time) and then XLA compilation on every core at once, which
is most of the warm-up.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading

import jax

import models


@functools.partial(jax.jit, static_argnums=0)
def _embed(config, params, input_ids, positions):
    return models.stages(config).embed(params, input_ids, positions)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=5)
def _layer(config, layer_params, x, positions, metadata, kv_cache):
    return models.stages(config).layer(layer_params, x, positions, metadata, kv_cache)


@functools.partial(jax.jit, static_argnums=0)
def _pick(config, x, rows):
    return x[rows]


@functools.partial(jax.jit, static_argnums=0)
def _head(config, params, h):
    return models.stages(config).head(params, h, jax.numpy.arange(h.shape[0]))


STAGES = {"embed": _embed, "layer": _layer, "pick": _pick, "head": _head}
_compiled: dict = {}
_lock = threading.Lock()


def _key(stage: str, config, args) -> tuple:
    leaves, structure = jax.tree.flatten(args)
    return stage, config, structure, tuple((leaf.shape, str(leaf.dtype)) for leaf in leaves)


def call(stage: str, config: models.ModelConfig, *args):
    """Run ``stage`` of ``config``'s model on ``args``, compiling for their shapes if needed."""
    key = _key(stage, config, args)
    executable = _compiled.get(key)
    if executable is None:
        executable = _compile(key, STAGES[stage].lower(config, *args))
    return executable(*args)


def _compile(key, lowered):
    executable = lowered.compile()
    with _lock:
        return _compiled.setdefault(key, executable)


def compile_all(calls) -> int:
    """Compile every ``(stage, config, args)`` not compiled yet (``args`` may be
    ``jax.ShapeDtypeStruct`` pytrees). Returns how many were compiled."""
    pending = {}
    for stage, config, args in calls:
        key = _key(stage, config, args)
        if key not in _compiled and key not in pending:
            pending[key] = STAGES[stage].lower(config, *args)
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(lambda item: _compile(*item), pending.items()))
    return len(pending)
