"""The kernels lower for accelerators this machine does not have.

Exporting for ``cuda`` runs the Triton lowering of the Pallas kernels and
for ``tpu`` the Mosaic lowering, under an abstract mesh of the target
device; a broken kernel fails here, not on someone's GPU.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

import pallas_paged
from pallas_paged import native

TRITON = "__gpu$xla.gpu.triton"
MOSAIC_GPU = "mosaic_gpu_v2"
TARGETS = {
    "cuda": ("NVIDIA H100 80GB HBM3", "gpu", 132, TRITON),
    "tpu": ("TPU v5 lite", "tpu", 1, "tpu_custom_call"),
}
SHAPES = [  # q_heads, kv_heads, head_dim, block_size, dtype
    pytest.param(9, 3, 64, 16, jnp.float32, id="smollm2-f32"),
    pytest.param(32, 8, 128, 8, jnp.bfloat16, id="gqa32-8-bf16"),
    pytest.param(8, 8, 128, 32, jnp.float32, id="mha-f32"),
]


def export(fn, args, platform):
    kind, abstract_platform, cores, _ = TARGETS[platform]
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,),
                        abstract_device=AbstractDevice(device_kind=kind, num_cores=cores, platform=abstract_platform))
    with use_abstract_mesh(mesh), pallas_paged.lowering.quietly():
        exported = jax.export.export(
            jax.jit(fn), platforms=(platform,),
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)],
        )(*args)
    exported.serialize()  # needs flatbuffers; proves the artifact is complete
    return exported.mlir_module()


def attention_args(q_heads, kv_heads, head_dim, block_size, dtype, *, tokens, seqs=4):
    blocks, max_blocks = 64, 8
    cache = jax.ShapeDtypeStruct((kv_heads, blocks, block_size, head_dim), dtype)
    return [
        jax.ShapeDtypeStruct((tokens, q_heads, head_dim), dtype), cache, cache,
        jax.ShapeDtypeStruct((seqs, max_blocks), jnp.int32), jax.ShapeDtypeStruct((seqs,), jnp.int32),
    ]


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,dtype", SHAPES)
def test_decode_lowers_to_a_kernel(platform, q_heads, kv_heads, head_dim, block_size, dtype):
    args = attention_args(q_heads, kv_heads, head_dim, block_size, dtype, tokens=4)
    assert TARGETS[platform][3] in export(pallas_paged.paged_attention, args, platform)


@pytest.mark.parametrize("seqs", [4, 512], ids=["split", "one-program-each"])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (32, 8, 128, 8), (8, 8, 128, 32)])
def test_hopper_decode_lowers_to_a_mosaic_gpu_kernel(monkeypatch, q_heads, kv_heads, head_dim, block_size, seqs):
    """With the Mosaic GPU kernel chosen (as on an sm90 GPU where ``tiling.HOPPER`` is enabled),
    its whole lowering runs here: the wgmma products, TMA copies and register layouts. Few
    sequences split their keys over programs; 512 do not."""
    monkeypatch.setenv("PALLAS_PAGED_GPU_ATTENTION", "mosaic")
    args = attention_args(q_heads, kv_heads, head_dim, block_size, jnp.bfloat16, tokens=seqs, seqs=seqs)
    fresh = lambda *arrays: pallas_paged.paged_attention(*arrays)  # noqa: E731 - not an earlier trace's cache entry
    module = export(fresh, args, "cuda")
    assert MOSAIC_GPU in module and TRITON not in module


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (32, 8, 128, 8), (8, 8, 128, 32)])
def test_hopper_ragged_lowers_to_a_mosaic_gpu_kernel(monkeypatch, q_heads, kv_heads, head_dim, block_size):
    monkeypatch.setenv("PALLAS_PAGED_GPU_ATTENTION", "mosaic")
    args = attention_args(q_heads, kv_heads, head_dim, block_size, jnp.bfloat16, tokens=100)
    args.append(jax.ShapeDtypeStruct((5,), jnp.int32))
    fresh = lambda *arrays: pallas_paged.ragged_paged_attention(*arrays)  # noqa: E731 - not an earlier trace's
    module = export(fresh, args, "cuda")
    assert MOSAIC_GPU in module and TRITON not in module


def test_hopper_tma_copies_start_at_whole_tiles(monkeypatch):
    """Mosaic GPU lays its 8-row tiles over memory too: a TMA copy into a tiled buffer from a
    dynamic row of memory cuts through them, and on a GPU the rows past a tile's edge come back
    as zeros, silently (interpret mode slices memory directly, so its tests cannot see it). Every
    tiled copy of the Hopper kernels must address the tiled dimensions statically."""
    from jax.experimental.mosaic.gpu import launch_context

    tiled_dims, original = [], launch_context.LaunchContext._prepare_async_copy

    def spy(self, gmem_ref, gmem_slice, gmem_transform, *args, **kwargs):
        if gmem_transform:
            tiled_dims.append(tuple(static_start(index) for index in gmem_slice[-2:]))
        return original(self, gmem_ref, gmem_slice, gmem_transform, *args, **kwargs)

    monkeypatch.setattr(launch_context.LaunchContext, "_prepare_async_copy", spy)
    monkeypatch.setenv("PALLAS_PAGED_GPU_ATTENTION", "mosaic")
    for seqs in (4, 512):  # split and not
        args = attention_args(8, 2, 64, 16, jnp.bfloat16, tokens=seqs, seqs=seqs)
        export(lambda *arrays: pallas_paged.paged_attention(*arrays), args, "cuda")
    args = attention_args(8, 2, 64, 16, jnp.bfloat16, tokens=100) + [jax.ShapeDtypeStruct((5,), jnp.int32)]
    export(lambda *arrays: pallas_paged.ragged_paged_attention(*arrays), args, "cuda")
    assert tiled_dims and set(tiled_dims) == {(True, True)}, "a tiled TMA copy starts at a dynamic row or column"


def static_start(index) -> bool:
    """Whether one dimension's index of a Mosaic GPU copy starts where lowering knows it: a
    slice, or a slice whose start is a constant (JAX 0.12 passes those as casts of constants)."""
    if isinstance(index, slice):
        return True
    start = getattr(index, "base", index)
    while getattr(getattr(start, "owner", None), "name", None) == "arith.index_cast":
        start = start.owner.operands[0]
    return isinstance(start, int) or getattr(getattr(start, "owner", None), "name", None) == "arith.constant"


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,dtype", SHAPES)
def test_ragged_lowers_to_a_triton_kernel(q_heads, kv_heads, head_dim, block_size, dtype):
    args = attention_args(q_heads, kv_heads, head_dim, block_size, dtype, tokens=40)
    args.append(jax.ShapeDtypeStruct((5,), jnp.int32))
    assert TRITON in export(pallas_paged.ragged_paged_attention, args, "cuda")


def test_ragged_on_tpu_exports_the_xla_formulation():
    args = attention_args(8, 8, 128, 16, jnp.bfloat16, tokens=40) + [jax.ShapeDtypeStruct((5,), jnp.int32)]
    module = export(pallas_paged.ragged_paged_attention, args, "tpu")
    assert "tpu_custom_call" not in module and "gather" in module


def test_cpu_runs_the_native_kernel_not_the_accelerator_ones():
    args = attention_args(9, 3, 64, 16, jnp.float32, tokens=4)
    module = jax.jit(pallas_paged.paged_attention).lower(*args).as_text()
    assert TRITON not in module and "tpu_custom_call" not in module
    assert native.TARGET in module


def test_only_the_triton_deprecation_is_silenced():
    """JAX 0.11+ warns at every Triton lowering; :func:`pallas_paged.lowering.quietly` drops that
    warning (the engine lowers dozens of programs at start-up) and lets every other one through."""
    args = attention_args(9, 3, 64, 16, jnp.float32, tokens=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export(pallas_paged.paged_attention, args, "cuda")
        with pallas_paged.lowering.quietly():
            warnings.warn("something else", DeprecationWarning)
    assert [str(w.message) for w in caught] == ["something else"]
