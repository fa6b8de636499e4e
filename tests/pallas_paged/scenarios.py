"""Random paged KV caches for kernel tests: shuffled block tables, NaN everywhere unreferenced."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Scenario:
    """Inputs of one ragged attention call; see ``make``."""

    q: jnp.ndarray  # [tokens, q_heads, d]
    k_cache: jnp.ndarray  # [kv_heads, blocks, block_size, d]
    v_cache: jnp.ndarray
    block_tables: jnp.ndarray  # int32[seqs, max_blocks]
    context_lens: jnp.ndarray  # int32[seqs]
    query_start_loc: jnp.ndarray  # int32[seqs + 1]

    @property
    def decode_args(self):
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens

    @property
    def ragged_args(self):
        return (*self.decode_args, self.query_start_loc)

    def new_kv(self):
        """The step's own keys and values as the model would pass them (``new_kv``): each
        query token's K and V, read from its slot, in token order; zeros for padding tokens.
        (k, v), each [tokens, kv_heads, d]."""
        starts, lens = np.asarray(self.query_start_loc), np.asarray(self.context_lens)
        tables, block_size = np.asarray(self.block_tables), self.k_cache.shape[2]
        k_cache, v_cache = (np.asarray(c.astype(jnp.float32)) for c in (self.k_cache, self.v_cache))
        k, v = (np.zeros((self.q.shape[0], *c.shape[::3]), np.float32) for c in (k_cache, v_cache))
        for seq in range(len(lens)):
            for token in range(starts[seq], starts[seq + 1]):
                position = lens[seq] - (starts[seq + 1] - token)
                block, offset = tables[seq, position // block_size], position % block_size
                k[token], v[token] = k_cache[:, block, offset], v_cache[:, block, offset]
        return jnp.asarray(k, self.q.dtype), jnp.asarray(v, self.q.dtype)


def make(seqs, *, q_heads, kv_heads, head_dim, block_size, dtype=jnp.float32, padding_tokens=0, seed=0):
    """Build a scenario for ``seqs``, a list of (context_len, query_len).

    Blocks are drawn in random order from a pool with spare blocks; every
    block no sequence references, and every slot past a context, is NaN, and
    unused block-table entries point at NaN blocks, so any stray read shows.
    """
    rng = np.random.default_rng(seed)
    needed = [-(-ctx // block_size) for ctx, _ in seqs]
    max_blocks = max(max(needed), 1) + 1
    num_blocks = sum(needed) + 3
    order = rng.permutation(num_blocks)
    spare = order[sum(needed):]
    tables = rng.choice(spare, size=(len(seqs), max_blocks)).astype(np.int32)
    shape = (kv_heads, num_blocks, block_size, head_dim)
    k_cache = np.full(shape, np.nan, np.float32)
    v_cache = np.full(shape, np.nan, np.float32)
    used = 0
    for i, (ctx, _) in enumerate(seqs):
        blocks = order[used : used + needed[i]]
        used += needed[i]
        tables[i, : len(blocks)] = blocks
        for j, block in enumerate(blocks):
            filled = min(block_size, ctx - j * block_size)
            k_cache[:, block, :filled] = rng.standard_normal((kv_heads, filled, head_dim))
            v_cache[:, block, :filled] = rng.standard_normal((kv_heads, filled, head_dim))
    query_lens = [q_len for _, q_len in seqs]
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    q = rng.standard_normal((int(starts[-1]) + padding_tokens, q_heads, head_dim)).astype(np.float32)
    return Scenario(
        q=jnp.asarray(q, dtype),
        k_cache=jnp.asarray(k_cache, dtype),
        v_cache=jnp.asarray(v_cache, dtype),
        block_tables=jnp.asarray(tables),
        context_lens=jnp.asarray([ctx for ctx, _ in seqs], jnp.int32),
        query_start_loc=jnp.asarray(starts),
    )


def decode_seqs(context_lens):
    """One query token per sequence."""
    return [(ctx, 1) for ctx in context_lens]


TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}  # bf16: inputs rounded, math in f32, output rounded


def assert_close(actual, expected, dtype):
    """A kernel's output against the oracle's, at ``dtype``'s tolerance, with no NaN or inf
    (which would mean a read of a block or slot the kernel must not touch)."""
    actual = np.asarray(actual.astype(jnp.float32))
    expected = np.asarray(expected.astype(jnp.float32))
    assert np.isfinite(actual).all(), "kernel output has NaN/inf: it read a block it should not have"
    np.testing.assert_allclose(actual, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
