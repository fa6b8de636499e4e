"""XLA options for the programs that use the kernels and cache operations."""

from __future__ import annotations


def compiler_options(platform: str) -> dict:
    """XLA options for programs that call the kernels or the cache operations, when compiled
    for ``platform``: pass them to ``jax.jit(f).lower(...).compile(compiler_options=...)``.

    On CPU, bfloat16 float normalization is off. That pass rewrites every bfloat16 op XLA:CPU
    does not emit natively (scatter, select, concatenate) into float32 ops between conversions,
    and on a cache the conversions are of the whole cache: ``write_kv`` copied it twice per
    call, and attention converted it whole. With a bfloat16 cache, SmolLM2's 30 layers took
    0.7 s per decode step of 32 sequences instead of 70 ms. Without the pass, 16-bit scatters
    update the cache in place, and bfloat16 products go to XLA:CPU's YNN fusions, which run
    them natively. float32 programs compile the same either way.

    The cost: a bfloat16 product that the YNN fusions do not take (some batched einsums, such
    as the dense prefill baseline of ``benchmarks/kernels.py``) fails when run ("Unsupported
    element type for DotThunk"). Every product in the kernels and the models is one they take; the tests run
    the kernels in bfloat16 with these options for every head layout.
    """
    if platform != "cpu":
        return {}
    return {"xla_disable_hlo_passes": "float-normalization-bf16"}
