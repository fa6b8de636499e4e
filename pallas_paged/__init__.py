"""Paged-attention kernels and KV-cache operations: the public API.

Per layer the KV cache is two arrays, ``k_cache, v_cache: [num_kv_heads,
num_blocks, block_size, head_dim]``; slot ``block * block_size + offset``.

Each attention op picks its implementation for the platform being lowered
for (``jax.lax.platform_dependent``), not the process's default backend:
the same jitted function runs the native kernel (:mod:`pallas_paged.native`)
on CPU, compiles the Pallas kernel with Triton for CUDA, and on TPU uses a
Mosaic kernel for decode and an XLA formulation for ragged attention. Where
the native kernel cannot run, CPUs run the Pallas kernel in interpret mode.

Besides paged attention and the KV block operations, this package holds the project's other
kernels: the dense matrix products the models run on CPUs (:mod:`pallas_paged.matmul`, over
``native/matmul.cc``). They are not paged attention, but they are kernels built and
registered the same way (one native library, one build, XLA FFI), as vLLM keeps its GEMMs
beside its attention kernels in one ops package; ``models`` calls them and knows no C++.
"""

from __future__ import annotations

import functools
import os

import jax

from pallas_paged import decode, decode_tpu, hopper, lowering, native, precision, prompts, ragged, tiling
from pallas_paged.cache_ops import copy_blocks, swap_in, swap_out, write_kv
from pallas_paged.layout import KVCacheSpec, blocks_needed
from pallas_paged.matmul import (
    argmax_head,
    argmax_screen,
    gated_matmul,
    is_packed,
    matmul,
    matmuls,
    pack,
    packable,
    packing_enabled,
    rms_norm,
    screenable,
)
from pallas_paged.xla_options import compiler_options

__all__ = [
    "KVCacheSpec",
    "argmax_head",
    "argmax_screen",
    "blocks_needed",
    "compiler_options",
    "copy_blocks",
    "is_packed",
    "gated_matmul",
    "lowering",
    "matmul",
    "matmuls",
    "pack",
    "packable",
    "packing_enabled",
    "paged_attention",
    "ragged_paged_attention",
    "rms_norm",
    "screenable",
    "swap_in",
    "swap_out",
    "write_kv",
]


def _check(q, k_cache, v_cache, block_tables, context_lens):
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.dtype}{list(k_cache.shape)} and v_cache "
                         f"{v_cache.dtype}{list(v_cache.shape)} must have the same shape and dtype")
    if q.shape[-1] != k_cache.shape[-1]:
        raise ValueError(f"q head_dim {q.shape[-1]} differs from the cache's head_dim {k_cache.shape[-1]}")
    if q.shape[-2] % k_cache.shape[0]:
        raise ValueError(f"{q.shape[-2]} query heads are not a multiple of {k_cache.shape[0]} KV heads")
    if block_tables.shape[0] != context_lens.shape[0]:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but context_lens {context_lens.shape[0]}")


def _native_fits(q, k_cache) -> bool:
    """Whether CPUs run the native kernel for these arrays (else the interpreted Pallas kernel).

    ``PALLAS_PAGED_CPU_ATTENTION=pallas`` chooses the Pallas kernel, for comparisons; it is
    read when a function is traced.
    """
    if os.environ.get("PALLAS_PAGED_CPU_ATTENTION", "native") == "pallas":
        return False
    if jax.default_backend() != "cpu":  # a GPU or TPU host: do not build a kernel it will not run
        return False
    return native.supports(q.dtype, k_cache.dtype, q.shape[-1]) and native.available()


def _cpu_kernel(native_kernel, pallas_kernel, q, k_cache, scale):
    """What CPUs run: ``native_kernel`` where it fits, else ``pallas_kernel`` in interpret mode."""
    if _native_fits(q, k_cache):
        return functools.partial(native_kernel, scale=scale)
    return functools.partial(pallas_kernel, scale=scale, tiling=tiling.CPU, interpret=True)


def cuda_capability() -> float | None:
    """The compute capability of this process's CUDA GPU (9.0 for an H100), or None without
    one (a CPU exporting for ``cuda`` knows no generation)."""
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:  # no GPU backend
        return None
    try:
        return float(getattr(device, "compute_capability", ""))
    except ValueError:  # not CUDA's numbering (ROCm names its generations: gfx90a)
        return None


