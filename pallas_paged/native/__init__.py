"""Native CPU kernels: C++ XLA FFI custom calls, built on first use.

* Paged attention (``paged_attention.cc``). XLA:CPU runs an interpreted Pallas kernel as
  a loop of small ops on one core; this kernel does the same math with SIMD on every core.
* Matrix products (``matmul.cc``) for CPUs with AVX512-BF16, on bfloat16 or float32 weights
  packed for it ahead of time: XLA:CPU runs bfloat16 ones in float32 at about half the speed,
  and float32 ones at about 60% of the kernel's speed at 32 rows.

Both are compiled with the machine's C++ compiler (``CXX``, else ``g++``) against jaxlib's FFI
headers into the cache directory (``$PALLAS_PAGED_CACHE_DIR/native``, default
``~/.cache/pallas-paged/native``), keyed by the source, the flags, the compiler, jaxlib's
version and the CPU, so later processes only load it; a build deletes all but the newest few
there. With caching off (``PALLAS_PAGED_CACHE_DIR`` empty) each process builds its own copy
in a private temporary directory.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading

import jax
import jaxlib
import numpy as np

logger = logging.getLogger(__name__)

SOURCES = tuple(pathlib.Path(__file__).with_name(name) for name in ("paged_attention.cc", "matmul.cc"))
TARGET = "pallas_paged_ragged_attention"
MATMUL_TARGET = "pallas_paged_matmul"
GATED_MATMUL_TARGET = "pallas_paged_gated_matmul"
ARGMAX_HEAD_TARGET = "pallas_paged_argmax_head"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fPIC", "-fopenmp-simd", "-fno-math-errno")  # then linked -shared
BUILD_TIMEOUT_SECONDS = 300
KEPT_BUILDS = 4  # in the cache directory, newest first (see _prune)
_lock = threading.Lock()


class NativeBuildError(RuntimeError):
    """The C++ kernel could not be compiled (no compiler, or it failed)."""


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("PALLAS_PAGED_CACHE_DIR")
    if root == "":  # caching off: a directory no other user can have prepared, removed at exit
        private = tempfile.mkdtemp(prefix="pallas-paged-native-")
        atexit.register(shutil.rmtree, private, ignore_errors=True)
        return pathlib.Path(private)
    return pathlib.Path(root or pathlib.Path.home() / ".cache" / "pallas-paged") / "native"


def _compiler() -> list[str]:
    command = shlex.split(os.environ.get("CXX", "")) or [shutil.which("g++") or shutil.which("c++") or ""]
    if not command[0]:
        raise NativeBuildError("no C++ compiler found (install g++ or set CXX)")
    return command


def _run(command: list[str], what: str) -> str:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NativeBuildError(f"{what}: {error}") from error
    if result.returncode:
        raise NativeBuildError(f"{what}:\n{result.stderr[-4000:]}")
    return result.stdout


def _cpu_features() -> str:
    """What ``-march=native`` depends on: the CPU's architecture and feature flags."""
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    features = next((line for line in lines if line.split(":")[0].strip() in ("flags", "Features")), "")
    return f"{platform.machine()} {features}"


def _library_path(compiler: list[str]) -> pathlib.Path:
    version = _run([*compiler, "--version"], f"{shlex.join(compiler)} --version failed")
    key = hashlib.sha256()
    sources = [source.read_bytes() for source in SOURCES]
    for part in (*sources, " ".join(FLAGS), jaxlib.__version__, shlex.join(compiler), version, _cpu_features()):
        key.update(part if isinstance(part, bytes) else part.encode())
    return _cache_dir() / f"kernels-{key.hexdigest()[:16]}.so"


def _build(path: pathlib.Path, compiler: list[str]) -> None:
    """Compile each source on its own core (paged attention takes about 8 s here, the
    products 4 s: together, 13.6 s), then link them into ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    logger.info("compiling the native CPU kernels (%s) into %s", ", ".join(source.name for source in SOURCES), path)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        objects = [pathlib.Path(scratch) / f"{source.stem}.o" for source in SOURCES]
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(SOURCES)) as pool:
            builds = [pool.submit(_run, [*compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", "-c", str(source), "-o",
                                         str(obj)], f"{shlex.join(compiler)} failed to compile {source.name}")
                      for source, obj in zip(SOURCES, objects)]
            for build in builds:
                build.result()
        partial = pathlib.Path(scratch) / path.name
        _run([*compiler, "-shared", *map(str, objects), "-o", str(partial)], f"{shlex.join(compiler)} failed to link "
             "the native CPU kernels")
        os.replace(partial, path)  # atomic: concurrent builders each publish a whole file
    _prune(path.parent, keep=KEPT_BUILDS)


def _prune(directory: pathlib.Path, *, keep: int) -> None:
    """Delete all but the ``keep`` newest builds in ``directory``: each change of source,
    compiler, jaxlib or CPU adds one (about 300 KB). A process that has an older one loaded
    keeps it (the file stays mapped); one that starts and wants it builds it again."""
    builds = []
    for build in directory.glob("kernels-*.so"):
        try:
            builds.append((build.stat().st_mtime, build))
        except FileNotFoundError:  # another process pruned it meanwhile
            continue
    for _, stale in sorted(builds, reverse=True)[keep:]:
        stale.unlink(missing_ok=True)


_library: ctypes.CDLL | None = None


def load() -> ctypes.CDLL:
    """Build (once per machine) and register the kernels with XLA:CPU; raises NativeBuildError."""
    global _library
    with _lock:
        if _library is None:
            compiler = _compiler()
            path = _library_path(compiler)
            if not path.exists():
                _build(path, compiler)
            library = ctypes.cdll.LoadLibrary(str(path))
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.PagedRaggedAttention), platform="cpu")
            jax.ffi.register_ffi_target(MATMUL_TARGET, jax.ffi.pycapsule(library.PallasPagedMatmul), platform="cpu")
            jax.ffi.register_ffi_target(GATED_MATMUL_TARGET, jax.ffi.pycapsule(library.PallasPagedGatedMatmul),
                                        platform="cpu")
            jax.ffi.register_ffi_target(ARGMAX_HEAD_TARGET, jax.ffi.pycapsule(library.PallasPagedArgmaxHead),
                                        platform="cpu")
            _library = library
        return _library


def start_loading() -> None:
    """Build or load the kernels on a thread of their own (:func:`available`), so that the
    caller can do other work meanwhile, such as reading a checkpoint: a first build takes
    seconds of the compiler's time. Their first use waits for it."""
    if jax.default_backend() == "cpu" and _library is None:
        threading.Thread(target=available, name="pallas-paged-native", daemon=True).start()


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
        logger.warning("native CPU kernels unavailable, using the interpreted Pallas kernel for attention "
                       "and XLA's dot for bfloat16 products: %s", error)
        return False
    return True


