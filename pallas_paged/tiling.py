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
    dynamic_grid: launch only the programs with work (the grid size is a traced value).
        Interpret mode pays tens of microseconds for every program, even an empty one, so
        padding sequences and unused tiles must not get programs; Triton needs a static grid.
    target_programs: decode programs it takes to fill the device; with fewer (sequences x
        KV-head programs), each sequence's keys are split over several programs whose
        partial softmaxes are merged after (flash-decoding; :meth:`decode_splits`). 0: never.
    """

    heads_per_program: int
    keys_per_step: int
    min_tile_rows: int
    tokens_per_tile: int
    pow2: bool
    one_by_one: bool
    dynamic_grid: bool
    target_programs: int = 0

    def decode_splits(self, programs: int, max_steps: int) -> int:
        """Programs per (sequence, KV heads) in a decode of ``programs`` such pairs whose
        longest context takes ``max_steps`` loop steps: enough to reach ``target_programs``,
        at most one per step."""
        if not self.target_programs or programs >= self.target_programs:
            return 1
        return max(1, min(-(-self.target_programs // programs), max_steps))

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
CPU = Tiling(heads_per_program=0, keys_per_step=128, min_tile_rows=1, tokens_per_tile=32, pow2=False, one_by_one=True,
             dynamic_grid=True)
# Not measured yet (no GPU since): 64 keys per step (4 blocks of 16 gathered through the table)
# instead of one block, and decodes split to two programs per SM of an H100 (132), as issue 41
# reasons from the profile of the 16-key, unsplit kernel (GPU_BEFORE_ISSUE_41), which on an H100
# paid 1.44-3.46x dense attention. `make bench-gpu` times both (benchmarks/gpu_kernels.py).
GPU = Tiling(heads_per_program=1, keys_per_step=64, min_tile_rows=16, tokens_per_tile=16, pow2=True, one_by_one=False,
             dynamic_grid=False, target_programs=2 * 132)
GPU_BEFORE_ISSUE_41 = dataclasses.replace(GPU, keys_per_step=16, target_programs=0)


@dataclasses.dataclass(frozen=True)
class HopperTiling:
    """The Mosaic GPU kernels' knobs (:mod:`pallas_paged.hopper`: decode and ragged).

    keys_per_step: keys of one step's tile (whole blocks; a multiple of 64, a wgmma's width).
    stages: tiles in shared memory at once, the next ones copying while one is computed.
    target_programs: as :class:`Tiling`'s: decodes with fewer programs split (flash-decoding).
    generation: the GPU generation (compute capability's major version) they are written for:
        9, Hopper (wgmma is sm_90a's; Blackwell, 10, has tcgen05 instead).
    enabled: whether such GPUs run them unless told otherwise (``PALLAS_PAGED_GPU_ATTENTION``).
    cudnn_prompts: whether such GPUs run a step of whole fresh prompts through cuDNN's flash
        attention instead (:mod:`pallas_paged.prompts`; ``PALLAS_PAGED_CUDNN_PROMPTS``).

    A ragged tile is always 64 query rows (a wgmma's height): 64 tokens without GQA, 16 with
    groups of 3 or 4 query heads (padded to 4).
    """

    keys_per_step: int
    stages: int
    target_programs: int
    generation: int
    enabled: bool
    cudnn_prompts: bool = False

    def decode_splits(self, programs: int, max_steps: int) -> int:
        """As :meth:`Tiling.decode_splits`, with this ``target_programs``."""
        return dataclasses.replace(GPU, target_programs=self.target_programs).decode_splits(programs, max_steps)


# Not measured: no GPU has run these kernels yet. 64 keys (a wgmma's width) and 2 tiles in flight
# keep 64 KB of K and V per program (bfloat16, head size 128) in shared memory: 80-84 KB with the
# query rows, so two programs fit an SM's 227 KB (`make test-accel` compiles them for an H100,
# which refuses a kernel over it; splits write their partial outputs in q's dtype, as vLLM's do,
# to stay there). Splits as the Triton kernel's, which count on two programs an SM. Off by
# default until `make bench-gpu` has timed them against the Triton kernels, dense attention and
# cuDNN on an H100 (benchmarks/gpu_kernels.py: the "Mosaic GPU" columns) and `make test-gpu` has
# checked them compiled against the oracle; then `enabled` records that measurement.
# `PALLAS_PAGED_GPU_ATTENTION=mosaic` runs them now. cuDNN for fresh prompts: off until measured
# alike (the prefill table's "cuDNN prompts" column); `PALLAS_PAGED_CUDNN_PROMPTS=1` runs it now.
HOPPER = HopperTiling(keys_per_step=64, stages=2, target_programs=2 * 132, generation=9, enabled=False)


@dataclasses.dataclass(frozen=True)
class QueryTiles:
    """Ragged query rows cut into tiles of at most ``tokens`` tokens of one sequence.

    seq, start, length: int32[num_tiles], the tile's sequence, its first query
    index within that sequence and its token count (0 for unused tiles, which
    come last); first_token: int32[num_tiles], the tile's first row of ``q``;
    first_tile: int32[seqs]; query_start_loc: int32[seqs + 1];
    query_lens: int32[seqs].
    """

    seq: jax.Array
    start: jax.Array
    length: jax.Array
    first_token: jax.Array
    first_tile: jax.Array
    query_start_loc: jax.Array
    query_lens: jax.Array
    tokens: int

    @staticmethod
    def max_tiles(num_tokens: int, num_seqs: int, tokens: int) -> int:
        """A static bound on the tiles ``num_tokens`` split over ``num_seqs`` can need."""
        return -(-num_tokens // tokens) + num_seqs

    @property
    def num_used(self):
        """Tiles holding at least one token (they come first): a traced int32 scalar."""
        return jnp.sum(self.length > 0).astype(jnp.int32)

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
        first_token = (query_start_loc[seq] + start).astype(jnp.int32)
        return cls(seq, start.astype(jnp.int32), length.astype(jnp.int32), first_token, first_tile,
                   query_start_loc, query_lens.astype(jnp.int32), tokens)

    def grouped(self, q, kv_heads: int, rows: int):
        """q: [tokens, q_heads, d] → [kv_heads, (tokens + self.tokens) * rows, d].

        Row ``t * rows + g`` holds query head ``g`` of KV head's group for token ``t``, so a
        tile's rows are contiguous: ``first_token * rows`` onwards. Rows past the group size,
        and one tile of tokens at the end (so no tile reads past the array), are zero.
        """
        num_tokens, q_heads, head_dim = q.shape
        group = q_heads // kv_heads
        grouped = q.reshape(num_tokens, kv_heads, group, head_dim).transpose(1, 0, 2, 3)
        grouped = jnp.pad(grouped, ((0, 0), (0, self.tokens), (0, rows - group), (0, 0)))
        return grouped.reshape(kv_heads, (num_tokens + self.tokens) * rows, head_dim)

    def scatter(self, out_tiles, num_tokens: int, group: int):
        """Per-tile outputs [kv_heads, tiles, self.tokens * rows, d] (rows laid out as in
        :meth:`grouped`) → [num_tokens, q_heads, d].

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
