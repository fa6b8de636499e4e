"""Flash-decoding: a decode's keys split over several programs and the partial softmaxes merged,
against the dense oracle in interpret mode (the Triton source, GPU tiling included), and the rule
that chooses the split."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_paged import decode, reference, tiling
from tests.pallas_paged.scenarios import assert_close, decode_seqs, make

TILINGS = {
    # The CPU's tiling (all heads in one program), made to split into up to 16 programs.
    "cpu-split": dataclasses.replace(tiling.CPU, target_programs=16),
    # The GPU's own (a program per KV head, 4 blocks per step, gathered; two programs per SM).
    "gpu": tiling.GPU,
}


def _run(name: str, s, dtype=jnp.float32):
    def call(*args):
        return decode.paged_attention(*args, scale=s.q.shape[-1] ** -0.5, tiling=TILINGS[name], interpret=True)
    return jax.jit(call)(*s.decode_args)


@pytest.mark.parametrize("name", list(TILINGS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_split_decode_matches_oracle(name, dtype):
    """Contexts shorter than one step, than the splits, exactly a step, and long; GQA 9/3."""
    s = make(decode_seqs([1, 16, 64, 65, 700, 130]), q_heads=9, kv_heads=3, head_dim=64, block_size=16,
             dtype=dtype, seed=3)
    programs = len(s.context_lens) * (1 if name == "cpu-split" else 3)
    assert TILINGS[name].decode_splits(programs, s.block_tables.shape[1]) > 1  # the case under test splits
    actual = _run(name, s)
    assert actual.dtype == dtype
    assert_close(actual, reference.paged_attention(*s.decode_args), dtype)


@pytest.mark.parametrize("name", list(TILINGS))
def test_split_decode_padding_rows_are_zero(name):
    s = make(decode_seqs([300, 9, 40]), q_heads=4, kv_heads=2, head_dim=64, block_size=16)
    s = dataclasses.replace(s, context_lens=s.context_lens.at[1].set(0))
    out = _run(name, s)
    assert np.isfinite(np.asarray(out)).all() and not np.asarray(out[1]).any()
    expected = reference.paged_attention(*s.decode_args)
    assert_close(out[::2], expected[::2], jnp.float32)


def test_the_split_fills_the_gpu_and_stops_at_one_program_per_step():
    gpu = tiling.GPU  # two programs per SM of an H100
    assert gpu.decode_splits(programs=8 * 8, max_steps=8192 // 64) == 5  # 8 long sequences x 8 KV heads
    assert gpu.decode_splits(programs=256 * 8, max_steps=2048 // 64) == 1  # enough programs already
    assert gpu.decode_splits(programs=4, max_steps=3) == 3  # no more programs than steps
    assert tiling.CPU.decode_splits(programs=1, max_steps=100) == 1  # the CPU's interpreted kernel never splits
    assert tiling.GPU_BEFORE_ISSUE_41.decode_splits(programs=1, max_steps=100) == 1
