"""The compiled programs of the model's stages, one per input shape, shared by every engine.

The runner calls stages through :func:`call`, which looks the executable up by the shapes of
its arguments and compiles on a miss. :func:`compile_all` compiles a list of calls ahead of
time: lowering (Python, one at a time) and then XLA compilation on every core at once, which
is most of the warm-up.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import math
import os
import threading

import jax

import models
import pallas_paged
from engine.worker import sampler


def _replicated(x):
    """Under a mesh, activations leave every stage whole on every device (Megatron-style), so
    the next stage's compiled program finds them where it expects them."""
    if jax.sharding.get_abstract_mesh().axis_names:
        return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec())
    return x


@functools.partial(jax.jit, static_argnums=0)
def _embed(config, params, input_ids, positions):
    return jax.tree.map(_replicated, models.stages(config).embed(params, input_ids, positions))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=5)
def _layer(config, layer_params, x, positional, metadata, kv_cache):
    x, kv_cache = models.stages(config).layer(layer_params, x, positional, metadata, kv_cache)
    return _replicated(x), kv_cache


@functools.partial(jax.jit, static_argnums=0)
def _pick(config, x, rows):
    return _replicated(x[rows])


@functools.partial(jax.jit, static_argnums=0)
def _head(config, params, h, argmax_rows):
    """The logits of ``h``'s rows (float32 [L, vocab]) and, when ``argmax_rows`` is set (the
    sampler would take nothing else), each row's arg-max (int32 [L]; zeros otherwise)."""
    logits = models.stages(config).head(params, h, jax.numpy.arange(h.shape[0]), argmax_rows)
    return logits, _argmax_if_asked(logits, argmax_rows)


def _argmax_if_asked(logits, argmax_rows):
    """Each row's arg-max of ``logits`` when ``argmax_rows`` > 0, else zeros (int32 [L])."""
    return jax.lax.cond(argmax_rows > 0, sampler.argmax, lambda x: jax.numpy.zeros(x.shape[0], jax.numpy.int32),
                        logits)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=5)
def _decode(config, params, input_ids, positions, metadata, kv_caches):
    """The whole model for a decode step (see ``ModelRunner.run``): the logits of every row
    (float32 [T, vocab]), the new caches, each row's arg-max (int32 [T]; zeros unless
    ``metadata.argmax_rows``, which is when the sampler would take nothing else) and the next
    decode's positions, slots and context lengths (:func:`_advanced`), so that a lookahead
    after this step waits on this program alone."""
    every_row = metadata.replace(logits_indices=jax.numpy.arange(input_ids.shape[0]))
    logits, kv_caches = models.forward_fn(config)(params, input_ids, positions, every_row, kv_caches)
    return logits, kv_caches, _argmax_if_asked(logits, metadata.argmax_rows), _advanced(positions, metadata)


def _advanced(positions, metadata):
    """The positions (int32[T]), slots (int32[T]) and context lengths (int32[S]) of the
    decode after the decode step of ``positions`` and ``metadata`` (token i is sequence i):
    real rows one on, each next slot found in the row's block table (padding rows have slot
    -1 and context 0, and keep them). For a lookahead (:mod:`engine.async_scheduling`)."""
    size, tables = metadata.block_size, metadata.block_tables
    assert size > 0, "the metadata's block size is needed to find the next slots"
    real = metadata.slot_mapping >= 0
    next_positions = positions + 1
    index = jax.numpy.minimum(next_positions // size, tables.shape[1] - 1)[:, None]  # padding rows stay in the table
    slots = jax.numpy.take_along_axis(tables, index, axis=1)[:, 0] * size + next_positions % size
    return (jax.numpy.where(real, next_positions, positions), jax.numpy.where(real, slots, -1),
            jax.numpy.where(metadata.context_lens > 0, metadata.context_lens + 1, 0))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=5)
def _decode_steps(config, params, input_ids, positions, metadata, kv_caches, batch, steps, tokens):
    """Multi-step decode: up to K decode steps in one program, each sampling on the device
    (``sampler.sample`` with ``batch``, its ``step`` counting on) and feeding its tokens to the
    next. Row i runs ``steps[i]`` steps (int32 [T]; 0 for padding rows), then writes nothing
    more; the loop ends when every row is done. tokens: int32 [T, K] of -1, its width the
    most steps. Returns (the tokens sampled, int32 [T, K] (-1 after a row's last step), the
    sampler's other outputs stacked [K, T, ...], the new caches, and the last step's tokens,
    int32 [T]: the inputs of a loop after this one, when every row ran all the steps). With
    penalties, each step counts the tokens of the steps before it."""
    every_row = metadata.replace(logits_indices=jax.numpy.arange(input_ids.shape[0]))
    forward = models.forward_fn(config)
    shapes = jax.eval_shape(sampler.sample, jax.ShapeDtypeStruct((input_ids.shape[0], config.vocab_size),
                                                                 jax.numpy.float32), batch)
    stacked = jax.tree.map(lambda s: jax.numpy.zeros((tokens.shape[1], *s.shape), s.dtype), shapes)

    def one_step(j, carry):
        input_ids, positions, metadata, kv_caches, tokens, stacked = carry
        logits, kv_caches = forward(params, input_ids, positions, metadata, kv_caches)
        history = jax.numpy.concatenate([batch.output_tokens, tokens], axis=1) if batch.penalties else None
        out = sampler.sample(logits, batch.replace(step=batch.step + j, output_tokens=history)
                             if batch.penalties else batch.replace(step=batch.step + j))
        tokens = tokens.at[:, j].set(jax.numpy.where(j < steps, out.tokens, -1))
        stacked = jax.tree.map(lambda all_steps, this: all_steps.at[j].set(this), stacked, out)
        going = j + 1 < steps
        next_positions, next_slots, next_context_lens = _advanced(positions, metadata)
        metadata = metadata.replace(slot_mapping=jax.numpy.where(going, next_slots, -1),
                                    context_lens=jax.numpy.where(going, next_context_lens, metadata.context_lens))
        return out.tokens, jax.numpy.where(going, next_positions, positions), metadata, kv_caches, tokens, stacked

    carry = (input_ids, positions, every_row, kv_caches, tokens, stacked)
    last, _, _, kv_caches, tokens, stacked = jax.lax.fori_loop(0, steps.max(), one_step, carry)
    return tokens, stacked, kv_caches, last


