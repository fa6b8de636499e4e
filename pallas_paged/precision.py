"""The precision every matrix product in this package asks for: float32 means float32.

With ``Precision.DEFAULT``, XLA on NVIDIA GPUs and Triton (the Pallas GPU kernels) multiply
float32 operands as TF32, with a 10-bit mantissa: on an H100 the attention kernels then
differed from the float32 oracle by up to 2e-3. ``HIGHEST`` asks for full float32 products
there; on CPUs it changes nothing, and 16-bit operands keep ``DEFAULT`` (their products are
exact in float32 accumulation already, and stay as fast as they were).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def for_operands(dtype) -> jax.lax.Precision:
    """``HIGHEST`` for float32 (or wider) operands, ``DEFAULT`` for 16-bit ones."""
    return jax.lax.Precision.HIGHEST if np.dtype(dtype).itemsize >= 4 else jax.lax.Precision.DEFAULT


SIXTEEN_BIT = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def takes_query(q_dtype, cache_dtype) -> bool:
    """Whether a kernel of 16-bit products (Mosaic GPU's, cuDNN's) takes queries of
    ``q_dtype`` over a cache of ``cache_dtype``: a 16-bit cache, and q of its dtype or float32
    (the engine's, made the operand by :func:`scaled_query`)."""
    return np.dtype(cache_dtype) in SIXTEEN_BIT and np.dtype(q_dtype) in (np.dtype(cache_dtype), np.dtype(np.float32))


def scaled_query(q, scale: float, dtype):
    """The query operand of a product with keys of ``dtype``, as the Triton kernels make it:
    ``q * scale`` in float32, then rounded to ``dtype``. q: [..., d] → [..., d] in ``dtype``.
    (Rounding first and scaling the scores after would differ by a rounding at head size 128,
    and overflow float16 where the scaled query does not.)"""
    return (q.astype(jnp.float32) * scale).astype(dtype)
