"""Paged forward passes of tiny random models against Hugging Face's forward on the full sequences
(HF's logits stored in tests/data/; see tests/hf_references.py)."""

from __future__ import annotations

import gc
import weakref

import jax.numpy as jnp
import numpy as np
import pytest
from paged_batch import PagedModel
from tiny_models import REFERENCE_DECODE_STEPS, REFERENCE_PROMPT_LENS, TINY_CONFIGS, reference_prompts, write_checkpoint

import models
import pallas_paged
from models.config import HF_MODEL_TYPES
from tests.hf_references import stored_tiny


def _paged_logits(model: PagedModel, prompts, refs):
    """Prefill all prompts in one batch, then decode HF's greedy tokens; per sequence float32[len, vocab]."""
    prefill = np.split(model.prefill(prompts, all_logits=True), np.cumsum(REFERENCE_PROMPT_LENS)[:-1])
    steps = [model.decode([ids[len(p) + step] for p, (ids, _) in zip(prompts, refs)])
             for step in range(REFERENCE_DECODE_STEPS)]
    return [np.concatenate([prefill[i], *(s[i : i + 1] for s in steps)]) for i in range(len(prompts))]


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_paged_forward_matches_hf(name, tmp_path):
    write_checkpoint(name, tmp_path)
    config, params, tokenizer = models.load_model(tmp_path)
    assert config.architecture == HF_MODEL_TYPES[TINY_CONFIGS[name]["model_type"]] and tokenizer is None
    prompts, refs = reference_prompts(config.vocab_size), stored_tiny(name)

    got = _paged_logits(PagedModel(config, params), prompts, refs)

    for prompt, (ids, want), logits in zip(prompts, refs, got):
        assert ids[: len(prompt)] == prompt
        assert logits.shape == want.shape
        np.testing.assert_allclose(logits, want, atol=1e-4, rtol=0)


def test_bfloat16_smoke(tmp_path):
    """bf16 weights, caches and activations stay within 0.1 of float32 HF logits (magnitudes ~3)."""
    write_checkpoint("llama_gqa_tied", tmp_path)
    config, params, _ = models.load_model(tmp_path, dtype="bfloat16")
    assert params["embed"].dtype == jnp.bfloat16
    prompts, refs = reference_prompts(config.vocab_size), stored_tiny("llama_gqa_tied")

    got = _paged_logits(PagedModel(config, params, dtype=jnp.bfloat16), prompts, refs)

    for (_, want), logits in zip(refs, got):
        assert logits.dtype == np.float32
        np.testing.assert_allclose(logits, want, atol=0.1, rtol=0)


@pytest.mark.skipif(not pallas_paged.packing_enabled(), reason="weights do not pack on this machine")
def test_packing_frees_each_weight_only_when_asked_to_consume(tmp_path):
    """The engine packs the tree it loaded with ``consume=True``, so each weight is freed once
    its packed copy exists (loading then peaks near the model's size, not twice it); without
    it, the caller's tree is left as it was."""
    write_checkpoint("llama_gqa_tied", tmp_path)
    _, params, _ = models.load_model(tmp_path)
    packable = lambda tree: [node for layer in tree["layers"] for node in _linears(layer)  # noqa: E731
                             if node["w"].ndim == 3 or pallas_paged.packable(node["w"])]
    weights = [node["w"] for node in packable(params)]
    assert weights and not any(pallas_paged.is_packed(w) for w in weights)

    kept = models.packed_for_cpu(params)
    assert [node["w"] for node in packable(params)] == weights
    assert all(pallas_paged.is_packed(node["w"]) for node in packable(kept))
    assert pallas_paged.is_packed(kept["lm_head"]["w"]) and "lm_head" not in params

    freed = [weakref.ref(w) for w in weights]
    del weights, kept
    consumed = models.packed_for_cpu(params, consume=True)
    assert consumed is params and pallas_paged.is_packed(params["lm_head"]["w"])
    assert len(packable(params)) == len(freed) and all(pallas_paged.is_packed(node["w"]) for node in packable(params))
    gc.collect()
    assert all(ref() is None for ref in freed)


def _linears(layer) -> list[dict]:
    """A layer's linear weights' dicts ({"w": ...}), however deep they sit."""
    found = []
    for value in layer.values():
        if isinstance(value, dict) and "w" in value:
            found.append(value)
        elif isinstance(value, dict):
            found += _linears(value)
    return found
