"""Whole prompts through cuDNN's flash attention on Hopper GPUs (issue 41).

A step whose every sequence computes its whole context (prompts with no cached prefix, no
chunk after an earlier one) needs nothing from the cache: its queries attend causally to the
keys and values the same step computed. cuDNN's fused flash attention takes such a batch as
one packed sequence of segments (its "THD" layout: ``q_offsets`` and ``q_seqlen``), so the
step's tokens go in as they are, in token order, without padding. Any other step, and any
other GPU, takes the paged kernel (:func:`pallas_paged.ragged_paged_attention`). The choice is
made on the device, per step (``lax.cond``), as only the step's context lengths tell.

JAX exposes the packed layout in its private ``jax._src.cudnn.fused_attention_stablehlo``
only; :func:`cudnn_attention` is the one place that calls it. ``jax.nn.dot_product_attention``
would need the prompts padded into a batch.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from pallas_paged import precision

# Before 0.12, JAX strides the packed keys' and values' segment offsets by the number of query
# heads, not their own (`_fix_seqlen_offsets`): with GQA the second segment's keys would be read
# from the wrong tokens. There, K and V get one head per query head.
KV_OFFSETS_BY_QUERY_HEADS = jax.__version_info__ < (0, 12)


def enabled(default: bool) -> bool:
    """Whether fresh prompts take cuDNN: ``PALLAS_PAGED_CUDNN_PROMPTS`` (1 or 0) if set, else
    ``default`` (:data:`pallas_paged.tiling.HOPPER`'s ``cudnn_prompts``). Read when traced."""
    value = os.environ.get("PALLAS_PAGED_CUDNN_PROMPTS")
    if value not in (None, "0", "1"):
        raise ValueError(f"PALLAS_PAGED_CUDNN_PROMPTS must be 0 or 1, not {value!r}")
    return default if value is None else value == "1"


def supports(q_dtype, cache_dtype, head_dim: int) -> bool:
    """Whether cuDNN's flash attention takes these queries: as :func:`precision.takes_query`
    allows (:func:`or_paged` makes q, k and v the cache's dtype, as the paged kernels read
    them), head size a multiple of 8 up to 256 (Hopper's limits)."""
    return precision.takes_query(q_dtype, cache_dtype) and head_dim % 8 == 0 and head_dim <= 256


def all_fresh(context_lens, query_start_loc):
    """Whether every sequence's whole context is this step's queries (bool[]): no cached
    prefix, no earlier chunk. context_lens: int32[S] (0 for padding sequences, which have no
    queries either); query_start_loc: int32[S + 1]."""
    return jnp.all(context_lens == jnp.diff(query_start_loc))


def packed_segments(query_start_loc):
    """cuDNN's packed layout of the step's sequences: (seqlens int32[1, S], offsets int32[1, S + 1]).

    Sequences with tokens come first, in order (their offsets ascend), then -1 for every
    sequence without any (padding), as cuDNN marks unused segments; the offset after the last
    real segment is its end. query_start_loc: int32[S + 1].
    """
    lens = jnp.diff(query_start_loc)
    real = lens > 0
    order = jnp.argsort(~real, stable=True)  # sequences with tokens first, in order
    count = jnp.sum(real)
    index = jnp.arange(lens.shape[0])
    seqlens = jnp.where(index < count, lens[order], -1)
    starts = jnp.where(index < count, query_start_loc[:-1][order], -1)
    offsets = jnp.concatenate([starts, jnp.full((1,), -1, starts.dtype)])
    offsets = offsets.at[count].set(query_start_loc[-1])
    return seqlens[None].astype(jnp.int32), offsets[None].astype(jnp.int32)


def cudnn_attention(q, k, v, query_start_loc, *, scale):
    """Causal attention of each sequence's queries over its own keys, cuDNN's flash attention
    on the packed tokens.

    q: [T, q_heads, d]; k, v: [T, kv_heads, d] (this step's, in token order);
    query_start_loc: int32[S + 1]. Returns [T, q_heads, d]; tokens past
    ``query_start_loc[-1]`` (padding) are zeros.
    """
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    seqlens, offsets = packed_segments(query_start_loc)
    if KV_OFFSETS_BY_QUERY_HEADS and k.shape[1] != q.shape[1]:
        k, v = (jnp.repeat(x, q.shape[1] // x.shape[1], axis=1) for x in (k, v))  # head h reads h // group
    out = cudnn.dot_product_attention(q[None], k[None], v[None], q_seqlen=seqlens, kv_seqlen=seqlens,
                                      q_offsets=offsets, kv_offsets=offsets, scale=scale,
                                      mask_type=cudnn.MaskType.CAUSAL)[0]
    owned = jnp.arange(q.shape[0]) < query_start_loc[-1]
    return jnp.where(owned[:, None, None], out, jnp.zeros((), out.dtype))


def or_paged(paged, new_kv, scale: float):
    """The CUDA branch of ragged attention with fresh prompts through cuDNN: ``paged`` (a
    function of the op's arrays) unless every sequence is fresh (:func:`all_fresh`);
    ``new_kv``: (k, v), this step's keys and values, [T, kv_heads, d] each. cuDNN gets k and v
    in the cache's dtype (the values the cache holds) and q scaled and rounded to it, as the
    paged kernels multiply them (:func:`precision.scaled_query`); the output is in q's dtype."""

    def attend(q, k_cache, v_cache, block_tables, context_lens, query_start_loc):
        def fresh():
            k16, v16 = (x.astype(k_cache.dtype) for x in new_kv)
            q16 = precision.scaled_query(q, scale, k_cache.dtype)
            return cudnn_attention(q16, k16, v16, query_start_loc, scale=1.0).astype(q.dtype)

        return jax.lax.cond(all_fresh(context_lens, query_start_loc), fresh,
                            lambda: paged(q, k_cache, v_cache, block_tables, context_lens, query_start_loc))

    return attend