def hopper_gpu() -> bool:
    """Whether this process's GPU is a Hopper (compute capability 9.x), the generation the
    Mosaic GPU kernels are written for: wgmma is sm_90a's, and Blackwell (10.x) has others."""
    capability = cuda_capability()
    return bool(capability) and int(capability) == tiling.HOPPER.generation


def hopper_or_later() -> bool:
    """Whether this process's GPU is a Hopper or a later generation (cuDNN's packed layout,
    :mod:`prompts`, needs one)."""
    capability = cuda_capability()
    return bool(capability) and capability >= tiling.HOPPER.generation


def gpu_kernel(q, k_cache) -> str:
    """Which kernels a CUDA GPU runs for attention over these arrays (decode and ragged):
    ``"mosaic"`` (:mod:`hopper`) or ``"triton"`` (:mod:`decode`, :mod:`ragged`).

    q: [tokens, q_heads, d]; k_cache: [kv_heads, blocks, block_size, d] (shapes and dtypes
    are all it reads). ``PALLAS_PAGED_GPU_ATTENTION``: ``auto`` (the default) runs Mosaic GPU
    on a Hopper (:func:`hopper_gpu`) where :data:`tiling.HOPPER` is enabled; ``mosaic`` or
    ``triton`` choose, whatever the GPU (``mosaic``: for the shapes it takes, see
    :func:`hopper.supports`; Triton for the others). Read when a function is traced.
    """
    choice = os.environ.get("PALLAS_PAGED_GPU_ATTENTION", "auto")
    if choice not in ("auto", "mosaic", "triton"):
        raise ValueError(f"PALLAS_PAGED_GPU_ATTENTION must be auto, mosaic or triton, not {choice!r}")
    kv_heads, _, block_size, head_dim = k_cache.shape
    knobs = tiling.HOPPER
    fits = hopper.supports(q.dtype, k_cache.dtype, q.shape[-2], kv_heads, head_dim, block_size, knobs.keys_per_step)
    if choice == "auto":
        choice = "mosaic" if knobs.enabled and hopper_gpu() else "triton"
    return "mosaic" if choice == "mosaic" and fits else "triton"


def cudnn_prompts(q, k_cache) -> bool:
    """Whether a CUDA GPU runs steps of whole fresh prompts through cuDNN's flash attention
    (:mod:`prompts`). q: [tokens, q_heads, d]; k_cache: [kv_heads, blocks, block_size, d]
    (their dtypes and q's head size are all it reads).
    ``PALLAS_PAGED_CUDNN_PROMPTS`` (1 or 0) if set, else where :data:`tiling.HOPPER`'s
    ``cudnn_prompts`` is on and the GPU is a Hopper or later (cuDNN's packed layout needs one;
    ``=1`` on an older GPU fails to compile); and only for the queries it takes
    (:func:`prompts.supports`)."""
    return (prompts.enabled(tiling.HOPPER.cudnn_prompts and hopper_or_later())
            and prompts.supports(q.dtype, k_cache.dtype, q.shape[-1]))


def _cuda_kernel(q, k_cache, scale, *, triton, mosaic):
    """What a CUDA GPU runs for an op over q [tokens, q_heads, d] and k_cache [kv_heads,
    blocks, block_size, d] (:func:`gpu_kernel`): ``triton`` or ``mosaic``, given ``scale``."""
    if gpu_kernel(q, k_cache) == "triton":
        return functools.partial(triton, scale=scale, tiling=tiling.GPU, interpret=False)
    return functools.partial(mosaic, scale=scale)


