"""Paged attention kernels against the dense oracle, on CPU: the native kernel the public
functions run here, and the Pallas kernels (the GPU source) in interpret mode."""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_paged
from pallas_paged import decode, decode_tpu, native, ragged, reference, tiling, xla
from tests.pallas_paged.scenarios import assert_close, decode_seqs, make

HEADS = [  # (q_heads, kv_heads)
    pytest.param((8, 8), id="mha"),
    pytest.param((9, 3), id="gqa9-3"),
    pytest.param((32, 8), id="gqa32-8"),
]


def _interpreted(kernel):
    """``kernel`` (decode or ragged), the Pallas source in interpret mode, with the public signature."""
    def call(q, *args, scale=None):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return kernel(q, *args, scale=scale, tiling=tiling.CPU, interpret=True)
    return call


# What CPUs run (pallas_paged's public functions, the native kernel) and the Pallas source.
KERNELS = {
    "native": (pallas_paged.paged_attention, pallas_paged.ragged_paged_attention),
    "pallas": (_interpreted(decode.paged_attention), _interpreted(ragged.ragged_paged_attention)),
}
IMPLS = pytest.mark.parametrize("impl", list(KERNELS))


@IMPLS
@pytest.mark.parametrize("heads", HEADS)
# Every block size, each head size with every head layout, every block size with every layout;
# not every head size with every block size (an interpreted kernel compiles for seconds each).
@pytest.mark.parametrize("head_dim, block_size", [(64, 4), (128, 8), (64, 16), (128, 32)])
def test_decode_matches_oracle(impl, heads, head_dim, block_size):
    q_heads, kv_heads = heads
    contexts = [1, block_size, 3 * block_size, 5 * block_size + 1, 1037, 77]
    s = make(decode_seqs(contexts), q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
             block_size=block_size, seed=block_size + head_dim)
    actual = jax.jit(KERNELS[impl][0])(*s.decode_args)
    assert_close(actual, reference.paged_attention(*s.decode_args), jnp.float32)


@IMPLS
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [4, 8, 16, 32])
def test_ragged_matches_oracle(impl, heads, block_size):
    """Whole prompts, a chunk after a cached prefix, decodes and padding in one call."""
    q_heads, kv_heads = heads
    seqs = [
        (1, 1),  # a one-token prompt
        (45, 45),  # a whole prompt, not a multiple of the block size
        (4 * block_size, 4 * block_size),  # a whole prompt, exactly a multiple
        (1100, 60),  # a chunk after a long cached prefix
        (3 * block_size + 5, 1),  # a decode
        (2 * block_size, 0),  # a sequence with nothing to compute this step
        (250, 17),  # a chunk straddling blocks
    ]
    s = make(seqs, q_heads=q_heads, kv_heads=kv_heads, head_dim=64, block_size=block_size,
             padding_tokens=5, seed=block_size)
    actual = jax.jit(KERNELS[impl][1])(*s.ragged_args)
    assert_close(actual, reference.ragged_paged_attention(*s.ragged_args), jnp.float32)
    assert not np.asarray(actual[-5:]).any(), "padding rows must come out as zeros"


@IMPLS
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("op", ["decode", "ragged"])
def test_bfloat16(impl, op, heads):
    """bfloat16 caches, compiled as the engine compiles them (:func:`pallas_paged.compiler_options`:
    XLA:CPU must run every bfloat16 product natively) and as plain ``jit``."""
    seqs = decode_seqs([1, 16, 500]) if op == "decode" else [(300, 300), (700, 20), (33, 1)]
    s = make(seqs, q_heads=heads[0], kv_heads=heads[1], head_dim=64, block_size=16, dtype=jnp.bfloat16)
    kernel, oracle = {
        "decode": (KERNELS[impl][0], reference.paged_attention),
        "ragged": (KERNELS[impl][1], reference.ragged_paged_attention),
    }[op]
    args = s.decode_args if op == "decode" else s.ragged_args
    with_options = jax.jit(kernel).lower(*args).compile(compiler_options=pallas_paged.compiler_options("cpu"))
    for actual in (with_options(*args), jax.jit(kernel)(*args)):
        assert actual.dtype == jnp.bfloat16
        assert_close(actual, oracle(*args), jnp.bfloat16)


