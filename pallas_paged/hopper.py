"""Paged attention for Hopper (sm90), in Mosaic GPU (issue 41): decode and ragged.

One program (a warpgroup) per (KV head, sequence[, split]) in decode, per (KV head, query
tile) in ragged attention. The sequence's KV blocks are brought from the cache into shared
memory by TMA copies, ``blocks_per_step`` blocks of the block table per step, into a ring of
``stages`` buffers filled ahead of the step that reads them. Each step is two warpgroup matrix
products (wgmma) with the online softmax between them in registers: the program's 64 query
rows (the GQA group's heads, zero-padded, in decode; in ragged attention a tile of tokens,
each with its group's heads) against the tile's keys, and the probabilities against its
values. When (KV heads x sequences) would leave SMs idle, a decode splits each sequence's
steps over several programs and merges them after (flash-decoding), as :mod:`decode` does.

Both keep the Triton kernels' arrays and numerics contract: products in the cache's dtype
with float32 accumulation, float32 softmax, rows that see no key return zeros. They run
compiled on a Hopper, and on a CPU in Mosaic GPU's interpret mode (:func:`interpret_params`),
which simulates shared memory, TMA and barriers; tests check them there against the oracle.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_paged import decode, precision
from pallas_paged.tiling import QueryTiles

ROWS = 64  # a wgmma's M: the query rows of one program (the GQA group, zero-padded)
_LOG2E = math.log2(math.e)


def supports(q_dtype, cache_dtype, q_heads: int, kv_heads: int, head_dim: int, block_size: int,
             keys_per_step: int) -> bool:
    """Whether the kernels take these shapes: queries :func:`precision.takes_query` allows
    (the public wrappers make a float32 query the cache's dtype, as the Triton kernels make it
    for their products), head size 64 or 128 (whole 128-byte swizzled rows; 256 would
    not fit a split decode's shared memory), blocks of at least 8 keys that tile a step of at
    most 256 keys (a wgmma's widest), and a GQA group of at most :data:`ROWS` query heads."""
    return (precision.takes_query(q_dtype, cache_dtype) and head_dim in (64, 128) and block_size % 8 == 0
            and keys_per_step % block_size == 0 and keys_per_step in (64, 128, 192, 256)
            and q_heads // kv_heads <= ROWS)


def interpret_params():
    """Mosaic GPU's interpret mode (a CPU simulating the GPU's memories and barriers)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


@dataclasses.dataclass(frozen=True)
class _Layouts:
    """What differs between compiled and interpret mode: register layouts of the arrays a
    program holds (a wgmma's accumulator, ``tile``, and its row statistics, ``rows``), which
    interpret mode does not have, and the two products, which interpret mode's wgmma does not
    take in these forms (a transposed operand; one in registers)."""

    interpret: bool

    def tile(self, x):
        return x if self.interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA)

    def rows(self, x):
        return x if self.interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1))

    def scores(self, q_smem, k_tile):
        """q_smem [rows, d] @ k_tile [keys, d]ᵀ → float32 [rows, keys]: one wgmma; in interpret
        mode, whose wgmma takes no transposed operand, XLA's product of the same values."""
        if self.interpret:
            return jax.lax.dot_general(q_smem[...], k_tile[...], (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)

        def product(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_tile.transpose((1, 0)))
            return acc_ref[...]

        return pl.run_scoped(product, plgpu.ACC((q_smem.shape[0], k_tile.shape[0]), jnp.float32))

    def weighted(self, probs, v_tile):
        """probs (float32 [rows, keys], registers) @ v_tile [keys, d] → float32 [rows, d], the
        probabilities rounded to the cache's dtype: one wgmma, or XLA's product in interpret
        mode (whose wgmma takes no operand from registers)."""
        probs = probs.astype(v_tile.dtype)
        if self.interpret:
            return jnp.dot(probs, v_tile[...], preferred_element_type=jnp.float32)

        def product(acc_ref):
            plgpu.wgmma(acc_ref, probs, v_tile)
            return acc_ref[...]

        return pl.run_scoped(product, plgpu.ACC((probs.shape[0], v_tile.shape[1]), jnp.float32))

    def iota(self, shape, axis):
        if self.interpret:
            return jax.lax.broadcasted_iota(jnp.int32, shape, axis)
        return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)


@dataclasses.dataclass(frozen=True)
class _Program:
    """One program's view: its sequence and KV head, the cache, the shared-memory ring and its
    barriers (``k_ready``, ``v_ready``: a barrier per slot, one arrival per block copied)."""

    seq: jax.Array
    head: jax.Array
    context_len: jax.Array
    tables_ref: object
    k_ref: object
    v_ref: object
    k_smem: object
    v_smem: object
    k_ready: object
    v_ready: object
    blocks_per_step: int
    stages: int
    scale: float
    layouts: _Layouts
    first_query_pos: jax.Array | None = None  # ragged: row r's query is at first_query_pos + r // rows_per_token
    rows_per_token: int = 1

    @property
    def keys(self) -> int:
        """Keys in one step's tile."""
        return self.blocks_per_step * self.k_ref.shape[2]

    def fetch(self, step):
        """Start copying step ``step``'s blocks into its slot. Blocks past the context are
        read as the last block of the context instead (any valid block: their keys are masked)."""
        block_size = self.k_ref.shape[2]
        slot, last_block = jax.lax.rem(step, self.stages), jnp.maximum(pl.cdiv(self.context_len, block_size) - 1, 0)
        for j in range(self.blocks_per_step):
            block = self.tables_ref[self.seq, jnp.minimum(step * self.blocks_per_step + j, last_block)]
            rows = pl.ds(j * block_size, block_size)
            plgpu.copy_gmem_to_smem(self.k_ref.at[self.head, block], self.k_smem.at[slot, rows], self.k_ready.at[slot])
            plgpu.copy_gmem_to_smem(self.v_ref.at[self.head, block], self.v_smem.at[slot, rows], self.v_ready.at[slot])

    def step(self, q_smem, last, i, carry):
        """Fold step ``i``'s tile into the online softmax (base 2) ``carry``: (acc [rows, d],
        row maxima and sums [rows]); then refill its slot with step ``i + stages`` (< ``last``)."""
        acc, row_max, row_sum = carry
        slot, keys = jax.lax.rem(i, self.stages), self.keys
        plgpu.barrier_wait(self.k_ready.at[slot])
        scores = self.layouts.scores(q_smem, self.k_smem.at[slot])
        key_pos = i * keys + self.layouts.iota(scores.shape, 1)
        visible = key_pos < self.context_len
        if self.first_query_pos is not None:  # causal
            visible &= key_pos <= self.first_query_pos + self.layouts.iota(scores.shape, 0) // self.rows_per_token
        scores = jnp.where(visible, scores * (self.scale * _LOG2E), -jnp.inf)
        new_max = jnp.maximum(row_max, scores.max(axis=1))
        correction = jnp.exp2(row_max - new_max)
        probs = jnp.exp2(scores - jax.lax.broadcast_in_dim(new_max, scores.shape, [0]))
        row_sum = row_sum * correction + probs.sum(axis=1)
        plgpu.barrier_wait(self.v_ready.at[slot])
        pl.when((i + 1) * keys > self.context_len)(
            functools.partial(_zero_past, self.v_smem.at[slot], i * keys, self.context_len, self.layouts))
        acc = acc * jax.lax.broadcast_in_dim(correction, acc.shape, [0]) + self.layouts.weighted(
            probs, self.v_smem.at[slot])
        pl.when(i + self.stages < last)(functools.partial(self.fetch, i + self.stages))  # the slot is read
        return acc, new_max, row_sum

    def attend(self, q_smem, q_ready, q_source, first, last):
        """Fill the ring's first slots, copy ``q_source`` ([rows, d] in memory, at most
        :data:`ROWS`; the rest of ``q_smem`` zero) into ``q_smem``, and fold steps ``first`` to
        ``last`` → (acc [ROWS, d], row maxima and sums [ROWS], base 2)."""
        for ahead in range(self.stages):
            pl.when(first + ahead < last)(functools.partial(self.fetch, first + ahead))
        rows, head_dim = q_source.shape
        if rows < ROWS:
            q_smem[...] = self.layouts.tile(jnp.zeros((ROWS, head_dim), q_smem.dtype))
            plgpu.commit_smem()
        plgpu.copy_gmem_to_smem(q_source, q_smem.at[pl.ds(0, rows)], q_ready)
        plgpu.barrier_wait(q_ready)
        state = (self.layouts.tile(jnp.zeros((ROWS, head_dim), jnp.float32)),
                 self.layouts.rows(jnp.full((ROWS,), -jnp.inf, jnp.float32)),
                 self.layouts.rows(jnp.zeros((ROWS,), jnp.float32)))
        return jax.lax.fori_loop(first, last, functools.partial(self.step, q_smem, last), state)


def _scoped(body, q_dtype, cache_dtype, head_dim: int, keys: int, blocks_per_step: int, stages: int, *extra):
    """Run ``body(q_smem, k_smem, v_smem, *extra, q_ready, k_ready, v_ready)`` with the
    program's shared memory: the query rows, the ring of K and V tiles, ``extra`` buffers, and
    the barriers."""
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    pl.run_scoped(
        body,
        plgpu.SMEM((ROWS, head_dim), q_dtype, transforms=transforms),
        plgpu.SMEM((stages, keys, head_dim), cache_dtype, transforms=transforms),
        plgpu.SMEM((stages, keys, head_dim), cache_dtype, transforms=transforms),
        *extra,
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_arrivals=blocks_per_step, num_barriers=stages),
        plgpu.Barrier(num_arrivals=blocks_per_step, num_barriers=stages),
    )


def _decode_kernel(tables_ref, lens_ref, q_ref, k_ref, v_ref, *out_refs, blocks_per_step, stages, splits, scale,
                   interpret):
    """Body of one decode program; ``out_refs``: the output ([seqs, kv_heads, rows, d]), or
    with splits each split's normalised output (q's dtype), its row maxima and sums (float32)
    ([splits, seqs, kv_heads, rows(, d)])."""
    keys, head_dim = blocks_per_step * k_ref.shape[2], k_ref.shape[3]
    head, seq = jax.lax.axis_index("heads"), jax.lax.axis_index("seqs")
    context_len = lens_ref[seq]
    first, last = 0, pl.cdiv(context_len, keys)
    split = jax.lax.axis_index("splits") if splits > 1 else None
    if split is not None:  # flash-decoding: one of ``splits`` equal runs of the steps
        per_split = pl.cdiv(last, splits)
        first, last = split * per_split, jnp.minimum((split + 1) * per_split, last)

    def body(q_smem, k_smem, v_smem, stats_smem, q_ready, k_ready, v_ready):
        program = _Program(seq, head, context_len, tables_ref, k_ref, v_ref, k_smem, v_smem, k_ready, v_ready,
                           blocks_per_step, stages, scale, _Layouts(interpret))
        state = program.attend(q_smem, q_ready, q_ref.at[seq, head], first, last)
        _store(out_refs, q_smem, stats_smem, *state, seq, head, q_ref.shape[2], split)

    _scoped(body, q_ref.dtype, k_ref.dtype, head_dim, keys, blocks_per_step, stages,
            plgpu.SMEM((2, ROWS), jnp.float32))


def _ragged_kernel(tile_seq_ref, tile_start_ref, tile_len_ref, tables_ref, lens_ref, query_lens_ref,
                   q_ref, k_ref, v_ref, o_ref, *, blocks_per_step, stages, rows_per_token, scale, interpret):
    """Body of one ragged program: the tile's ``ROWS // rows_per_token`` tokens of one
    sequence (q_ref: [tiles, kv_heads, ROWS, d], each tile's rows gathered whole: a TMA copy
    from a dynamic row offset would be cut at the 8-row tiles TMA sees in memory), attending
    causally to their sequence's keys; o_ref: [tiles, kv_heads, ROWS, d]. Unused tiles (no
    tokens) write nothing."""
    keys, head_dim = blocks_per_step * k_ref.shape[2], k_ref.shape[3]
    head, tile = jax.lax.axis_index("heads"), jax.lax.axis_index("tiles")
    seq, length = tile_seq_ref[tile], tile_len_ref[tile]
    context_len = lens_ref[seq]
    first_pos = context_len - query_lens_ref[seq] + tile_start_ref[tile]

    def body(q_smem, k_smem, v_smem, q_ready, k_ready, v_ready):
        program = _Program(seq, head, context_len, tables_ref, k_ref, v_ref, k_smem, v_smem, k_ready, v_ready,
                           blocks_per_step, stages, scale, _Layouts(interpret), first_pos, rows_per_token)
        acc, _, row_sum = program.attend(q_smem, q_ready, q_ref.at[tile, head], 0, pl.cdiv(first_pos + length, keys))
        _write_normalised(q_smem, acc, row_sum, o_ref.at[tile, head], ROWS)

    pl.when(length > 0)(functools.partial(_scoped, body, q_ref.dtype, k_ref.dtype, head_dim, keys, blocks_per_step,
                                          stages))


def _zero_past(v_tile, first_key, context_len, layouts):
    """Zero the rows of V tile ``v_tile`` (shared memory, [keys, d]) at or past
    ``context_len``: stale or never written, they may hold NaN, which a zero probability
    does not cancel in the product."""
    v = v_tile[...]
    key_pos = first_key + layouts.iota(v.shape, 0)
    v_tile[...] = jnp.where(key_pos < context_len, v, jnp.zeros((), v.dtype))
    plgpu.commit_smem()


def _write_normalised(o_smem, acc, row_sum, o_rows, rows: int):
    """The softmax's output ``acc / row_sum`` (zeros where no key was seen) through ``o_smem``
    into ``o_rows`` (memory, [rows, d]: the first ``rows`` rows)."""
    row_sum = jnp.where(row_sum == 0.0, 1.0, row_sum)
    o_smem[...] = (acc / jax.lax.broadcast_in_dim(row_sum, acc.shape, [0])).astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows)], o_rows)
    plgpu.wait_smem_to_gmem(0)


