"""Tile sizes per platform: the only knobs the attention kernels have.

The kernels are one source; what differs between Triton on a GPU and
interpret mode on a CPU is how much work one program does.

* Triton wants 2-D tiles whose sides are powers of two and at least 16 for
  ``tl.dot``, and many small programs to fill the GPU: one KV head per
  program, the GQA group padded to 16 rows.
* Interpret mode runs the grid as a sequential loop of XLA ops, so fewer,
  larger programs win: all KV heads in one program, batched ``einsum``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How the attention kernels split work.

    heads_per_program: KV heads one program handles; 0 means all of them.
    keys_per_step: KV slots the inner loop aims to load per iteration (whole
        blocks, at least one).
    min_tile_rows: query tiles are zero-padded to at least this many rows.
    tokens_per_tile: query tokens of one sequence per program (ragged kernel).
    pow2: pad every tile side to a power of two (Triton requires it).
    one_by_one: read KV blocks one dynamic slice each (see ``layout.load_blocks``).
    """

    heads_per_program: int
    keys_per_step: int
    min_tile_rows: int
    tokens_per_tile: int
    pow2: bool
    one_by_one: bool

    def heads(self, num_kv_heads: int) -> int:
        """KV heads per program for a model with ``num_kv_heads``."""
        per = self.heads_per_program or num_kv_heads
        if num_kv_heads % per:
            raise ValueError(f"{num_kv_heads} KV heads do not split into programs of {per}")
        return per

    def group_rows(self, group: int, tokens: int) -> int:
        """Rows one token's GQA group of ``group`` query heads takes in a tile of ``tokens`` tokens."""
        rows = max(group, -(-self.min_tile_rows // tokens))
        return _next_pow2(rows) if self.pow2 else rows

    def blocks_per_step(self, block_size: int) -> int:
        """Whole blocks per inner-loop iteration."""
        blocks = max(1, self.keys_per_step // block_size)
        return _next_pow2(blocks) if self.pow2 else blocks


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


# Measured with benchmarks/kernels.py: 128 keys per step beats 64 and 256 in interpret mode.
CPU = Tiling(heads_per_program=0, keys_per_step=128, min_tile_rows=1, tokens_per_tile=32, pow2=False, one_by_one=True)
GPU = Tiling(heads_per_program=1, keys_per_step=16, min_tile_rows=16, tokens_per_tile=16, pow2=True, one_by_one=False)


@dataclasses.dataclass(frozen=True)
class QueryTiles:
    """Ragged query rows cut into tiles of at most ``tokens`` tokens of one sequence.

    seq, start, length: int32[num_tiles], the tile's sequence, its first query
    index within that sequence and its token count (0 for unused tiles);
    first_tile: int32[seqs]; query_start_loc: int32[seqs + 1];
    query_lens: int32[seqs].
    """

    seq: jax.Array
    start: jax.Array
    length: jax.Array
    first_tile: jax.Array
    query_start_loc: jax.Array
    query_lens: jax.Array
    tokens: int

    @staticmethod
    def max_tiles(num_tokens: int, num_seqs: int, tokens: int) -> int:
        """A static bound on the tiles ``num_tokens`` split over ``num_seqs`` can need."""
        return -(-num_tokens // tokens) + num_seqs

    @classmethod
    def build(cls, query_start_loc, tokens: int, num_tiles: int) -> "QueryTiles":
        query_lens = jnp.diff(query_start_loc)
        tiles_per_seq = -(-query_lens // tokens)
        tile_end = jnp.cumsum(tiles_per_seq)
        first_tile = (tile_end - tiles_per_seq).astype(jnp.int32)
        tile = jnp.arange(num_tiles, dtype=jnp.int32)
        seq = jnp.minimum(jnp.searchsorted(tile_end, tile, side="right"), query_lens.shape[0] - 1).astype(jnp.int32)
        start = (tile - first_tile[seq]) * tokens
        length = jnp.where(tile < tile_end[-1], jnp.clip(query_lens[seq] - start, 0, tokens), 0)
        return cls(seq, start.astype(jnp.int32), length.astype(jnp.int32), first_tile,
                   query_start_loc, query_lens.astype(jnp.int32), tokens)

    def gather(self, q, kv_heads: int, rows: int):
        """q: [tokens, q_heads, d] → [kv_heads, tiles, self.tokens * rows, d].

        Row ``t * rows + g`` of a tile is query head ``g`` of the group of its
        ``t``-th token; rows past the group size are zero.
        """
        num_tokens, q_heads, head_dim = q.shape
        group = q_heads // kv_heads
        row_token = self.query_start_loc[self.seq][:, None] + self.start[:, None] + jnp.arange(self.tokens)
        grouped = jnp.pad(q.reshape(num_tokens, kv_heads, group, head_dim), ((0, 0), (0, 0), (0, rows - group), (0, 0)))
        tiles = grouped[jnp.minimum(row_token, num_tokens - 1)]  # [tiles, tokens, kv, rows, d]
        return tiles.transpose(2, 0, 1, 3, 4).reshape(kv_heads, self.seq.shape[0], self.tokens * rows, head_dim)

    def scatter(self, out_tiles, num_tokens: int, group: int):
        """Inverse of :meth:`gather`: [kv_heads, tiles, tokens * rows, d] → [num_tokens, q_heads, d].

        Tokens owned by no sequence (padding) come out as zeros.
        """
        kv_heads, num_tiles, tile_rows, head_dim = out_tiles.shape
        token = jnp.arange(num_tokens, dtype=jnp.int32)
        seq = jnp.clip(jnp.searchsorted(self.query_start_loc, token, side="right") - 1, 0, self.first_tile.shape[0] - 1)
        index = token - self.query_start_loc[seq]
        tile = self.first_tile[seq] + index // self.tokens
        rows = tile_rows // self.tokens
        out = out_tiles.reshape(kv_heads, num_tiles, self.tokens, rows, head_dim)[:, tile, index % self.tokens, :group]
        out = jnp.where((token < self.query_start_loc[-1])[None, :, None, None], out, 0)
        return out.transpose(1, 0, 2, 3).reshape(num_tokens, kv_heads * group, head_dim)