@pytest.mark.parametrize("op", ["decode", "ragged"])
def test_float16_caches_in_the_gpu_kernels(op):
    """float16 (``dtype="half"``, which the engine runs on GPUs): the Pallas kernels, interpreted,
    against the oracle at bfloat16's tolerance (float16 rounds finer)."""
    seqs = decode_seqs([1, 16, 500]) if op == "decode" else [(300, 300), (33, 1)]
    s = make(seqs, q_heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=jnp.float16)
    kernel, oracle = {"decode": (KERNELS["pallas"][0], reference.paged_attention),
                      "ragged": (KERNELS["pallas"][1], reference.ragged_paged_attention)}[op]
    args = s.decode_args if op == "decode" else s.ragged_args
    actual = jax.jit(kernel)(*args)
    assert actual.dtype == jnp.float16
    assert_close(actual, oracle(*args), jnp.bfloat16)


@IMPLS
def test_decode_padding_rows_are_zero(impl):
    s = make(decode_seqs([40, 9]), q_heads=4, kv_heads=2, head_dim=64, block_size=16)
    context_lens = s.context_lens.at[1].set(0)
    out = jax.jit(KERNELS[impl][0])(s.q, s.k_cache, s.v_cache, s.block_tables, context_lens)
    assert not np.asarray(out[1]).any()
    assert_close(out[:1], reference.paged_attention(*s.decode_args)[:1], jnp.float32)


@IMPLS
def test_ragged_with_one_token_per_sequence_equals_decode(impl):
    s = make(decode_seqs([5, 64, 300]), q_heads=9, kv_heads=3, head_dim=64, block_size=16)
    decode_out = jax.jit(KERNELS[impl][0])(*s.decode_args)
    ragged_out = jax.jit(KERNELS[impl][1])(*s.ragged_args)
    np.testing.assert_allclose(np.asarray(decode_out), np.asarray(ragged_out), atol=1e-6)


@IMPLS
def test_custom_scale(impl):
    s = make(decode_seqs([50]), q_heads=2, kv_heads=1, head_dim=64, block_size=8)
    actual = KERNELS[impl][0](*s.decode_args, scale=0.3)
    assert_close(actual, reference.paged_attention(*s.decode_args, scale=0.3), jnp.float32)


def test_rejects_mismatched_heads():
    s = make(decode_seqs([5]), q_heads=4, kv_heads=4, head_dim=64, block_size=8)
    with pytest.raises(ValueError, match="not a multiple of 3 KV heads"):
        pallas_paged.paged_attention(s.q, s.k_cache[:3], s.v_cache[:3], s.block_tables, s.context_lens)


def test_xla_formulation_matches_oracle():
    s = make([(300, 300), (1037, 3), (17, 1)], q_heads=9, kv_heads=3, head_dim=64, block_size=16, padding_tokens=2)
    ragged = jax.jit(functools.partial(xla.ragged_paged_attention, scale=64**-0.5, tokens_per_tile=64))
    assert_close(ragged(*s.ragged_args), reference.ragged_paged_attention(*s.ragged_args), jnp.float32)
    d = make(decode_seqs([1, 1037, 16]), q_heads=9, kv_heads=3, head_dim=64, block_size=16)
    decode = jax.jit(functools.partial(xla.paged_attention, scale=64**-0.5))
    assert_close(decode(*d.decode_args), reference.paged_attention(*d.decode_args), jnp.float32)


@pytest.mark.parametrize("heads", [(8, 8), (4, 2)], ids=["mha", "gqa"])
def test_tpu_decode_kernel_in_interpret_mode(heads):
    """The Mosaic kernel's logic, run by the Pallas interpreter (slow: tiny shapes only)."""
    q_heads, kv_heads = heads
    s = make(decode_seqs([1, 16, 40]), q_heads=q_heads, kv_heads=kv_heads, head_dim=128, block_size=8)
    actual = decode_tpu.paged_attention(*s.decode_args, scale=128**-0.5, interpret=True)
    assert_close(actual, reference.paged_attention(*s.decode_args), jnp.float32)