def matmul_available() -> bool:
    """Whether the native product (bfloat16 and float32) runs here: the CPU has AVX512-BF16.
    False, not an error, when the kernels cannot build."""
    return available() and bool(load().PallasPagedMatmulAvailable())


def matmul(x, *panels, rms_scale=None, eps: float = 0.0, residual=None):
    """x @ w_j for x: [M, K] and each w_j packed as ``panels[j]`` (:func:`pallas_paged.pack`):
    bfloat16 or float32 x with uint32 [N_j/64, K/2, 64] (float32 x rounded to bfloat16 in the
    call), or float32 x with float32 [N_j/64, K, 64] → one float32 [M, N_j] per weight, in a
    single call. rms_scale: [K], float32 or bfloat16: x (float32) is RMS-normalized first,
    ``x / sqrt(mean(x²) + eps) * rms_scale`` row by row. residual: float32 [M, N], added to
    the product (with one weight only). Check :func:`matmul_available` first.
    """
    load()
    shapes = [jax.ShapeDtypeStruct((x.shape[0], w.shape[0] * w.shape[2]), np.float32) for w in panels]
    call = jax.ffi.ffi_call(MATMUL_TARGET, shapes, vmap_method="sequential")
    return tuple(call(x, *_prologue_and_epilogue(rms_scale, residual), *panels, eps=np.float32(eps)))


def gated_matmul(x, gate, up, rms_scale=None, eps: float = 0.0):
    """silu(x @ gate) * (x @ up), float32 [M, N], for x: [M, K] and gate and up packed alike
    (as :func:`matmul` takes them, [N/64, ...], with its ``rms_scale`` and ``eps``), in a single
    call. Check :func:`matmul_available` first."""
    load()
    shape = jax.ShapeDtypeStruct((x.shape[0], gate.shape[0] * gate.shape[2]), np.float32)
    call = jax.ffi.ffi_call(GATED_MATMUL_TARGET, (shape,), vmap_method="sequential")
    return call(x, *_prologue_and_epilogue(rms_scale, None), gate, up, eps=np.float32(eps))[0]


def _prologue_and_epilogue(rms_scale, residual):
    """The products' rms_scale and residual operands: empty arrays ([0] and [0, 0]) for none."""
    return (np.zeros((0,), np.float32) if rms_scale is None else rms_scale,
            np.zeros((0, 0), np.float32) if residual is None else residual)


def argmax_head(x, exact, screen, rows, norms, argmax_rows):
    """A float32 head that can give only each row's arg-max exactly (see ``matmul.cc``), in one call.

    x: float32 [M, K]; exact: the head packed in float32, [N/64, K, 64]; screen: packed in
    bfloat16, uint32 [N/64, K/2, 64]; rows: the head's columns in memory order, float32
    [N, K] (a tied embedding); norms: float32 [N], the Euclidean norm of each of ``rows``;
    argmax_rows: int32 [], taken at run time. Returns float32 [M, N]: with argmax_rows 0,
    x @ head exactly as :func:`matmul` computes it; otherwise, in rows below argmax_rows,
    those logits where they may be the row's largest and a bfloat16 product's (below the
    largest) elsewhere, and zeros in the rows from argmax_rows on. Check
    :func:`matmul_available` first.
    """
    load()
    shape = jax.ShapeDtypeStruct((x.shape[0], exact.shape[0] * exact.shape[2]), np.float32)
    return jax.ffi.ffi_call(ARGMAX_HEAD_TARGET, shape, vmap_method="sequential")(
        x, x.astype(jax.numpy.bfloat16), exact, screen, rows, norms, jax.numpy.asarray(argmax_rows, np.int32))


def ragged_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *, scale):
    """Causal ragged attention; arguments and result as :func:`pallas_paged.ragged_paged_attention`.

    q: [tokens, q_heads, d]; k_cache, v_cache: [kv_heads, blocks, block_size, d];
    block_tables: int32[seqs, max_blocks]; context_lens: int32[seqs];
    query_start_loc: int32[seqs + 1]. Returns [tokens, q_heads, d].
    """
    load()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")
    return call(q, k_cache, v_cache, block_tables.astype(np.int32), context_lens.astype(np.int32),
                query_start_loc.astype(np.int32), scale=np.float32(scale))


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, *, scale):
    """Decode attention, one query token per sequence: the ragged case with one row each.

    q: [seqs, q_heads, d] → [seqs, q_heads, d]; a row with context 0 returns zeros.
    """
    query_start_loc = jax.numpy.arange(q.shape[0] + 1, dtype=np.int32)
    return ragged_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale=scale)