def hopper_paged_attention(q, k_cache, v_cache, block_tables, context_lens, *, scale, interpret=False):
    """:func:`hopper.paged_attention` with :data:`tiling.HOPPER`'s knobs and its splits; q
    (16-bit or float32, :func:`hopper.supports`) scaled and in the cache's dtype as the Triton
    kernels multiply it (:func:`precision.scaled_query`), the output back in q's dtype."""
    knobs = tiling.HOPPER
    steps = -(-block_tables.shape[1] * k_cache.shape[2] // knobs.keys_per_step)
    splits = knobs.decode_splits(q.shape[0] * k_cache.shape[0], steps)
    return hopper.paged_attention(precision.scaled_query(q, scale, k_cache.dtype), k_cache, v_cache, block_tables,
                                  context_lens, scale=1.0, keys_per_step=knobs.keys_per_step, stages=knobs.stages,
                                  splits=splits, interpret=interpret).astype(q.dtype)


def hopper_ragged_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *, scale,
                                  interpret=False):
    """:func:`hopper.ragged_paged_attention` with :data:`tiling.HOPPER`'s knobs; q as
    :func:`hopper_paged_attention` takes it."""
    knobs = tiling.HOPPER
    return hopper.ragged_paged_attention(precision.scaled_query(q, scale, k_cache.dtype), k_cache, v_cache,
                                         block_tables, context_lens, query_start_loc, scale=1.0,
                                         keys_per_step=knobs.keys_per_step, stages=knobs.stages,
                                         interpret=interpret).astype(q.dtype)


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, *, scale=None):
    """Decode attention: one query token per sequence, through block tables.

    q: [num_seqs, num_q_heads, head_dim]; k_cache, v_cache: [num_kv_heads,
    num_blocks, block_size, head_dim]; block_tables: int32[num_seqs, max_blocks];
    context_lens: int32[num_seqs] (the query is the last of these tokens; 0
    marks a padding row, which returns zeros). GQA when num_q_heads is a
    multiple of num_kv_heads. ``scale`` defaults to ``head_dim ** -0.5``.
    Returns [num_seqs, num_q_heads, head_dim].
    """
    assert q.shape[0] == block_tables.shape[0], "one query token per sequence"
    _check(q, k_cache, v_cache, block_tables, context_lens)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    common = functools.partial(decode.paged_attention, scale=scale)
    return jax.lax.platform_dependent(
        q, k_cache, v_cache, block_tables, context_lens,
        cpu=_cpu_kernel(native.paged_attention, decode.paged_attention, q, k_cache, scale),
        cuda=_cuda_kernel(q, k_cache, scale, triton=decode.paged_attention, mosaic=hopper_paged_attention),
        rocm=functools.partial(common, tiling=tiling.GPU, interpret=False),
        tpu=functools.partial(decode_tpu.paged_attention, scale=scale, interpret=False),
    )


def ragged_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *, scale=None,
                           new_kv=None):
    """Causal attention for any mix of prefill chunks and decodes in one call.

    q: [num_tokens, num_q_heads, head_dim]; sequence i owns query rows
    ``query_start_loc[i]:query_start_loc[i+1]`` (int32[num_seqs + 1]), which are
    the last positions of its ``context_lens[i]`` tokens, so a prompt whose
    prefix is already cached computes only its suffix. Rows past
    ``query_start_loc[-1]`` are padding and return zeros. new_kv: optionally (k, v),
    the step's own keys and values in token order ([num_tokens, num_kv_heads, head_dim]
    each, as written to the cache): a Hopper GPU may then attend over them with cuDNN's
    flash attention when no sequence has a cached prefix (:func:`cudnn_prompts`).
    Returns [num_tokens, num_q_heads, head_dim].
    """
    _check(q, k_cache, v_cache, block_tables, context_lens)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    common = functools.partial(ragged.ragged_paged_attention, scale=scale)
    cuda = _cuda_kernel(q, k_cache, scale, triton=ragged.ragged_paged_attention, mosaic=hopper_ragged_paged_attention)
    if cudnn_prompts(q, k_cache) and new_kv is not None:  # the setting checked on every ragged call
        cuda = prompts.or_paged(cuda, new_kv, scale)
    return jax.lax.platform_dependent(
        q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
        cpu=_cpu_kernel(native.ragged_paged_attention, ragged.ragged_paged_attention, q, k_cache, scale),
        cuda=cuda,
        rocm=functools.partial(common, tiling=tiling.GPU, interpret=False),
        tpu=functools.partial(decode_tpu.ragged_paged_attention, scale=scale),
    )