@functools.partial(jax.jit, static_argnums=0)
def _advance(config, positions, metadata):
    """:func:`_advanced` as a program, for steps run a program per stage."""
    return _advanced(positions, metadata)


STAGES = {"embed": _embed, "layer": _layer, "pick": _pick, "head": _head, "decode": _decode, "advance": _advance,
          "decode_steps": _decode_steps}
_compiled: dict = {}
_lock = threading.Lock()


def _key(stage: str, config, mesh, args) -> tuple:
    leaves, structure = jax.tree.flatten(args)
    return stage, config, mesh, structure, tuple((leaf.shape, leaf.dtype) for leaf in leaves)


def _lower(stage: str, config, mesh, args):
    """Trace and lower; under a mesh, so the kernels run per device (see ``Metadata.write_and_attend``).
    Without JAX's deprecation warning for the Pallas Triton backend (:mod:`pallas_paged.lowering`)."""
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh), pallas_paged.lowering.quietly():
        return STAGES[stage].lower(config, *args)


def executable(stage: str, *args, config: models.ModelConfig, mesh=None):
    """The compiled ``stage`` of ``config``'s model for arguments shaped like ``args`` (split
    over ``mesh``, if any), compiling it if needed. Calls with same-shaped arguments (every
    layer of a step) can share one lookup."""
    key = _key(stage, config, mesh, args)
    compiled = _compiled.get(key)
    return _compile(key, _lower(stage, config, mesh, args)) if compiled is None else compiled


def call(stage: str, *args, config: models.ModelConfig, mesh=None):
    """Run ``stage`` on ``args``: :func:`executable`, then call it."""
    return executable(stage, *args, config=config, mesh=mesh)(*args)


def _compiler_options() -> dict:
    """The kernels' options (:func:`pallas_paged.compiler_options`), and on CPU optimisation
    level 1 instead of 2: the steps run as fast (measured with ``benchmarks/throughput.py
    chat``) and every program compiles in about two thirds of the time, which is most of a
    cold start."""
    platform = jax.default_backend()
    level = {"xla_backend_optimization_level": 1} if platform == "cpu" else {}
    return {**pallas_paged.compiler_options(platform), **level}


def _compile(key, lowered):
    executable = lowered.compile(compiler_options=_compiler_options())
    with _lock:
        return _compiled.setdefault(key, executable)


def activation_bytes(stage: str, config, mesh, args, *, resident: set[int]) -> int:
    """Device memory ``stage`` needs for ``args`` besides the arrays whose ``id`` is in
    ``resident`` (weights and KV caches, which live anyway): its other arguments, its results
    (less those written in place of an argument) and its scratch, per device, from XLA's
    buffer assignment. Compiles the program without keeping it."""
    compiled = _lower(stage, config, mesh, args).compile(compiler_options=_compiler_options())
    held = sum(_bytes_per_device(leaf) for leaf in jax.tree.leaves(args) if id(leaf) in resident)
    return footprint(compiled) - held


def footprint(compiled: jax.stages.Compiled) -> int:
    """Bytes a compiled program holds on each device while it runs: its arguments, its results
    less those written in place of an argument, and its scratch (XLA's buffer assignment)."""
    stats = compiled.memory_analysis()
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
            + stats.temp_size_in_bytes)


def _bytes_per_device(leaf: jax.ShapeDtypeStruct) -> int:
    shape = leaf.shape if leaf.sharding is None else leaf.sharding.shard_shape(leaf.shape)
    return math.prod(shape) * leaf.dtype.itemsize


def compile_all(calls) -> int:
    """Compile every ``(stage, config, mesh, args)`` not compiled yet (``args`` may be
    ``jax.ShapeDtypeStruct`` pytrees). Returns how many were compiled.

    Each program goes to the compiler threads as soon as it is lowered, so lowering (Python,
    holding the GIL) overlaps the compilation of the programs before it."""
    pending = set()
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = []
        for stage, config, mesh, args in calls:
            key = _key(stage, config, mesh, args)
            if key not in _compiled and key not in pending:
                pending.add(key)
                futures.append(pool.submit(_compile, key, _lower(stage, config, mesh, args)))
        for future in futures:
            future.result()
    return len(pending)
