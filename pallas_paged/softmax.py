"""Online softmax over KV tiles, shared by the attention kernels.

Works on 2-D tiles (Triton and Mosaic: ``q[rows, d]``, ``k[keys, d]``) and on
tiles with a leading head axis (interpret mode: ``q[heads, rows, d]``).
Statistics and accumulators are float32, and every intermediate is at least
2-D with row statistics kept as ``[..., rows, 1]``: Mosaic cannot reshape 1-D masks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_paged.precision import for_operands

# Finite, so a row that sees only masked keys yields zeros instead of NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def _scores(q, k):
    """q: [..., rows, d], k: [..., keys, d] → float32 [..., rows, keys], in k's dtype."""
    q, precision = q.astype(k.dtype), for_operands(k.dtype)
    if q.ndim == 2:
        return jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)
    return jnp.einsum("hrd,hkd->hrk", q, k, precision=precision, preferred_element_type=jnp.float32)


def _weighted_sum(p, v):
    """p: [..., rows, keys], v: [..., keys, d] → float32 [..., rows, d], in v's dtype."""
    p, precision = p.astype(v.dtype), for_operands(v.dtype)
    if p.ndim == 2:
        return jnp.dot(p, v, precision=precision, preferred_element_type=jnp.float32)
    return jnp.einsum("hrk,hkd->hrd", p, v, precision=precision, preferred_element_type=jnp.float32)


def initial_state(q):
    """Empty accumulators for query tile ``q[..., rows, d]``: (acc, row max, row sum)."""
    stats_shape = q.shape[:-1] + (1,)
    return (
        jnp.zeros(q.shape, jnp.float32),
        jnp.full(stats_shape, -jnp.inf, jnp.float32),
        jnp.zeros(stats_shape, jnp.float32),
    )


def update(state, q, k, v, first_key, context_len, query_pos=None):
    """Fold one KV tile, holding positions ``first_key + [0, keys)``, into the running softmax.

    q: [..., rows, d] float32, already scaled; k, v: [..., keys, d].
    Slots at or past ``context_len`` are masked, and zeroed in ``v``: their
    block may be stale or unreferenced. query_pos: optional int32[rows, 1],
    each row's position, for a causal mask. The products run in the cache's
    dtype with float32 accumulation: converting K and V tiles to float32 lets
    XLA hoist the conversion of the whole cache out of the loop.
    """
    acc, row_max, row_sum = state
    keys = k.shape[-2]
    key_pos = first_key + jax.lax.broadcasted_iota(jnp.int32, (1, keys), 1)
    key_pos_col = first_key + jax.lax.broadcasted_iota(jnp.int32, (keys, 1), 0)
    v = jnp.where(key_pos_col < context_len, v, jnp.zeros((), v.dtype))
    visible = key_pos < context_len
    if query_pos is not None:
        visible = visible & (key_pos <= query_pos)
    scores = jnp.where(visible, _scores(q, k), MASK_VALUE)
    new_max = jnp.maximum(row_max, scores.max(axis=-1, keepdims=True))
    probs = jnp.exp(scores - new_max)
    correction = jnp.exp(row_max - new_max)
    row_sum = row_sum * correction + probs.sum(axis=-1, keepdims=True)
    acc = acc * correction + _weighted_sum(probs, v)
    return acc, new_max, row_sum


def finish(state):
    """Normalised output [..., rows, d]; rows that saw nothing are 0."""
    acc, _, row_sum = state
    return acc / jnp.where(row_sum == 0.0, 1.0, row_sum)
