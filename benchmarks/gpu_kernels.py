"""Paged attention on one GPU: this project's kernels against dense XLA, JAX's own paged op and cuDNN.

    PYTHONPATH=. python -m benchmarks.gpu_kernels [--quick]

Everything in bfloat16 (products in bfloat16, accumulation in float32), blocks of 16 tokens
laid out in random order through block tables (as a running engine's cache is), random data.
Decode, one query token per sequence, every sequence at the same context: ours
(``pallas_paged.paged_attention``: the Triton kernel on CUDA, the native C++ kernel on CPU);
the same work as dense XLA attention on a contiguous ``[seqs, kv_heads, context, d]`` cache, the
bar paging is measured against; JAX's own Pallas GPU paged op
(``jax.experimental.pallas.ops.gpu.paged_attention``, deprecated since JAX 0.11) on the same
paged cache; and ours with the tiling it had before issue 41 (16 keys per step, no split over
the context), so that one run measures that change (in prefill too); and on a Hopper the Mosaic GPU
kernels (``pallas_paged.hopper_paged_attention`` and ``hopper_ragged_paged_attention``, TMA and
wgmma), whether or not ``tiling.HOPPER`` has the public ops run them yet, and in prefill our op
sending whole fresh prompts to cuDNN (``PALLAS_PAGED_CUDNN_PROMPTS=1``). Effective GB/s: bytes of K/V read plus q
and the output, over the time. Prefill,
whole prompts, causal: ours (``pallas_paged.ragged_paged_attention`` on a paged cache holding
the prompts) against ``jax.nn.dot_product_attention`` on contiguous q/k/v, cuDNN's flash
attention and XLA's. Each output is checked against ``pallas_paged.reference`` once before
timing (a mismatch is printed and written with the tables); times are medians of interleaved
rounds, each ended by ``jax.block_until_ready`` (``benchmarks.timing.time_interleaved``).
Off a GPU the GPU-only columns say "n/a (no GPU)"; an op that fails shows its error in its cell.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import warnings
from collections.abc import Callable
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import pallas_paged
from benchmarks.gpu_report import NO_GPU, header, on_gpu, require_gpu_unless_quick, save
from benchmarks.timing import print_table, time_interleaved
from pallas_paged import decode, lowering, native, ragged, reference, tiling

BLOCK_SIZE = 16
DTYPE = jnp.bfloat16
TOLERANCE = 2e-2  # absolute and relative: inputs and output rounded to bfloat16, math in float32
JAX_PAGED_DEPRECATION = r"jax\.experimental\.pallas\.ops\.gpu\.paged_attention is deprecated"


@dataclasses.dataclass(frozen=True)
class Case:
    """One shape: heads and head size, and ``seqs`` sequences (or prompts) of ``context`` tokens."""

    q_heads: int
    kv_heads: int
    head_dim: int
    seqs: int
    context: int

    @property
    def heads(self) -> str:
        return f"{self.q_heads}/{self.kv_heads} x {self.head_dim}"


DECODE = [Case(32, 8, 128, 64, 1024), Case(32, 8, 128, 64, 4096), Case(32, 8, 128, 256, 2048),
          Case(32, 8, 128, 8, 8192), Case(9, 3, 64, 256, 1024)]
PREFILL = [Case(32, 8, 128, 4, 2048), Case(32, 8, 128, 16, 512)]
QUICK_DECODE = [Case(32, 8, 128, 4, 256), Case(9, 3, 64, 4, 128)]
QUICK_PREFILL = [Case(32, 8, 128, 2, 128), Case(32, 8, 128, 4, 64)]


def shuffled_tables(seqs: int, blocks_per_seq: int, rng: np.random.Generator) -> jax.Array:
    """int32[seqs, blocks_per_seq]: every block of a pool of ``seqs * blocks_per_seq``, in random order."""
    return jnp.asarray(rng.permutation(seqs * blocks_per_seq).reshape(seqs, blocks_per_seq), jnp.int32)


@jax.jit
def paged_copy(contiguous: jax.Array, tables: jax.Array) -> jax.Array:
    """The cache holding ``contiguous`` through ``tables``.

    contiguous: [seqs, kv_heads, ctx, d] (ctx a multiple of BLOCK_SIZE); tables:
    int32[seqs, ctx // BLOCK_SIZE], a permutation of the pool's blocks. Returns
    [kv_heads, seqs * ctx // BLOCK_SIZE, BLOCK_SIZE, d], block ``tables[s, j]`` holding
    tokens ``j * BLOCK_SIZE ...`` of sequence ``s``.
    """
    seqs, kv_heads, ctx, head_dim = contiguous.shape
    blocks = contiguous.reshape(seqs, kv_heads, ctx // BLOCK_SIZE, BLOCK_SIZE, head_dim).swapaxes(0, 1)
    return blocks.reshape(kv_heads, -1, BLOCK_SIZE, head_dim)[:, jnp.argsort(tables.reshape(-1))]


@jax.jit
def dense_decode(q, k, v, context_lens):
    """Dense decode attention. q: [seqs, q_heads, d]; k, v: contiguous [seqs, kv_heads, ctx, d];
    context_lens: int32[seqs] → [seqs, q_heads, d]. Products in bfloat16 accumulating in float32."""
    seqs, q_heads, head_dim = q.shape
    kv_heads, ctx = k.shape[1], k.shape[2]
    grouped = (q.reshape(seqs, kv_heads, q_heads // kv_heads, head_dim) * head_dim**-0.5).astype(k.dtype)
    scores = jnp.einsum("shgd,shkd->shgk", grouped, k, preferred_element_type=jnp.float32)
    valid = (jnp.arange(ctx) < context_lens[:, None])[:, None, None, :]
    weights = jax.nn.softmax(jnp.where(valid, scores, -jnp.inf), axis=-1).astype(v.dtype)
    out = jnp.einsum("shgk,shkd->shgd", weights, v, preferred_element_type=jnp.float32)
    return out.reshape(q.shape).astype(q.dtype)


def jax_paged_attention() -> Callable:
    """JAX's own Pallas GPU paged decode op, imported without its deprecation warning (only that).

    Its layout is this project's: q [seqs, q_heads, d], k/v pages [kv_heads, blocks,
    block_size, d], block_tables int32[seqs, blocks_per_seq], lengths int32[seqs]; it does not
    scale q (callers pass q already times ``d ** -0.5``), and needs blocks_per_seq to be a
    multiple of its ``k_splits`` (16).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=JAX_PAGED_DEPRECATION, category=DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention
    return paged_attention.paged_attention


def summary(error: Exception) -> str:
    """An error as a table cell: its type and the first line of its message, shortened."""
    first = (str(error).strip().splitlines() or [""])[0]
    return f"error: {type(error).__name__}: {first[:160]}".replace("|", "/")


def build(fn: Callable, args: tuple, *, kernel: bool = False) -> Callable[[], jax.Array] | str:
    """``fn(*args)`` compiled, as a zero-argument callable; or the error, as a cell, if it fails.
    ``kernel``: compile with the options the project's kernels ask for (``pallas_paged.compiler_options``)."""
    options = pallas_paged.compiler_options(jax.default_backend()) if kernel else None
    try:
        with lowering.quietly():
            compiled = jax.jit(fn).lower(*args).compile(options)
    except Exception as error:  # noqa: BLE001 - an op that does not compile for a shape is a result
        return summary(error)
    return functools.partial(compiled, *args)


def kernel_of(fn: Callable, args: tuple) -> str:
    """What ``fn(*args)`` runs, read from its lowering: a Triton or Mosaic GPU kernel, the native
    CPU kernel, or XLA ops (e.g. the Pallas kernel in interpret mode)."""
    with lowering.quietly():
        text = jax.jit(fn).lower(*args).as_text()
    kinds = {"xla.gpu.triton": "Triton", "mosaic_gpu": "Mosaic GPU", native.TARGET: "native CPU kernel"}
    return next((kind for marker, kind in kinds.items() if marker in text), "XLA ops")


def verified(name: str, case: Case, variant, expected: jax.Array, mismatches: list[str]):
    """``variant`` if its output matches ``expected`` (any shape with the same elements), else a
    cell saying what went wrong; a mismatch is also printed at once and added to ``mismatches``."""
    if isinstance(variant, str):
        return variant
    try:
        got = np.asarray(jax.block_until_ready(variant()), np.float32).reshape(-1)
    except Exception as error:  # noqa: BLE001 - e.g. cuDNN refusing a shape at run time
        return summary(error)
    want = np.asarray(expected, np.float32).reshape(-1)
    if np.allclose(got, want, atol=TOLERANCE, rtol=TOLERANCE):
        return variant
    error = f"max |error| {np.nanmax(np.abs(got - want)):.3g}"  # NaN where the output has a NaN
    line = (f"MISMATCH: {name} at {case.heads}, {case.seqs} x {case.context}: {error} against "
            f"pallas_paged.reference (tolerance {TOLERANCE})")
    print(f"\n{'!' * 20} {line}\n", file=sys.stderr, flush=True)
    mismatches.append(line)
    return f"MISMATCH ({error})"


def timed(variants: dict) -> dict[str, float | str]:
    """Seconds per call of every callable variant (interleaved medians); the others' cells as they are."""
    runnable = {name: fn for name, fn in variants.items() if callable(fn)}
    seconds = time_interleaved(runnable) if runnable else {}
    return {name: seconds.get(name, variant) for name, variant in variants.items()}


@functools.partial(jax.jit, static_argnums=(0, 2))
def random_inputs(case: Case, key: jax.Array, q_tokens: int):
    """q [q_tokens, q_heads, d] and contiguous k, v [seqs, kv_heads, context, d], random bfloat16."""
    q_key, k_key, v_key = jax.random.split(key, 3)
    kv_shape = (case.seqs, case.kv_heads, case.context, case.head_dim)
    q = jax.random.normal(q_key, (q_tokens, case.q_heads, case.head_dim), DTYPE)
    return q, jax.random.normal(k_key, kv_shape, DTYPE), jax.random.normal(v_key, kv_shape, DTYPE)


def paged_inputs(case: Case, k: jax.Array, v: jax.Array, rng: np.random.Generator):
    """(k_cache, v_cache, block_tables, context_lens) holding contiguous k, v [seqs, kv_heads, ctx, d]."""
    tables = shuffled_tables(case.seqs, case.context // BLOCK_SIZE, rng)
    return paged_copy(k, tables), paged_copy(v, tables), tables, jnp.asarray(np.full(case.seqs, case.context, np.int32))


def decode_row(case: Case, key: jax.Array, rng: np.random.Generator, mismatches: list[str]) -> list:
    """One decode table row: times, effective GB/s and ours / dense for ``case``."""
    q, k, v = random_inputs(case, key, case.seqs)
    paged = (q, *paged_inputs(case, k, v, rng))
    variants = {"ours": build(pallas_paged.paged_attention, paged, kernel=True),
                "ours before": build(before_issue_41, paged, kernel=True) if on_gpu() else NO_GPU,
                "dense": build(dense_decode, (q, k, v, paged[-1])),
                "JAX": build(jax_paged_attention(), ((q * case.head_dim**-0.5).astype(DTYPE), *paged[1:]))
                if on_gpu() else NO_GPU,
                "Mosaic GPU": hopper_variant(pallas_paged.hopper_paged_attention, paged)}
    expected = reference.paged_attention(*paged)
    times = timed({name: verified(name, case, variant, expected, mismatches) for name, variant in variants.items()})
    moved = 2 * k.nbytes + 2 * q.nbytes  # K and V read once; q read and the output written
    cells = [cell for name in variants for cell in time_and_rate(times[name], moved)]
    return [case.heads, case.seqs, case.context, *cells, ratio(times["ours"], times["dense"]),
            ratio(times["ours before"], times["ours"]), ratio(times["Mosaic GPU"], times["dense"]),
            ratio(times["Mosaic GPU"], times["JAX"]), kernel_of(pallas_paged.paged_attention, paged)]


def hopper_variant(kernel: Callable, paged: tuple):
    """A Mosaic GPU kernel (``pallas_paged.hopper_paged_attention`` or
    ``hopper_ragged_paged_attention``, with ``tiling.HOPPER``'s knobs) on ``paged``, whether or
    not the public ops run it yet; a cell saying why not off a Hopper."""
    if not on_gpu():
        return NO_GPU
    if not pallas_paged.hopper_gpu():
        return f"n/a (compute capability {pallas_paged.cuda_capability()}: not a Hopper)"
    scale = paged[0].shape[-1] ** -0.5
    return build(functools.partial(kernel, scale=scale), paged, kernel=True)


def before_issue_41(q, k_cache, v_cache, block_tables, context_lens):
    """Our Triton decode kernel with the tiling it had before issue 41 (16 keys per step, never
    split): the A/B of that change, in the same run."""
    return decode.paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale=q.shape[-1] ** -0.5,
                                  tiling=tiling.GPU_BEFORE_ISSUE_41, interpret=False)


def time_and_rate(seconds: float | str, moved: int) -> list:
    """Cells: microseconds and effective GB/s; a non-timing (n/a, error) and an empty cell."""
    return [number(seconds * 1e6), number(moved / seconds / 1e9)] if isinstance(seconds, float) else [seconds, ""]


def ratio(a: float | str, b: float | str) -> str:
    return f"{a / b:.2f}" if isinstance(a, float) and isinstance(b, float) else "n/a"


def number(value: float) -> str:
    """Three significant digits, without an exponent up to millions (1,618 rather than 1.62e+03)."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def contiguous_attention(implementation: str) -> Callable:
    """Causal ``jax.nn.dot_product_attention`` with ``implementation``: q [seqs, len, q_heads, d],
    k, v [seqs, len, kv_heads, d] → like q."""
    return functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=implementation)


def prefill_row(case: Case, key: jax.Array, rng: np.random.Generator, mismatches: list[str]) -> list:
    """One prefill table row: milliseconds of ours, cuDNN and XLA, and ours over each."""
    q, k, v = random_inputs(case, key, case.seqs * case.context)
    k_cache, v_cache, tables, lens = paged_inputs(case, k, v, rng)
    starts = jnp.asarray(np.arange(case.seqs + 1, dtype=np.int32) * case.context)
    paged = (q, k_cache, v_cache, tables, lens, starts)
    dense = (q.reshape(case.seqs, case.context, case.q_heads, case.head_dim), k.swapaxes(1, 2), v.swapaxes(1, 2))
    variants = {"ours": build(pallas_paged.ragged_paged_attention, paged, kernel=True),
                "ours before": build(ragged_before_issue_41, paged, kernel=True) if on_gpu() else NO_GPU,
                "cuDNN": build(contiguous_attention("cudnn"), dense) if on_gpu() else NO_GPU,
                "XLA": build(contiguous_attention("xla"), dense),
                "Mosaic GPU": hopper_variant(pallas_paged.hopper_ragged_paged_attention, paged),
                "cuDNN prompts": cudnn_prompts_variant(paged, k, v)}
    expected = reference.ragged_paged_attention(*paged)
    times = timed({name: verified(name, case, variant, expected, mismatches) for name, variant in variants.items()})
    cells = [number(t * 1e3) if isinstance(t, float) else t for t in times.values()]
    return [case.heads, case.seqs, case.context, *cells, ratio(times["ours"], times["cuDNN"]),
            ratio(times["ours"], times["XLA"]), ratio(times["ours before"], times["ours"]),
            ratio(times["Mosaic GPU"], times["cuDNN"]), ratio(times["cuDNN prompts"], times["cuDNN"]),
            kernel_of(pallas_paged.ragged_paged_attention, paged)]


def cudnn_prompts_variant(paged: tuple, k: jax.Array, v: jax.Array):
    """Our ragged op given the prompts' own K and V (``new_kv``) with
    ``PALLAS_PAGED_CUDNN_PROMPTS=1``: whole fresh prompts through cuDNN's flash attention
    (``pallas_paged.prompts``), whether or not ``tiling.HOPPER`` turns that on yet; the cost
    of choosing it on the device included. k, v: contiguous [seqs, kv_heads, ctx, d]."""
    if not on_gpu():
        return NO_GPU
    if not pallas_paged.hopper_or_later():
        capability = pallas_paged.cuda_capability()
        return f"n/a (compute capability {capability}: cuDNN's packed layout needs a Hopper or later)"
    tokens = [x.swapaxes(1, 2).reshape(-1, *x.shape[1:2], x.shape[3]) for x in (k, v)]
    with mock.patch.dict(os.environ, PALLAS_PAGED_CUDNN_PROMPTS="1"):  # read when the op is traced, in build
        return build(lambda *arrays: pallas_paged.ragged_paged_attention(*arrays[:6], new_kv=arrays[6:]),
                     (*paged, *tokens), kernel=True)


def ragged_before_issue_41(q, k_cache, v_cache, block_tables, context_lens, query_start_loc):
    """Our Triton ragged kernel with the tiling it had before issue 41 (16 keys per step)."""
    return ragged.ragged_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                                         scale=q.shape[-1] ** -0.5, tiling=tiling.GPU_BEFORE_ISSUE_41,
                                         interpret=False)


DECODE_HEADERS = ["heads q/kv x d", "seqs", "context", "ours us", "ours GB/s", "ours before issue 41 us",
                  "before GB/s", "dense XLA us", "dense GB/s", "JAX paged op us", "JAX GB/s", "Mosaic GPU (sm90) us",
                  "Mosaic GB/s", "ours / dense", "before / ours", "Mosaic / dense", "Mosaic / JAX", "ours runs"]
PREFILL_HEADERS = ["heads q/kv x d", "prompts", "tokens each", "ours ms", "ours before issue 41 ms",
                   "cuDNN flash ms", "dense XLA ms", "Mosaic GPU (sm90) ms", "ours, cuDNN prompts ms", "ours / cuDNN",
                   "ours / XLA", "before / ours", "Mosaic / cuDNN", "cuDNN prompts / cuDNN", "ours runs"]


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; print the tables and write them (with where they ran); return the text."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes, to check the script (any backend)")
    args = parser.parse_args(argv)
    require_gpu_unless_quick(args.quick)
    rng, key, mismatches = np.random.default_rng(0), jax.random.key(0), []
    sections = [header("benchmarks.gpu_kernels", list(sys.argv[1:] if argv is None else argv)),
                "ours: `pallas_paged`'s public ops (\"ours runs\": the kernel their lowering calls here)."]
    for title, cases, row, headers in [
            ("Paged decode, bfloat16, block 16, blocks shuffled; microseconds per call", QUICK_DECODE if args.quick
             else DECODE, decode_row, DECODE_HEADERS),
            ("Prefill (whole prompts, causal), bfloat16; milliseconds per call", QUICK_PREFILL if args.quick
             else PREFILL, prefill_row, PREFILL_HEADERS)]:
        print(f"\n{title}")
        rows = [row(case, jax.random.fold_in(key, i), rng, mismatches) for i, case in enumerate(cases)]
        sections += [title, print_table(headers, rows)]
    sections.append("\n".join(["MISMATCHES against pallas_paged.reference:", *mismatches]) if mismatches
                    else f"Every output matched pallas_paged.reference (tolerance {TOLERANCE}).")
    text = "\n\n".join(sections)
    save(text, "gpu_kernels", args.quick)
    return text


if __name__ == "__main__":
    main()
