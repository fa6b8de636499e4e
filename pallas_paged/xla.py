"""Paged attention written as plain XLA: gather a sequence's blocks, then attend.

Used where no Pallas kernel fits (ragged attention on TPU) and as the
"gather then attend" baseline in ``benchmarks/kernels.py``. Same math as the
kernels (:mod:`pallas_paged.softmax`), one tile holding every key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_paged import softmax
from pallas_paged.tiling import QueryTiles


def _gather_blocks(cache, block_table):
    """cache: [kv_heads, blocks, block_size, d]; block_table: int32[max_blocks] → [kv_heads, keys, d]."""
    kv_heads, _, _, head_dim = cache.shape
    return cache[:, block_table].reshape(kv_heads, -1, head_dim)


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, *, scale):
    """Decode attention. q: [seqs, q_heads, d] → [seqs, q_heads, d]."""
    seqs, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    group = q_heads // kv_heads

    def one(q_seq, table, context_len):
        k = _gather_blocks(k_cache, table)
        v = _gather_blocks(v_cache, table)
        q_group = q_seq.reshape(kv_heads, group, head_dim).astype(jnp.float32) * scale
        state = softmax.update(softmax.initial_state(q_group), q_group, k, v, 0, context_len)
        return softmax.finish(state).reshape(q_heads, head_dim)

    return jax.vmap(one)(q, block_tables, context_lens).astype(q.dtype)


def ragged_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *,
                           scale, tokens_per_tile=128):
    """Ragged causal attention, one query tile at a time (``lax.map``), so memory stays bounded.

    q: [tokens, q_heads, d]; see :func:`pallas_paged.ragged_paged_attention`.
    """
    num_tokens, q_heads, head_dim = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    group = q_heads // kv_heads
    tokens_per_tile = min(tokens_per_tile, num_tokens)
    num_tiles = QueryTiles.max_tiles(num_tokens, block_tables.shape[0], tokens_per_tile)
    tiles = QueryTiles.build(query_start_loc, tokens_per_tile, num_tiles)
    grouped = tiles.grouped(q, kv_heads, group)
    tile_rows = tokens_per_tile * group

    def one(args):
        seq, start, first_token = args
        q_tile = jax.lax.dynamic_slice_in_dim(grouped, first_token * group, tile_rows, axis=1)
        k = _gather_blocks(k_cache, block_tables[seq])
        v = _gather_blocks(v_cache, block_tables[seq])
        first_pos = context_lens[seq] - tiles.query_lens[seq] + start
        query_pos = first_pos + jnp.arange(q_tile.shape[1])[:, None] // group
        q_tile = q_tile.astype(jnp.float32) * scale
        state = softmax.update(softmax.initial_state(q_tile), q_tile, k, v, 0, context_lens[seq], query_pos)
        return softmax.finish(state).astype(q.dtype)

    out = jax.lax.map(one, (tiles.seq, tiles.start, tiles.first_token))
    return tiles.scatter(out.transpose(1, 0, 2, 3), num_tokens, group)

