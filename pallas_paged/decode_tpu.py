"""Paged decode attention for TPU (Mosaic), with scalar prefetch.

Triton-style kernels read the block table inside the kernel; Mosaic instead
wants the block table in SMEM before the grid starts, so the *index map* can
pick which KV block to DMA next. Grid: (sequence, KV head, block). Blocks past
a sequence's context map to its last valid block, which the pipeline does not
fetch again, and skip the compute.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_paged import softmax, xla


def _decode_kernel(block_tables_ref, context_lens_ref, q_ref, k_ref, v_ref, o_ref,
                   acc_ref, max_ref, sum_ref, *, scale):
    seq, block = pl.program_id(0), pl.program_id(2)
    block_size = k_ref.shape[0]
    context_len = context_lens_ref[seq]

    @pl.when(block == 0)
    def _():
        acc_ref[...], max_ref[...], sum_ref[...] = softmax.initial_state(q_ref[...])

    @pl.when(block * block_size < context_len)
    def _():
        q = q_ref[...].astype(jnp.float32) * scale
        state = (acc_ref[...], max_ref[...], sum_ref[...])
        acc_ref[...], max_ref[...], sum_ref[...] = softmax.update(
            state, q, k_ref[...], v_ref[...], block * block_size, context_len)

    @pl.when(block == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = softmax.finish((acc_ref[...], max_ref[...], sum_ref[...])).astype(o_ref.dtype)


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, *, scale, interpret=False):
    """Decode attention on TPU. Shapes as :func:`pallas_paged.paged_attention`.

    Mosaic tiles are (8, 128): ``head_dim`` should be a multiple of 128.
    """
    seqs, q_heads, head_dim = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    group = q_heads // kv_heads
    max_blocks = block_tables.shape[1]

    def kv_index(s, h, b, tables, lens):
        last = jnp.maximum(pl.cdiv(lens[s], block_size) - 1, 0)
        return h, tables[s * max_blocks + jnp.minimum(b, last)], 0, 0

    q_spec = pl.BlockSpec((None, None, group, head_dim), lambda s, h, b, tables, lens: (s, h, 0, 0))
    kv_spec = pl.BlockSpec((None, None, block_size, head_dim), kv_index)
    out = pl.pallas_call(
        functools.partial(_decode_kernel, scale=scale),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(seqs, kv_heads, max_blocks),
            in_specs=[q_spec, kv_spec, kv_spec],
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((group, head_dim), jnp.float32),
                            pltpu.VMEM((group, 1), jnp.float32),
                            pltpu.VMEM((group, 1), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((seqs, kv_heads, group, head_dim), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="paged_decode_attention_tpu",
    )(block_tables.reshape(-1), context_lens, q.reshape(seqs, kv_heads, group, head_dim), k_cache, v_cache)
    return out.reshape(seqs, q_heads, head_dim)


def ragged_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *, scale):
    """Ragged attention on TPU: the XLA formulation (no Mosaic ragged kernel yet)."""
    return xla.ragged_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale=scale)
