"""The KV cache's dtype: "auto" follows the weights, and every program that writes a 16-bit
cache (the layers, copy-on-write, swapping in) updates it in place instead of copying it whole."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from engine import SamplingParams
from engine.worker import stages
from tests.engine.tiny import prompts, tiny_llm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_auto_kv_cache_dtype_is_the_weights_dtype(tmp_path, dtype):
    llm, _ = tiny_llm("llama_gqa_tied", tmp_path, dtype=dtype)
    assert {array.dtype for layer in llm.engine.cache.kv_caches for array in layer} == {jnp.dtype(dtype)}


def test_bfloat16_cache_programs_need_no_cache_sized_scratch(tmp_path):
    llm, config = tiny_llm("llama_gqa_tied", tmp_path, dtype="bfloat16", num_blocks=4096)
    llm.generate(prompts(4, config.vocab_size), SamplingParams(n=2, temperature=1.0, max_tokens=3, seed=0),
                 use_tqdm=False)
    cache = llm.engine.cache
    cache_bytes = cache.kv_caches[0][0].nbytes
    layers = [program for key, program in stages._compiled.items()
              if key[0] == "layer" and key[1] == llm.engine.model_config]
    assert layers, "the generate call compiled layer programs"
    ids = cache._device_ids([1, 2])
    swapped_in = cache.host_blocks[:, :, :, [0, 1]]
    block_programs = [cache._copy.lower(cache.kv_caches, ids, ids).compile(),
                      cache._scatter.lower(cache.kv_caches, swapped_in, ids).compile()]
    for program in layers + block_programs:
        assert program.memory_analysis().temp_size_in_bytes < cache_bytes
