"""Paged attention for decode: one query token per sequence (GPU-style Pallas).

Grid: (sequence, block of KV heads[, split]). A program loops over only its
sequence's valid blocks, ``blocks_per_step`` at a time, and keeps an online
softmax; all query heads of a GQA group share each loaded K/V tile. When the
sequences and heads alone would leave the GPU idle, each sequence's steps are
split over several programs and their softmaxes merged after (flash-decoding).
The same source is compiled by Triton on GPU and run with ``interpret=True`` on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_paged import softmax
from pallas_paged.layout import load_blocks
from pallas_paged.tiling import Tiling


def _decode_kernel(block_tables_ref, context_lens_ref, q_ref, k_ref, v_ref, *out_refs,
                   heads_per_program, blocks_per_step, one_by_one, scale, splits):
    seq = pl.program_id(0)
    head_block = pl.program_id(1)
    heads = head_block if heads_per_program == 1 else pl.ds(head_block * heads_per_program, heads_per_program)
    context_len = context_lens_ref[seq]
    keys_per_step = k_ref.shape[2] * blocks_per_step
    q = q_ref[seq, heads].astype(jnp.float32) * scale

    def step(i, state):
        read = functools.partial(load_blocks, heads=heads, block_tables_ref=block_tables_ref, seq=seq,
                                 first=i * blocks_per_step, count=blocks_per_step, one_by_one=one_by_one)
        k, v = read(k_ref), read(v_ref)
        return softmax.update(state, q, k, v, i * keys_per_step, context_len)

    first, last = 0, pl.cdiv(context_len, keys_per_step)
    if splits > 1:  # flash-decoding: one of ``splits`` equal runs of the steps (none past the context)
        split, per_split = pl.program_id(2), pl.cdiv(last, splits)
        first, last = split * per_split, jnp.minimum((split + 1) * per_split, last)
    state = jax.lax.fori_loop(first, last, step, softmax.initial_state(q))
    if splits == 1:
        (o_ref,) = out_refs
        o_ref[seq, heads] = softmax.finish(state).astype(o_ref.dtype)
    else:  # the softmax's accumulators, for ``_merge``
        for ref, value in zip(out_refs, state):
            ref[split, seq, heads] = value


def _merge(acc, row_max, row_sum):
    """The split programs' accumulators ([splits, ..., rows, d], maxima and sums [splits, ...,
    rows, 1], float32) merged into the softmax over all of them: [..., rows, d]; rows that saw
    nothing are 0."""
    top = row_max.max(axis=0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)  # a padding row: every split empty
    weight = jnp.exp(row_max - top)  # 0 for a split with no keys (its maximum is -inf)
    return softmax.finish(((acc * weight).sum(axis=0), None, (row_sum * weight).sum(axis=0)))


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, *, scale, tiling: Tiling, interpret: bool):
    """Decode attention over a paged KV cache.

    q: [seqs, q_heads, d]; k_cache, v_cache: [kv_heads, blocks, block_size, d];
    block_tables: int32[seqs, max_blocks]; context_lens: int32[seqs] (0 for
    padding rows, which return zeros). Returns [seqs, q_heads, d]. With fewer programs than
    ``tiling.target_programs``, each sequence's keys are split over several (see
    :meth:`Tiling.decode_splits`).
    """
    seqs, q_heads, head_dim = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    group = q_heads // kv_heads
    rows = tiling.group_rows(group, tokens=1)
    per_program = tiling.heads(kv_heads)
    blocks_per_step = tiling.blocks_per_step(block_size)

    q_tiles = jnp.pad(q.reshape(seqs, kv_heads, group, head_dim), ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    block_tables = jnp.pad(block_tables, ((0, 0), (0, -block_tables.shape[1] % blocks_per_step)))
    splits = tiling.decode_splits(seqs * (kv_heads // per_program), block_tables.shape[1] // blocks_per_step)
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_decode_kernel, heads_per_program=per_program, blocks_per_step=blocks_per_step,
                               one_by_one=tiling.one_by_one, scale=scale, splits=splits)
    # Rows past the last one with context are padding; a dynamic grid skips them.
    num_programs = jnp.max(jnp.where(context_lens > 0, jnp.arange(1, seqs + 1), 0)) if tiling.dynamic_grid else seqs
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct(q_tiles.shape, q.dtype)
    else:
        stats = jax.ShapeDtypeStruct((splits, *q_tiles.shape[:-1], 1), jnp.float32)
        out_shape = (jax.ShapeDtypeStruct((splits, *q_tiles.shape), jnp.float32), stats, stats)
    out = pl.pallas_call(
        kernel,
        grid=(num_programs, kv_heads // per_program) + ((splits,) if splits > 1 else ()),
        in_specs=[anywhere] * 5,
        out_specs=anywhere if splits == 1 else (anywhere,) * 3,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=2),
        name="paged_decode_attention",
    )(block_tables, context_lens, q_tiles, k_cache, v_cache)
    if splits > 1:
        out = _merge(*out).astype(q.dtype)
    out = jnp.where((context_lens > 0)[:, None, None, None], out[:, :, :group], 0)
    return out.reshape(seqs, q_heads, head_dim)
