"""Ragged paged attention: prefill chunks and decodes mixed in one call (GPU-style Pallas).

The query tokens are cut into tiles of at most ``tokens_per_tile`` tokens of
one sequence each. Grid: (block of KV heads, tile). A program reads its
tile's rows of ``q`` (laid out so they are contiguous), loops over the blocks
the tile can see (causal) with an online softmax, and writes one whole tile of
the output, which is gathered back into token order after the call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_paged import softmax
from pallas_paged.layout import load_blocks
from pallas_paged.tiling import QueryTiles, Tiling


def _ragged_kernel(tile_seq_ref, tile_start_ref, tile_len_ref, tile_token_ref, block_tables_ref,
                   context_lens_ref, query_lens_ref, q_ref, k_ref, v_ref, o_ref, *,
                   heads_per_program, blocks_per_step, one_by_one, group_rows, scale):
    head_block = pl.program_id(0)
    tile = pl.program_id(1)
    heads = head_block if heads_per_program == 1 else pl.ds(head_block * heads_per_program, heads_per_program)
    seq = tile_seq_ref[tile]
    context_len = context_lens_ref[seq]
    first_pos = context_len - query_lens_ref[seq] + tile_start_ref[tile]
    last_pos = first_pos + tile_len_ref[tile] - 1
    keys_per_step = k_ref.shape[2] * blocks_per_step
    tile_rows = o_ref.shape[-2]
    q = q_ref[heads, pl.ds(tile_token_ref[tile] * group_rows, tile_rows)].astype(jnp.float32) * scale
    query_pos = first_pos + jax.lax.broadcasted_iota(jnp.int32, (q.shape[-2], 1), 0) // group_rows

    def step(i, state):
        read = functools.partial(load_blocks, heads=heads, block_tables_ref=block_tables_ref, seq=seq,
                                 first=i * blocks_per_step, count=blocks_per_step, one_by_one=one_by_one)
        k, v = read(k_ref), read(v_ref)
        return softmax.update(state, q, k, v, i * keys_per_step, context_len, query_pos)

    num_steps = jnp.where(tile_len_ref[tile] > 0, pl.cdiv(last_pos + 1, keys_per_step), 0)
    state = jax.lax.fori_loop(0, num_steps, step, softmax.initial_state(q))
    o_ref[heads, tile] = softmax.finish(state).astype(o_ref.dtype)


def ragged_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *,
                           scale, tiling: Tiling, interpret: bool):
    """Causal attention for any mix of prefill chunks and decodes.

    q: [tokens, q_heads, d]; k_cache, v_cache: [kv_heads, blocks, block_size, d];
    block_tables: int32[seqs, max_blocks]; context_lens: int32[seqs];
    query_start_loc: int32[seqs + 1]. Sequence i owns q rows
    ``query_start_loc[i]:query_start_loc[i+1]``, the last positions of its
    ``context_lens[i]`` tokens. Returns [tokens, q_heads, d]; unowned rows are 0.
    """
    num_tokens, q_heads, head_dim = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    group = q_heads // kv_heads
    tokens_per_tile = tiling.tokens_per_tile
    rows = tiling.group_rows(group, tokens=tokens_per_tile)
    per_program = tiling.heads(kv_heads)
    blocks_per_step = tiling.blocks_per_step(block_size)
    num_tiles = QueryTiles.max_tiles(num_tokens, num_seqs, tokens_per_tile)

    tiles = QueryTiles.build(query_start_loc, tokens_per_tile, num_tiles)
    block_tables = jnp.pad(block_tables, ((0, 0), (0, -block_tables.shape[1] % blocks_per_step)))

    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_ragged_kernel, heads_per_program=per_program, blocks_per_step=blocks_per_step,
                               one_by_one=tiling.one_by_one, group_rows=rows, scale=scale)
    out = pl.pallas_call(
        kernel,
        grid=(kv_heads // per_program, tiles.num_used if tiling.dynamic_grid else num_tiles),
        in_specs=[anywhere] * 10,
        out_specs=anywhere,
        out_shape=jax.ShapeDtypeStruct((kv_heads, num_tiles, tokens_per_tile * rows, head_dim), q.dtype),
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=2),
        name="ragged_paged_attention",
    )(tiles.seq, tiles.start, tiles.length, tiles.first_token, block_tables, context_lens, tiles.query_lens,
      tiles.grouped(q, kv_heads, rows), k_cache, v_cache)
    return tiles.scatter(out, num_tokens, group)
