"""Online softmax over KV tiles, shared by the attention kernels.

Works on 2-D tiles (Triton: ``q[rows, d]``, ``k[keys, d]``) and on tiles
with a leading head axis (interpret mode: ``q[heads, rows, d]``).
Everything is float32.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# Finite, so a row that sees only masked keys yields zeros instead of NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def _scores(q, k):
    """q: [..., rows, d], k: [..., keys, d] → [..., rows, keys]."""
    if q.ndim == 2:
        return jnp.dot(q, k.T)
    return jnp.einsum("hrd,hkd->hrk", q, k)


def _weighted_sum(p, v):
    """p: [..., rows, keys], v: [..., keys, d] → [..., rows, d]."""
    if p.ndim == 2:
        return jnp.dot(p, v)
    return jnp.einsum("hrk,hkd->hrd", p, v)


def initial_state(q):
    """Empty accumulators for query tile ``q[..., rows, d]``: (acc, row max, row sum)."""
    rows_shape = q.shape[:-1]
    return (
        jnp.zeros(q.shape, jnp.float32),
        jnp.full(rows_shape, -jnp.inf, jnp.float32),
        jnp.zeros(rows_shape, jnp.float32),
    )


def update(state, q, k, v, key_valid, causal=None):
    """Fold one KV tile into the running softmax.

    q: [..., rows, d] float32, already scaled; k, v: [..., keys, d];
    key_valid: bool[keys], False for slots past the context (their block may
    be stale or unreferenced, so they are zeroed in ``v`` before use);
    causal: optional bool[rows, keys], True where the row's query may see the key.
    """
    acc, row_max, row_sum = state
    v = jnp.where(key_valid[:, None], v.astype(jnp.float32), 0.0)
    visible = key_valid[None, :] if causal is None else causal & key_valid[None, :]
    scores = jnp.where(visible, _scores(q, k.astype(jnp.float32)), MASK_VALUE)
    new_max = jnp.maximum(row_max, scores.max(axis=-1))
    probs = jnp.exp(scores - new_max[..., None])
    correction = jnp.exp(row_max - new_max)
    row_sum = row_sum * correction + probs.sum(axis=-1)
    acc = acc * correction[..., None] + _weighted_sum(probs, v)
    return acc, new_max, row_sum


def finish(state):
    """Normalised output [..., rows, d]; rows that saw nothing are 0."""
    acc, _, row_sum = state
    return acc / jnp.where(row_sum == 0.0, 1.0, row_sum)[..., None]
