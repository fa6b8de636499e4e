"""Full ahead-of-time compilation for real accelerators, without them (``make test-accel``).

Needs the ``tpu`` and ``cuda`` extras (libtpu and the CUDA plugin), so it is
not part of the default suite. Unlike the lowering tests, this runs the
Mosaic and Triton compilers themselves, which catch resource limits (VMEM,
shared memory) and unsupported vector shapes.
"""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import topologies

import pallas_paged
from pallas_paged import tiling

pytestmark = pytest.mark.accel

SHAPES = [  # q_heads, kv_heads, head_dim, block_size, dtype
    pytest.param(9, 3, 64, 16, jnp.float32, id="smollm2-f32"),
    pytest.param(32, 8, 128, 16, jnp.bfloat16, id="llama8b-bf16"),
    pytest.param(8, 8, 128, 32, jnp.float32, id="mha-f32"),
]


def tpu_devices():
    pytest.importorskip("libtpu", reason="needs the tpu extra: pip install -e '.[tpu]'")
    return topologies.get_topology_desc("v5e:1x1", platform="tpu", chips_per_host_bounds=(1, 1, 1)).devices


H100_CONFIG_FILE = pathlib.Path(__file__).parent / "data" / "h100.txtpb"


def gpu_devices(topology: str = "1x1x1"):
    """Compile-only H100s (``topology``: one by default), described by ``data/h100.txtpb``
    (the CUDA plugin needs no GPU for this)."""
    if not any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (13, 12)):
        pytest.skip("needs the cuda extra: pip install -e '.[cuda]'")
    return topologies.get_topology_desc(platform="cuda", topology=topology,
                                        target_config=H100_CONFIG_FILE.read_text()).devices


def cudnn_prompts_for_h100(monkeypatch):
    """Turn cuDNN for whole fresh prompts on, for a compile-only H100: JAX asks the first GPU
    for its generation before it lowers cuDNN's packed layout, and such an H100 has no device
    to ask, so answer for it."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: float(capability) <= 9.0)
    monkeypatch.setattr(cudnn, "is_cuda_compute_capability_equal", lambda capability: capability == "9.0")
    monkeypatch.setenv("PALLAS_PAGED_CUDNN_PROMPTS", "1")


def compile_for(devices, fn, q_heads, kv_heads, head_dim, block_size, dtype, *, tokens, ragged, seqs=8):
    mesh = jax.sharding.Mesh(devices[:1], ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def spec(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=replicated)

    blocks, max_blocks = 256, 32
    cache = spec((kv_heads, blocks, block_size, head_dim), dtype)
    args = [spec((tokens, q_heads, head_dim), dtype), cache, cache, spec((seqs, max_blocks), jnp.int32),
            spec((seqs,), jnp.int32)]
    if ragged:
        args.append(spec((seqs + 1,), jnp.int32))
    return jax.jit(fn).lower(*args).compile()


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,dtype", SHAPES)
def test_tpu_decode_compiles_for_v5e(q_heads, kv_heads, head_dim, block_size, dtype):
    compile_for(tpu_devices(), pallas_paged.paged_attention, q_heads, kv_heads, head_dim, block_size, dtype,
                tokens=8, ragged=False)


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,dtype", SHAPES)
@pytest.mark.parametrize("op", ["decode-split", "decode", "ragged"])
def test_gpu_kernels_compile_for_h100(q_heads, kv_heads, head_dim, block_size, dtype, op):
    """8 decoding sequences leave an H100 idle, so their keys are split over programs
    (flash-decoding); 512 do not."""
    fn = pallas_paged.ragged_paged_attention if op == "ragged" else pallas_paged.paged_attention
    seqs = 512 if op == "decode" else 8
    programs = seqs * kv_heads  # one program per (sequence, KV head) on a GPU
    if op != "ragged":
        max_steps = 32 // tiling.GPU.blocks_per_step(block_size)  # 32 blocks per table
        assert (tiling.GPU.decode_splits(programs, max_steps) > 1) == (op == "decode-split")
    compile_for(gpu_devices(), fn, q_heads, kv_heads, head_dim, block_size, dtype,
                tokens={"ragged": 64, "decode": seqs, "decode-split": seqs}[op], ragged=op == "ragged", seqs=seqs)


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (32, 8, 128, 16), (8, 8, 128, 32)])
@pytest.mark.parametrize("op", ["decode-split", "decode", "ragged"])
def test_mosaic_gpu_kernels_compile_for_h100(monkeypatch, q_heads, kv_heads, head_dim, block_size, op):
    """The Hopper kernels (``pallas_paged.hopper``, chosen here as on an sm90 GPU where they are
    enabled) fit an H100's shared memory: their compilation refuses a kernel that does not."""
    monkeypatch.setenv("PALLAS_PAGED_GPU_ATTENTION", "mosaic")
    public = pallas_paged.ragged_paged_attention if op == "ragged" else pallas_paged.paged_attention
    fresh = lambda *arrays: public(*arrays)  # noqa: E731 - not an earlier trace's cache entry
    seqs = 512 if op == "decode" else 8
    compiled = compile_for(gpu_devices(), fresh, q_heads, kv_heads, head_dim, block_size, jnp.bfloat16,
                           tokens={"ragged": 64, "decode": seqs, "decode-split": seqs}[op], ragged=op == "ragged",
                           seqs=seqs)
    assert "mosaic_gpu" in compiled.as_text()


def test_cudnn_for_fresh_prompts_compiles_for_h100(monkeypatch):
    """Ragged attention with the step's own K and V (``new_kv``) and cuDNN chosen for fresh
    prompts: the step's program holds both cuDNN's flash attention and the paged kernel."""
    cudnn_prompts_for_h100(monkeypatch)
    mesh = jax.sharding.Mesh(gpu_devices()[:1], ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    tokens, seqs, cache = 256, 4, spec((8, 256, 16, 128))
    args = [spec((tokens, 32, 128)), cache, cache, spec((seqs, 32), jnp.int32), spec((seqs,), jnp.int32),
            spec((seqs + 1,), jnp.int32), spec((tokens, 8, 128)), spec((tokens, 8, 128))]

    def step(q, k_cache, v_cache, tables, lens, starts, k, v):
        return pallas_paged.ragged_paged_attention(q, k_cache, v_cache, tables, lens, starts, new_kv=(k, v))

    text = jax.jit(step).lower(*args).compile().as_text()
    assert "__cudnn$fmha" in text and "triton" in text
