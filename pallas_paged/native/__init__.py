"""Native paged attention for CPUs: a C++ XLA FFI custom call, built on first use.

XLA:CPU runs an interpreted Pallas kernel as a loop of small ops on one core; this
kernel does the same math (``paged_attention.cc``) with SIMD on every core. It is
compiled with the machine's C++ compiler against jaxlib's FFI headers into the
cache directory (``PALLAS_PAGED_CACHE_DIR``, default ``~/.cache/pallas-paged``),
keyed by the source, the flags and jaxlib's version, so later processes only load it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

import jax
import jaxlib
import numpy as np

logger = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("paged_attention.cc")
TARGET = "pallas_paged_ragged_attention"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fPIC", "-shared", "-fopenmp-simd", "-fno-math-errno")


class NativeBuildError(RuntimeError):
    """The C++ kernel could not be compiled (no compiler, or it failed)."""


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("PALLAS_PAGED_CACHE_DIR")
    if root == "":
        return pathlib.Path(tempfile.gettempdir()) / f"pallas-paged-native-{os.getuid()}"
    return pathlib.Path(root or pathlib.Path.home() / ".cache" / "pallas-paged") / "native"


def _library_path(compiler: str) -> pathlib.Path:
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), jaxlib.__version__.encode(), compiler.encode(),
                 _cpu_flags().encode()):
        key.update(part)
    return _cache_dir() / f"paged_attention-{key.hexdigest()[:16]}.so"


def _cpu_flags() -> str:
    """The CPU's feature flags: ``-march=native`` output depends on them."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build(path: pathlib.Path, compiler: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so", delete=False) as tmp:
        partial = pathlib.Path(tmp.name)
    command = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(partial)]
    logger.info("compiling the native attention kernel: %s", " ".join(command))
    try:
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            raise NativeBuildError(f"{compiler} failed to build {SOURCE.name}:\n{result.stderr[-4000:]}")
        os.replace(partial, path)  # atomic: concurrent builders each publish a whole file
    finally:
        partial.unlink(missing_ok=True)


@functools.cache
def load() -> None:
    """Build (once per machine) and register the kernel with XLA:CPU; raises NativeBuildError."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise NativeBuildError("no C++ compiler found (install g++ or set CXX)")
    path = _library_path(compiler)
    if not path.exists():
        _build(path, compiler)
    library = ctypes.cdll.LoadLibrary(str(path))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.PagedRaggedAttention), platform="cpu")


def supports(q_dtype, cache_dtype, head_dim: int) -> bool:
    """Whether the kernel handles these dtypes (each float32 or bfloat16) and head size (a multiple of 16)."""
    handled = (np.dtype(np.float32), np.dtype(jax.numpy.bfloat16))
    return np.dtype(q_dtype) in handled and np.dtype(cache_dtype) in handled and head_dim % 16 == 0


@functools.cache
def available() -> bool:
    """Whether the native kernel can run here; logs why not, once, if it cannot."""
    try:
        load()
    except (NativeBuildError, OSError) as error:
        logger.warning("native CPU attention unavailable, using the interpreted Pallas kernel: %s", error)
        return False
    return True


def ragged_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *, scale):
    """Causal ragged attention; arguments and result as :func:`pallas_paged.ragged_paged_attention`.

    q: [tokens, q_heads, d]; k_cache, v_cache: [kv_heads, blocks, block_size, d];
    block_tables: int32[seqs, max_blocks]; context_lens: int32[seqs];
    query_start_loc: int32[seqs + 1]. Returns [tokens, q_heads, d].
    """
    load()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, k_cache, v_cache, block_tables.astype(np.int32), context_lens.astype(np.int32),
                query_start_loc.astype(np.int32), scale=np.float32(scale))


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, *, scale):
    """Decode attention, one query token per sequence: the ragged case with one row each.

    q: [seqs, q_heads, d] → [seqs, q_heads, d]; a row with context 0 returns zeros.
    """
    query_start_loc = jax.numpy.arange(q.shape[0] + 1, dtype=np.int32)
    return ragged_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale=scale)