def _store(out_refs, o_smem, stats_smem, acc, row_max, row_sum, seq, head, group_rows, split):
    """Write the program's rows, normalised; with splits, into its split's slot, with the row
    maxima and sums the merge weighs them by. The partial outputs are in q's dtype, as vLLM's
    split decode keeps them: a float32 accumulator would take another 32 KB of shared memory
    (one program an SM at head size 128, not two) and twice the writes."""
    if split is None:
        _write_normalised(o_smem, acc, row_sum, out_refs[0].at[seq, head], group_rows)
        return
    partial_ref, max_ref, sum_ref = out_refs
    _write_normalised(o_smem, acc, row_sum, partial_ref.at[split, seq, head], group_rows)
    stats_smem[0] = row_max / _LOG2E  # the natural-log maximum, as decode._merge takes it
    stats_smem[1] = row_sum
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(stats_smem.at[0, pl.ds(0, group_rows)], max_ref.at[split, seq, head])
    plgpu.copy_smem_to_gmem(stats_smem.at[1, pl.ds(0, group_rows)], sum_ref.at[split, seq, head])
    plgpu.wait_smem_to_gmem(0)


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, *, scale, keys_per_step: int, stages: int,
                    splits: int, interpret: bool = False):
    """Decode attention over a paged KV cache, as :func:`pallas_paged.decode.paged_attention`.

    q: [seqs, q_heads, d]; k_cache, v_cache: [kv_heads, blocks, block_size, d] (one 16-bit
    dtype, see :func:`supports`); block_tables: int32[seqs, max_blocks]; context_lens:
    int32[seqs] (0: a padding row, zeros out). ``splits`` programs share each (sequence, KV
    head). Returns [seqs, q_heads, d].
    """
    seqs, q_heads, head_dim = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    group = q_heads // kv_heads
    group_rows = -(-group // 8) * 8  # a TMA row count: whole 8-row tiles
    blocks_per_step = keys_per_step // block_size
    q_tiles = jnp.pad(q.reshape(seqs, kv_heads, group, head_dim), ((0, 0), (0, 0), (0, group_rows - group), (0, 0)))
    if splits == 1:
        out_type = jax.ShapeDtypeStruct(q_tiles.shape, q.dtype)
    else:
        stats = jax.ShapeDtypeStruct((splits, seqs, kv_heads, group_rows), jnp.float32)
        out_type = (jax.ShapeDtypeStruct((splits, *q_tiles.shape), q.dtype), stats, stats)
    kernel = functools.partial(_decode_kernel, blocks_per_step=blocks_per_step, stages=stages, splits=splits,
                               scale=scale, interpret=interpret)
    out = plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(seqs, kv_heads) + ((splits,) if splits > 1 else ()),  # the long axis first (see the ragged grid)
        grid_names=("seqs", "heads") + (("splits",) if splits > 1 else ()),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params() if interpret else False,
        kernel_name="paged_decode_attention_sm90",
    )(block_tables.astype(jnp.int32), context_lens.astype(jnp.int32), q_tiles, k_cache, v_cache)
    if splits > 1:
        partial, row_max, row_sum = out  # each split's normalised output: its accumulator is output x sum
        out = decode._merge(partial * row_sum[..., None], row_max[..., None], row_sum[..., None]).astype(q.dtype)
    out = jnp.where((context_lens > 0)[:, None, None, None], out[:, :, :group], 0)
    return out.reshape(seqs, q_heads, head_dim)