@pytest.mark.parametrize("op", ["decode", "ragged"])
def test_bfloat16_cache_is_never_converted_whole_on_cpu(op):
    """With :func:`pallas_paged.compiler_options`, a call reads the blocks it needs and never
    converts the whole bfloat16 cache to float32 (a cost that would grow with the cache): its
    scratch memory is smaller than one cache array."""
    blocks, tokens = 512, 8
    k_cache = jnp.zeros((3, blocks, 16, 64), jnp.bfloat16)
    tables = jnp.zeros((tokens, 4), jnp.int32)
    lens = jnp.full((tokens,), 40, jnp.int32)
    q = jnp.zeros((tokens, 9, 64), jnp.bfloat16)
    if op == "decode":
        lowered = jax.jit(pallas_paged.paged_attention).lower(q, k_cache, k_cache, tables, lens)
    else:
        starts = jnp.arange(tokens + 1, dtype=jnp.int32)
        lowered = jax.jit(pallas_paged.ragged_paged_attention).lower(q, k_cache, k_cache, tables, lens, starts)
    compiled = lowered.compile(compiler_options=pallas_paged.compiler_options("cpu"))
    assert compiled.memory_analysis().temp_size_in_bytes < k_cache.nbytes


def test_cpu_runs_the_native_kernel_where_it_fits():
    """float32 and bfloat16 with head sizes a multiple of 16 run natively; anything else runs
    the Pallas kernel in interpret mode, and still matches the oracle."""
    args = make(decode_seqs([20, 3]), q_heads=4, kv_heads=2, head_dim=64, block_size=8).decode_args
    assert native.TARGET in jax.jit(pallas_paged.paged_attention).lower(*args).as_text()
    odd = make(decode_seqs([20, 3]), q_heads=4, kv_heads=2, head_dim=72, block_size=8)
    assert native.TARGET not in jax.jit(pallas_paged.paged_attention).lower(*odd.decode_args).as_text()
    assert_close(pallas_paged.paged_attention(*odd.decode_args), reference.paged_attention(*odd.decode_args),
                 jnp.float32)
    assert not native.supports(jnp.float16, jnp.float16, 64)


def test_native_kernel_refuses_reads_out_of_range():
    """A block table entry past the cache, or a context longer than its table, is an error
    naming the argument, not a read of other memory."""
    s = make(decode_seqs([40, 9]), q_heads=4, kv_heads=2, head_dim=64, block_size=16)
    call = jax.jit(pallas_paged.paged_attention)
    with pytest.raises(Exception, match="block table entry is out of range"):
        call(s.q, s.k_cache, s.v_cache, s.block_tables.at[0, 1].set(10_000), s.context_lens).block_until_ready()
    with pytest.raises(Exception, match="longer than its block table"):
        call(s.q, s.k_cache, s.v_cache, s.block_tables, s.context_lens.at[1].set(1000)).block_until_ready()


