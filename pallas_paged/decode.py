"""Paged attention for decode: one query token per sequence (GPU-style Pallas).

Grid: (sequence, block of KV heads). A program loops over only its sequence's
valid blocks, ``blocks_per_step`` at a time, and keeps an online softmax; all
query heads of a GQA group share each loaded K/V tile. The same source is
compiled by Triton on GPU and run with ``interpret=True`` on CPU.
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


def _decode_kernel(block_tables_ref, context_lens_ref, q_ref, k_ref, v_ref, o_ref, *,
                   heads_per_program, blocks_per_step, one_by_one, scale):
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

    num_steps = pl.cdiv(context_len, keys_per_step)
    state = jax.lax.fori_loop(0, num_steps, step, softmax.initial_state(q))
    o_ref[seq, heads] = softmax.finish(state).astype(o_ref.dtype)


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, *, scale, tiling: Tiling, interpret: bool):
    """Decode attention over a paged KV cache.

    q: [seqs, q_heads, d]; k_cache, v_cache: [kv_heads, blocks, block_size, d];
    block_tables: int32[seqs, max_blocks]; context_lens: int32[seqs] (0 for
    padding rows, which return zeros). Returns [seqs, q_heads, d].
    """
    seqs, q_heads, head_dim = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    group = q_heads // kv_heads
    rows = tiling.group_rows(group, tokens=1)
    per_program = tiling.heads(kv_heads)
    blocks_per_step = tiling.blocks_per_step(block_size)

    q_tiles = jnp.pad(q.reshape(seqs, kv_heads, group, head_dim), ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    block_tables = jnp.pad(block_tables, ((0, 0), (0, -block_tables.shape[1] % blocks_per_step)))
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_decode_kernel, heads_per_program=per_program,
                               blocks_per_step=blocks_per_step, one_by_one=tiling.one_by_one, scale=scale)
    # Rows past the last one with context are padding; a dynamic grid skips them.
    num_programs = jnp.max(jnp.where(context_lens > 0, jnp.arange(1, seqs + 1), 0)) if tiling.dynamic_grid else seqs
    out = pl.pallas_call(
        kernel,
        grid=(num_programs, kv_heads // per_program),
        in_specs=[anywhere] * 5,
        out_specs=anywhere,
        out_shape=jax.ShapeDtypeStruct(q_tiles.shape, q.dtype),
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=2),
        name="paged_decode_attention",
    )(block_tables, context_lens, q_tiles, k_cache, v_cache)
    out = jnp.where((context_lens > 0)[:, None, None, None], out[:, :, :group], 0)
    return out.reshape(seqs, q_heads, head_dim)
