"""The real SmolLM2-135M-Instruct GGUF against Hugging Face on the same dequantised weights."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from paged_batch import PagedModel, greedy

import models

pytestmark = pytest.mark.slow


def _paged(config, params):
    return PagedModel(config, params, block_size=16, max_len=128, max_seqs=4)


def test_greedy_matches_hf_generate(smollm2, hf_smollm2):
    config, params, tokenizer = smollm2
    ours = greedy(_paged(config, params), hf_smollm2.prompts, hf_smollm2.new_tokens)
    for prompt, got, want in zip(hf_smollm2.prompts, ours, hf_smollm2.continuations):
        assert got[: len(want)] == want, (tokenizer.decode(prompt), tokenizer.decode(got), tokenizer.decode(want))
    assert "Paris" in tokenizer.decode(ours[0])


def test_gguf_and_safetensors_routes_agree(smollm2, hf_smollm2, hf_smollm2_safetensors):
    """The GGUF and the safetensors saved from HF's load of it give the same parameters and logits."""
    config, params, tokenizer = smollm2
    st_config, st_params, st_tokenizer = models.load_model(hf_smollm2_safetensors)
    assert st_config == config
    jax.tree.map(np.testing.assert_array_equal, st_params, params)
    got = _paged(st_config, st_params).prefill(hf_smollm2.prompts)
    want = _paged(config, params).prefill(hf_smollm2.prompts)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    chat = [{"role": "user", "content": "hi"}]
    assert st_tokenizer.apply_chat_template(chat) == tokenizer.apply_chat_template(chat)


_MEASURE_LOAD = """
import json, resource, jax, models
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
_, params, _ = models.load_model()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"growth": (peak - before) * 1024, "params": sum(x.nbytes for x in jax.tree.leaves(params))}))
"""


def test_loading_peak_memory_under_twice_the_params():
    """Peak RSS growth while loading (weights, tokenizer, mapped file) stays under 2x the f32 parameters."""
    result = subprocess.run([sys.executable, "-c", _MEASURE_LOAD], capture_output=True, text=True, check=True,
                            env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["growth"] < 2 * measured["params"], measured