def test_without_a_compiler_cpus_run_the_pallas_kernel(tmp_path):
    """No C++ compiler (here ``CXX`` names one that fails): one warning says why, attention
    runs the interpreted Pallas kernel with the same results, and no weight is packed for
    the native product. A fresh process, as the build is attempted once per process."""
    script = (
        "import jax, numpy as np, pallas_paged\n"
        "from pallas_paged import native, reference\n"
        "from tests.pallas_paged.scenarios import make, decode_seqs\n"
        "s = make(decode_seqs([20, 3]), q_heads=4, kv_heads=2, head_dim=64, block_size=8)\n"
        "assert native.TARGET not in jax.jit(pallas_paged.paged_attention).lower(*s.decode_args).as_text()\n"
        "np.testing.assert_allclose(pallas_paged.paged_attention(*s.decode_args),\n"
        "                           reference.paged_attention(*s.decode_args), atol=2e-5)\n"
        "assert not pallas_paged.packable(np.ones((4, 64), jax.numpy.bfloat16))\n"
    )
    env = {**os.environ, "CXX": "false", "PALLAS_PAGED_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                            cwd=pathlib.Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr
    assert "native CPU kernels unavailable, using the interpreted Pallas kernel" in result.stderr
    assert "false --version failed" in result.stderr  # the message names the compiler that failed


@pytest.mark.parametrize("head_dim", [80, 128])
@pytest.mark.parametrize("dtypes", [(jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32)], ids=["f32-q", "bf16-q"])
def test_native_head_sizes_and_mixed_dtypes(head_dim, dtypes):
    """The native kernel's other code paths: a head size it has no special case for (80), 128,
    a query dtype other than the cache's, and a decode whose GQA group (16 heads) fills the
    vector lanes."""
    q_dtype, cache_dtype = dtypes
    s = make([(45, 45), (300, 17), (40, 1), (16, 0)], q_heads=8, kv_heads=2, head_dim=head_dim, block_size=16,
             dtype=cache_dtype, padding_tokens=3)
    q = s.q.astype(q_dtype)
    args = (q, *s.ragged_args[1:])
    actual = jax.jit(pallas_paged.ragged_paged_attention)(*args)
    assert actual.dtype == q_dtype
    assert_close(actual, reference.ragged_paged_attention(*args), jnp.bfloat16)
    d = make(decode_seqs([1, 70, 0]), q_heads=32, kv_heads=2, head_dim=head_dim, block_size=8)
    assert_close(jax.jit(pallas_paged.paged_attention)(*d.decode_args), reference.paged_attention(*d.decode_args),
                 jnp.float32)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16])
def test_native_decode_keeps_a_float32_query_precise_against_a_bfloat16_cache(head_dim, block_size):
    """The engine's bfloat16 models pass float32 queries to a bfloat16 cache. On CPUs with
    AVX512-BF16 the decode multiplies the query by the cached keys as bfloat16 pairs: split
    into two bfloat16 parts, the query keeps float32-like accuracy (to 2e-4, where the
    query's rounding to bfloat16 alone would be off by 1e-2), over contexts that end inside a
    block, span several 64-key chunks, or hold one token."""
    s = make(decode_seqs([1, 17, 64, 65, 150, 300]), q_heads=9, kv_heads=3, head_dim=head_dim,
             block_size=block_size, dtype=jnp.bfloat16, seed=3)
    q = s.q.astype(jnp.float32) + 1e-3 * jax.random.normal(jax.random.key(0), s.q.shape)  # not bf16-exact
    args = (q, *s.decode_args[1:])
    actual = jax.jit(pallas_paged.paged_attention)(*args)
    expected = reference.paged_attention(q, *(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a
                                              for a in args[1:]))
    assert actual.dtype == jnp.float32 and np.isfinite(np.asarray(actual)).all()
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), atol=2e-4, rtol=2e-4)


def test_native_ragged_refuses_inconsistent_rows():
    """More query rows than context tokens, or an entry past the cache, is an error, not zeros."""
    s = make([(30, 5), (10, 2)], q_heads=4, kv_heads=2, head_dim=64, block_size=8)
    call = jax.jit(pallas_paged.ragged_paged_attention)
    with pytest.raises(Exception, match="more query rows than context tokens"):
        call(*s.ragged_args[:4], s.context_lens.at[0].set(3), s.query_start_loc).block_until_ready()
    with pytest.raises(Exception, match="block table entry is out of range"):
        call(s.q, s.k_cache, s.v_cache, s.block_tables.at[1, 0].set(-1), *s.ragged_args[4:]).block_until_ready()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_native_splits_a_lone_long_sequence(dtype):
    """With fewer (sequence, KV head) pairs than twice the cores, the native kernel splits the
    keys into parts and merges them: one decoding sequence, and one chunk of 12 tokens after
    a long cached prefix, whose rows see different numbers of keys in the last part."""
    d = make(decode_seqs([1037]), q_heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    assert_close(jax.jit(pallas_paged.paged_attention)(*d.decode_args), reference.paged_attention(*d.decode_args),
                 dtype)
    r = make([(1100, 12)], q_heads=4, kv_heads=1, head_dim=64, block_size=16, dtype=dtype, padding_tokens=2)
    actual = jax.jit(pallas_paged.ragged_paged_attention)(*r.ragged_args)
    assert_close(actual, reference.ragged_paged_attention(*r.ragged_args), dtype)
