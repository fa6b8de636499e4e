"""Dense ``jnp`` oracles for every op in :mod:`pallas_paged`.

They are written for clarity, not speed: each gathers a sequence's blocks into
a contiguous array and does textbook attention. Tests compare kernels with
these; nothing else should call them.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def _gather_sequence(cache, block_table):
    """``cache[kv_heads, blocks, block_size, d]`` → contiguous ``[kv_heads, max_blocks * block_size, d]``."""
    kv_heads, _, block_size, head_dim = cache.shape
    return cache[:, block_table].reshape(kv_heads, -1, head_dim)


def _attend(q, k, v, mask, scale):
    """Masked softmax attention for one sequence.

    q: [q_len, q_heads, d]; k, v: [kv_heads, kv_len, d]; mask: bool[q_len, kv_len].
    Returns [q_len, q_heads, d] in q's dtype, computed in float32.
    """
    q_len, q_heads, head_dim = q.shape
    kv_heads = k.shape[0]
    group = q_heads // kv_heads
    qf = q.astype(jnp.float32).reshape(q_len, kv_heads, group, head_dim)
    kf = k.astype(jnp.float32)
    vf = jnp.where(mask.any(0)[None, :, None], v.astype(jnp.float32), 0.0)
    scores = jnp.einsum("qhgd,hkd->hgqk", qf, kf) * scale
    scores = jnp.where(mask[None, None], scores, -jnp.inf)
    weights = jnp.nan_to_num(jnp.exp(scores - scores.max(-1, keepdims=True)))
    weights = weights / jnp.maximum(weights.sum(-1, keepdims=True), 1e-30)
    out = jnp.einsum("hgqk,hkd->qhgd", weights, vf)
    return out.reshape(q_len, q_heads, head_dim).astype(q.dtype)


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, *, scale=None):
    """Decode oracle. q: [seqs, q_heads, d] → [seqs, q_heads, d]."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    query_start_loc = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
    return ragged_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale=scale)


def ragged_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *, scale=None):
    """Ragged causal oracle. q: [tokens, q_heads, d] → [tokens, q_heads, d].

    Sequence i owns rows ``query_start_loc[i]:query_start_loc[i + 1]``, the last
    positions of its ``context_lens[i]`` tokens. Rows owned by no sequence are 0.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    starts = np.asarray(query_start_loc)
    lens = np.asarray(context_lens)
    tables = np.asarray(block_tables)
    out = jnp.zeros_like(q)
    for i in range(len(lens)):
        q_len = int(starts[i + 1] - starts[i])
        if q_len == 0:
            continue
        k = _gather_sequence(k_cache, tables[i])
        v = _gather_sequence(v_cache, tables[i])
        q_pos = lens[i] - q_len + np.arange(q_len)
        k_pos = np.arange(k.shape[1])
        mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < lens[i])
        rows = q[starts[i] : starts[i + 1]]
        out = out.at[starts[i] : starts[i + 1]].set(_attend(rows, k, v, jnp.asarray(mask), scale))
    return out


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """Oracle for :func:`pallas_paged.write_kv`: a Python loop over tokens."""
    k_out, v_out = np.array(k_cache), np.array(v_cache)
    block_size = k_cache.shape[2]
    for token, slot in enumerate(np.asarray(slot_mapping)):
        if slot < 0:
            continue
        block, offset = divmod(int(slot), block_size)
        k_out[:, block, offset] = np.asarray(k[token])
        v_out[:, block, offset] = np.asarray(v[token])
    return jnp.asarray(k_out), jnp.asarray(v_out)


def copy_blocks(k_cache, v_cache, src, dst):
    """Oracle for :func:`pallas_paged.copy_blocks`: copies one pair at a time."""
    k_out, v_out = np.array(k_cache), np.array(v_cache)
    for s, d in zip(np.asarray(src), np.asarray(dst)):
        if s < 0 or d < 0:
            continue
        k_out[:, d] = np.asarray(k_cache)[:, s]
        v_out[:, d] = np.asarray(v_cache)[:, s]
    return jnp.asarray(k_out), jnp.asarray(v_out)


def swap_out(k_cache, v_cache, block_ids):
    """Oracle for :func:`pallas_paged.swap_out`: ``[kv_heads, len(block_ids), block_size, d]`` each."""
    ids = np.asarray(block_ids)
    return np.asarray(k_cache)[:, ids], np.asarray(v_cache)[:, ids]


def swap_in(k_cache, v_cache, host_k, host_v, block_ids):
    """Oracle for :func:`pallas_paged.swap_in`."""
    k_out, v_out = np.array(k_cache), np.array(v_cache)
    ids = np.asarray(block_ids)
    k_out[:, ids] = np.asarray(host_k)
    v_out[:, ids] = np.asarray(host_v)
    return jnp.asarray(k_out), jnp.asarray(v_out)