def ragged_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *, scale,
                           keys_per_step: int, stages: int, interpret: bool = False):
    """Causal attention for any mix of prefill chunks and decodes, as
    :func:`pallas_paged.ragged.ragged_paged_attention`: q [tokens, q_heads, d], sequence i's
    rows ``query_start_loc[i]:query_start_loc[i+1]`` the last positions of its
    ``context_lens[i]`` tokens. Tiles of :data:`ROWS` rows: each token's GQA group padded to a
    power of two, ``ROWS`` over that many tokens of one sequence. Returns [tokens, q_heads, d];
    unowned rows are 0.
    """
    num_tokens, q_heads, head_dim = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    group = q_heads // kv_heads
    rows_per_token = 1 << (group - 1).bit_length()
    tokens_per_tile = ROWS // rows_per_token
    num_tiles = QueryTiles.max_tiles(num_tokens, block_tables.shape[0], tokens_per_tile)
    tiles = QueryTiles.build(query_start_loc, tokens_per_tile, num_tiles)
    rows = tiles.first_token[:, None] * rows_per_token + jnp.arange(ROWS, dtype=jnp.int32)  # within the padding
    q_tiles = jnp.take(tiles.grouped(q, kv_heads, rows_per_token), rows, axis=1, mode="clip").swapaxes(0, 1)
    kernel = functools.partial(_ragged_kernel, blocks_per_step=keys_per_step // block_size, stages=stages,
                               rows_per_token=rows_per_token, scale=scale, interpret=interpret)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((num_tiles, kv_heads, ROWS, head_dim), q.dtype),
        grid=(num_tiles, kv_heads),  # the long axis first: CUDA's second grid dimension stops at 65,535
        grid_names=("tiles", "heads"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params() if interpret else False,
        kernel_name="ragged_paged_attention_sm90",
    )(tiles.seq, tiles.start, tiles.length, block_tables.astype(jnp.int32), context_lens.astype(jnp.int32),
      tiles.query_lens, q_tiles, k_cache, v_cache)
    return tiles.scatter(out.swapaxes(0, 1), num_tokens, group)
