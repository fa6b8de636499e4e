"""Paged attention kernels vs dense attention on a contiguous cache doing the same work.

    python -m benchmarks.kernels [--quick]

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64, block
size 16). Decode: every sequence has the same context length, so the dense
version wastes nothing. Prefill: a batch of whole prompts of one length.
Columns: the kernel this CPU runs (``pallas_paged``'s public functions: the
native C++ kernel) reading blocks in a random order through block tables; the
same kernel with each sequence's blocks in order (how a batch of prompts
admitted together lies in the engine's cache); the Pallas kernel, the source
GPUs compile, in interpret mode, blocks shuffled; the same work as dense XLA attention on a
contiguous ``[seqs, kv_heads, context, d]`` cache, the faster of two ways of writing it (decode: einsum or
multiply-and-sum; prefill: the whole masked square, or causal tiles that skip
what the mask hides); and the XLA gather formulation (gather the blocks, then
attend). The paper's bar: paging costs at most 1.25x the contiguous version.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_paged
from benchmarks.timing import print_table, result_name, save_figure, save_text, time_interleaved
from pallas_paged import decode, ragged, tiling, xla

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5


@jax.jit
def dense_decode(q, k, v, context_lens):
    """q: [seqs, q_heads, d]; k, v: [seqs, kv_heads, ctx, d] contiguous → [seqs, q_heads, d].
    Products in the cache's dtype with float32 accumulation, as the kernels do."""
    seqs, _, ctx, _ = k.shape
    qg = (q.reshape(seqs, KV_HEADS, -1, HEAD_DIM).astype(jnp.float32) * SCALE).astype(k.dtype)
    scores = jnp.einsum("shgd,shkd->shgk", qg, k, preferred_element_type=jnp.float32)
    valid = jnp.arange(ctx)[None, None, None, :] < context_lens[:, None, None, None]
    weights = jax.nn.softmax(jnp.where(valid, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("shgk,shkd->shgd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(q.shape).astype(q.dtype)


@jax.jit
def dense_decode_summed(q, k, v, context_lens):
    """:func:`dense_decode` with the products as multiply-and-sum, which XLA:CPU runs faster
    than its batched matrix-vector einsum at some sizes; the baseline is the faster of the two."""
    seqs, _, ctx, _ = k.shape
    qg = q.reshape(seqs, KV_HEADS, -1, HEAD_DIM).astype(jnp.float32) * SCALE
    scores = jnp.sum(qg[:, :, :, None, :] * k[:, :, None].astype(jnp.float32), axis=-1)
    valid = jnp.arange(ctx)[None, None, None, :] < context_lens[:, None, None, None]
    weights = jax.nn.softmax(jnp.where(valid, scores, -jnp.inf), axis=-1)
    out = jnp.sum(weights[..., None] * v[:, :, None].astype(jnp.float32), axis=3)
    return out.reshape(q.shape).astype(q.dtype)


@jax.jit
def dense_prefill(q, k, v):
    """Causal attention. q: [seqs, len, q_heads, d]; k, v: [seqs, kv_heads, len, d] → like q.

    In float32: with bfloat16 float normalization off (``pallas_paged.compiler_options``),
    XLA:CPU cannot run these batched bfloat16 products ("Unsupported element type for
    DotThunk"), so a bfloat16 cache is converted first."""
    seqs, length, _, _ = q.shape
    qg = q.reshape(seqs, length, KV_HEADS, -1, HEAD_DIM).astype(jnp.float32) * SCALE
    scores = jnp.einsum("sqhgd,shkd->shgqk", qg, k.astype(jnp.float32))
    causal = jnp.tril(jnp.ones((length, length), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("shgqk,shkd->sqhgd", weights, v.astype(jnp.float32))
    return out.reshape(q.shape).astype(q.dtype)


@jax.jit
def dense_prefill_causal_tiles(q, k, v):
    """:func:`dense_prefill` skipping what the causal mask hides: 128 queries at a time, each
    tile against only the keys up to its last query (about half the work of the full square)."""
    seqs, length, _, _ = q.shape
    tile = min(128, length)
    outs = []
    for start in range(0, length, tile):
        end = min(start + tile, length)
        qg = q[:, start:end].reshape(seqs, end - start, KV_HEADS, -1, HEAD_DIM).astype(jnp.float32) * SCALE
        scores = jnp.einsum("sqhgd,shkd->shgqk", qg, k[:, :, :end].astype(jnp.float32))
        causal = jnp.arange(end)[None, :] <= jnp.arange(start, end)[:, None]
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        outs.append(jnp.einsum("shgqk,shkd->sqhgd", weights, v[:, :, :end].astype(jnp.float32)))
    return jnp.concatenate(outs, axis=1).reshape(q.shape).astype(q.dtype)


def paged_inputs(seqs, context, dtype, rng):
    """Random contiguous K/V for ``seqs`` sequences and the same data scattered over shuffled blocks."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = seqs * blocks_per_seq
    contiguous = rng.standard_normal((2, seqs, KV_HEADS, blocks_per_seq * BLOCK_SIZE, HEAD_DIM)).astype(np.float32)
    tables = rng.permutation(num_blocks).reshape(seqs, blocks_per_seq).astype(np.int32)
    paged = np.empty((2, KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM), np.float32)
    blocked = contiguous.reshape(2, seqs, KV_HEADS, blocks_per_seq, BLOCK_SIZE, HEAD_DIM)
    paged[:, :, tables] = blocked.transpose(0, 2, 1, 3, 4, 5)
    as_jax = functools.partial(jnp.asarray, dtype=dtype)
    return as_jax(contiguous[0]), as_jax(contiguous[1]), as_jax(paged[0]), as_jax(paged[1]), jnp.asarray(tables)


def in_order(k, v, tables):
    """The same data as :func:`paged_inputs`, with each sequence's blocks in order, one sequence
    after another. k, v: contiguous [seqs, kv_heads, ctx, d] → (k_cache, v_cache, block_tables)."""
    seqs, kv_heads, length, head_dim = k.shape
    blocks = seqs * tables.shape[1]

    def paged(x):
        return x.reshape(seqs, kv_heads, -1, BLOCK_SIZE, head_dim).swapaxes(0, 1).reshape(kv_heads, blocks, BLOCK_SIZE,
                                                                                           head_dim)
    return paged(k), paged(v), jnp.arange(blocks, dtype=jnp.int32).reshape(tables.shape)


def compiled(fn, *args):
    """``fn`` compiled for ``args`` with the options the kernels ask for (what the engine uses)."""
    return jax.jit(fn).lower(*args).compile(compiler_options=pallas_paged.compiler_options(jax.default_backend()))


def interpreted(kernel):
    """The Pallas ``kernel`` (decode or ragged) in interpret mode, as CPUs ran it before the native one."""
    return functools.partial(kernel, scale=SCALE, tiling=tiling.CPU, interpret=True)


def bench_decode(seqs, context, dtype, rng):
    k, v, k_cache, v_cache, tables = paged_inputs(seqs, context, dtype, rng)
    q = jnp.asarray(rng.standard_normal((seqs, Q_HEADS, HEAD_DIM)), dtype)
    lens = jnp.full((seqs,), context, jnp.int32)
    paged = compiled(pallas_paged.paged_attention, q, k_cache, v_cache, tables, lens)
    pallas = compiled(interpreted(decode.paged_attention), q, k_cache, v_cache, tables, lens)
    gather = compiled(functools.partial(xla.paged_attention, scale=SCALE), q, k_cache, v_cache, tables, lens)
    ordered = in_order(k, v, tables)
    reference = np.asarray(dense_decode(q, k, v, lens), np.float32)
    for kernel, caches in ((paged, (k_cache, v_cache, tables)), (paged, ordered), (pallas, (k_cache, v_cache, tables))):
        np.testing.assert_allclose(np.asarray(kernel(q, caches[0], caches[1], caches[2], lens), np.float32), reference,
                                   atol=3e-2)
    times = time_interleaved({
        "paged": lambda: paged(q, k_cache, v_cache, tables, lens),
        "in order": lambda: paged(q, *ordered, lens),
        "pallas": lambda: pallas(q, k_cache, v_cache, tables, lens),
        "dense einsum": lambda: dense_decode(q, k, v, lens),
        "dense summed": lambda: dense_decode_summed(q, k, v, lens),
        "gather": lambda: gather(q, k_cache, v_cache, tables, lens),
    })
    return {**times, "dense": min(times["dense einsum"], times["dense summed"])}


def bench_prefill(seqs, length, dtype, rng):
    k, v, k_cache, v_cache, tables = paged_inputs(seqs, length, dtype, rng)
    q = jnp.asarray(rng.standard_normal((seqs, length, Q_HEADS, HEAD_DIM)), dtype)
    flat_q = q.reshape(seqs * length, Q_HEADS, HEAD_DIM)
    lens = jnp.full((seqs,), length, jnp.int32)
    starts = jnp.arange(seqs + 1, dtype=jnp.int32) * length
    paged = compiled(pallas_paged.ragged_paged_attention, flat_q, k_cache, v_cache, tables, lens, starts)
    pallas = compiled(interpreted(ragged.ragged_paged_attention), flat_q, k_cache, v_cache, tables, lens, starts)
    gather = compiled(functools.partial(xla.ragged_paged_attention, scale=SCALE), flat_q, k_cache, v_cache, tables,
                      lens, starts)
    ordered = in_order(k, v, tables)
    reference = np.asarray(dense_prefill(q, k, v).reshape(flat_q.shape), np.float32)
    for kernel, caches in ((paged, (k_cache, v_cache, tables)), (paged, ordered), (pallas, (k_cache, v_cache, tables))):
        out = kernel(flat_q, caches[0], caches[1], caches[2], lens, starts)
        np.testing.assert_allclose(np.asarray(out, np.float32), reference, atol=3e-2)
    np.testing.assert_allclose(np.asarray(dense_prefill_causal_tiles(q, k, v).reshape(flat_q.shape), np.float32),
                               reference, atol=3e-2)
    times = time_interleaved({
        "paged": lambda: paged(flat_q, k_cache, v_cache, tables, lens, starts),
        "in order": lambda: paged(flat_q, *ordered, lens, starts),
        "pallas": lambda: pallas(flat_q, k_cache, v_cache, tables, lens, starts),
        "dense square": lambda: dense_prefill(q, k, v),
        "dense causal tiles": lambda: dense_prefill_causal_tiles(q, k, v),
        "gather": lambda: gather(flat_q, k_cache, v_cache, tables, lens, starts),
    })
    return {**times, "dense": min(times["dense square"], times["dense causal tiles"])}


def run(cases, bench, title, rng):
    rows = []
    for dtype in (jnp.float32, jnp.bfloat16):
        for seqs, context in cases:
            t = bench(seqs, context, dtype, rng)
            rows.append([jnp.dtype(dtype).name, seqs, context, t["paged"] * 1e3, t["in order"] * 1e3, t["dense"] * 1e3,
                         t["gather"] * 1e3, t["paged"] / t["dense"], t["in order"] / t["dense"], t["pallas"] * 1e3,
                         t["pallas"] / t["paged"]])
    print(f"\n{title}")
    headers = ["dtype", "seqs", "context", "paged ms", "paged, blocks in order ms", "dense contiguous ms",
               "XLA gather ms", "paged / dense", "in order / dense", "Pallas interpreted ms", "Pallas / paged"]
    return rows, print_table(headers, rows)


def plot(decode_rows, prefill_rows, name: str):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    for ax, rows, title in [(axes[0], decode_rows, "decode"), (axes[1], prefill_rows, "prefill")]:
        labels = [f"{r[0][:4]} {r[1]}x{r[2]}" for r in rows]
        positions = np.arange(len(rows))
        ax.bar(positions - 0.2, [r[7] for r in rows], 0.4, label="blocks shuffled")
        ax.bar(positions + 0.2, [r[8] for r in rows], 0.4, label="blocks in order")
        ax.set_xticks(positions, labels)
        ax.axhline(1.25, color="red", linestyle="--", label="1.25x (paper's bound)")
        ax.set_ylabel("paged / dense contiguous time")
        ax.set_title(f"{title}: paged attention overhead")
        ax.tick_params(axis="x", rotation=70, labelsize=7)
        ax.legend(fontsize=7, framealpha=0.8)
    return save_figure(fig, name)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few small cases only")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    if args.quick:
        decode_cases, prefill_cases = [(8, 512)], [(2, 256)]
    else:
        decode_cases = [(b, c) for b in (1, 8, 32, 64) for c in (128, 512, 2048)]
        prefill_cases = [(1, 128), (8, 128), (1, 512), (4, 512), (1, 2048), (2, 2048)]
    decode_rows, decode_table = run(decode_cases, bench_decode, "Decode (one token per sequence), ms per call", rng)
    prefill_rows, prefill_table = run(prefill_cases, bench_prefill, "Prefill (whole prompts, causal), ms per call", rng)
    name = result_name("kernels", args.quick)
    save_text(f"Decode\n\n{decode_table}\n\nPrefill\n\n{prefill_table}", name)
    print(f"\nwrote {plot(decode_rows, prefill_rows, name)}")


if __name__ == "__main__":
    main()
