"""Dense ``jnp`` oracles for every op in :mod:`pallas_paged`.

They are written for clarity, not speed: each gathers a sequence's blocks into
a contiguous array and does textbook attention. Tests compare kernels with
these; nothing else should call them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_EXACT = jax.lax.Precision.HIGHEST  # float32 products, not TF32, on GPUs too (see pallas_paged.precision)


@jax.jit
def _attend(q, k, v, mask, scale):
    """Masked softmax attention, batched over sequences, in float32.

    q: [seqs, q_len, q_heads, d]; k, v: [seqs, kv_heads, kv_len, d];
    mask: bool[seqs, q_len, kv_len]. Returns [seqs, q_len, q_heads, d].
    """
    seqs, q_len, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    qf = q.astype(jnp.float32).reshape(seqs, q_len, kv_heads, q_heads // kv_heads, head_dim)
    seen = mask.any(1)[:, None, :, None]
    vf = jnp.where(seen, v.astype(jnp.float32), 0.0)
    scores = jnp.einsum("sqhgd,shkd->shgqk", qf, k.astype(jnp.float32), precision=_EXACT) * scale
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1, where=mask[:, None, None])
    weights = jnp.where(mask[:, None, None], weights, 0.0)
    out = jnp.einsum("shgqk,shkd->sqhgd", weights, vf, precision=_EXACT)
    return out.reshape(seqs, q_len, q_heads, head_dim)


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, *, scale=None):
    """Decode oracle. q: [seqs, q_heads, d] → [seqs, q_heads, d]."""
    query_start_loc = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
    return ragged_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale=scale)


def ragged_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *, scale=None):
    """Ragged causal oracle. q: [tokens, q_heads, d] → [tokens, q_heads, d].

    Sequence i owns rows ``query_start_loc[i]:query_start_loc[i + 1]``, the last
    positions of its ``context_lens[i]`` tokens. Rows owned by no sequence are 0.
    Each sequence's blocks are gathered into a contiguous cache, its queries
    padded to the longest, and everything attended in one dense einsum.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    starts, lens = np.asarray(query_start_loc), np.asarray(context_lens)
    query_lens = np.diff(starts)
    kv_heads, _, block_size, head_dim = k_cache.shape
    max_q = max(int(query_lens.max(initial=0)), 1)
    row = np.minimum(starts[:-1, None] + np.arange(max_q), q.shape[0] - 1)  # [seqs, max_q]
    q_pos = lens[:, None] - query_lens[:, None] + np.arange(max_q)
    k_pos = np.arange(block_tables.shape[1] * block_size)
    mask = (k_pos <= q_pos[:, :, None]) & (k_pos < lens[:, None, None])
    mask &= (np.arange(max_q) < query_lens[:, None])[:, :, None]

    def contiguous(cache):  # [seqs, kv_heads, max_blocks * block_size, d]
        return cache[:, block_tables].transpose(1, 0, 2, 3, 4).reshape(len(lens), kv_heads, -1, head_dim)

    out = _attend(q[row], contiguous(k_cache), contiguous(v_cache), jnp.asarray(mask), scale)
    owner = np.searchsorted(starts, np.arange(q.shape[0]), side="right") - 1
    owned = np.arange(q.shape[0]) < starts[-1]
    index = np.where(owned, np.arange(q.shape[0]) - starts[np.clip(owner, 0, len(lens) - 1)], 0)
    result = out[np.clip(owner, 0, len(lens) - 1), index]
    return jnp.where(owned[:, None, None], result, 0).astype(q.dtype)


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
