"""float32 means float32: every matrix product of the GPU kernels, the oracle and the models'
matmuls asks for full float32 precision with float32 operands (Triton and XLA on NVIDIA GPUs
otherwise use TF32, 1e-3 off the oracle), and keeps the default for bfloat16 ones."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import pallas_paged
from pallas_paged import decode, ragged, reference, tiling

HIGHEST, DEFAULT = jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT


def dot_precisions(jaxpr) -> set:
    """The precision of every ``dot_general`` in ``jaxpr`` and the jaxprs inside it (kernels, loops)."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            precision = eqn.params["precision"]
            found.add(precision[0] if isinstance(precision, tuple) else precision)
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else [value]:
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    found |= dot_precisions(inner)
    return found


def attention_args(dtype, tokens):
    cache = jax.ShapeDtypeStruct((3, 32, 16, 64), dtype)
    return [jax.ShapeDtypeStruct((tokens, 9, 64), dtype), cache, cache, jax.ShapeDtypeStruct((4, 8), jnp.int32),
            jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((5,), jnp.int32)]


GPU_KERNELS = {
    "decode": (functools.partial(decode.paged_attention, scale=0.125, tiling=tiling.GPU, interpret=False), 4),
    "ragged": (functools.partial(ragged.ragged_paged_attention, scale=0.125, tiling=tiling.GPU, interpret=False), 40),
}


@pytest.mark.parametrize("kernel", GPU_KERNELS)
@pytest.mark.parametrize("dtype,expected", [(jnp.float32, HIGHEST), (jnp.bfloat16, DEFAULT)], ids=["f32", "bf16"])
def test_gpu_kernels_multiply_float32_in_full_precision(kernel, dtype, expected):
    fn, tokens = GPU_KERNELS[kernel]
    args = attention_args(dtype, tokens)
    jaxpr = jax.make_jaxpr(fn)(*(args if kernel == "ragged" else args[:5]))
    assert dot_precisions(jaxpr.jaxpr) == {expected}


def test_the_oracle_multiplies_in_full_precision():
    q, k = jnp.ones((2, 3, 4, 8)), jnp.ones((2, 2, 5, 8))
    jaxpr = jax.make_jaxpr(reference._attend)(q, k, k, jnp.ones((2, 3, 5), bool), 0.5)
    assert dot_precisions(jaxpr.jaxpr) == {HIGHEST}


@pytest.mark.parametrize("dtype,expected", [(jnp.float32, HIGHEST), (jnp.bfloat16, DEFAULT)], ids=["f32", "bf16"])
def test_model_matmuls_multiply_float32_in_full_precision(dtype, expected):
    jaxpr = jax.make_jaxpr(pallas_paged.matmul)(jnp.ones((2, 64)), jnp.ones((64, 128), dtype))
    assert dot_precisions(jaxpr.jaxpr) == {expected}
