"""How KV blocks are laid out in memory: the one place that knows it.

Per layer the cache is two arrays, ``k_cache`` and ``v_cache``, each
``[num_kv_heads, num_blocks, block_size, head_dim]``. Token ``offset`` of
physical block ``block`` lives in slot ``block * block_size + offset``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """Shape and dtype of a model's paged KV cache (all layers)."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    dtype: jnp.dtype = jnp.float32

    def __post_init__(self):
        for field in ("num_blocks", "block_size", "num_kv_heads", "head_dim", "num_layers"):
            if getattr(self, field) < 1:
                raise ValueError(f"KVCacheSpec.{field} must be >= 1, got {getattr(self, field)}")

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        """Shape of one layer's K (or V) array."""
        return (self.num_kv_heads, self.num_blocks, self.block_size, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block costs over all layers, K and V together."""
        per_layer = self.num_kv_heads * self.block_size * self.head_dim * jnp.dtype(self.dtype).itemsize
        return 2 * self.num_layers * per_layer

    @property
    def num_slots(self) -> int:
        """Tokens the cache can hold."""
        return self.num_blocks * self.block_size

    def allocate(self, sharding: jax.sharding.Sharding | None = None) -> list[tuple[jax.Array, jax.Array]]:
        """Zeroed ``(k_cache, v_cache)`` per layer, each ``[kv_heads, blocks, block_size, head_dim]``."""
        make = jax.jit(lambda: jnp.zeros(self.layer_shape, self.dtype), out_shardings=sharding)
        return [(make(), make()) for _ in range(self.num_layers)]


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Number of blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


def load_blocks(cache_ref, heads, block_tables_ref, seq, first, count: int, *, one_by_one: bool):
    """Read ``count`` consecutive logical blocks of sequence ``seq``, inside a kernel.

    cache_ref: ref to ``[kv_heads, num_blocks, block_size, d]``; heads: an int
    (one head) or a ``pl.ds`` slice of heads; block_tables_ref: ref to
    int32[seqs, max_blocks]; first: the first logical block. Returns
    ``[count * block_size, d]`` (or ``[heads, count * block_size, d]``).

    ``one_by_one`` reads each block with its own dynamic slice and
    concatenates them: in interpret mode a vector-indexed read becomes an
    element-by-element gather, several times slower. Triton wants the single
    vector-indexed read (it has no concatenate).
    """
    if one_by_one:
        blocks = [cache_ref[heads, block_tables_ref[seq, first + j]] for j in range(count)]
        return jnp.concatenate(blocks, axis=-2)
    block_ids = block_tables_ref[seq, pl.ds(first, count)]
    blocks = cache_ref[heads, block_ids]
    *lead, n, block_size, head_dim = blocks.shape
    return blocks.reshape(*lead, n * block_size, head_dim)

