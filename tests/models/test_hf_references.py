"""What the torch-free leg trusts, checked against Hugging Face itself (these need torch): the
hand-written tiny checkpoints are exactly what HF loads, and the stored HF outputs are what HF
computes now. A failure names the command that writes the stored files again."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file
from tiny_models import TINY_CONFIGS, write_checkpoint

from tests import hf_references
from tests.hf_torch import require_torch


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_hugging_face_loads_the_written_checkpoint_exactly(name, tmp_path):
    """No missing, unexpected or mismatched parameter names, HF's parameters are the arrays
    written (a tied head is the embedding), and HF would write the same config files; so the
    hand-written names and shapes cannot drift from HF's."""
    require_torch()
    import transformers

    config = write_checkpoint(name, tmp_path)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert {key: list(value) for key, value in info.items()} == {key: [] for key in info}
    written = load_file(tmp_path / "model.safetensors")
    state = {key: value.numpy() for key, value in model.state_dict().items()}
    if config.tie_word_embeddings:
        tied = next(key for key in written if key.endswith("embed_tokens.weight"))
        written["lm_head.weight"] = written[tied]
    assert sorted(state) == sorted(written)
    for key, value in written.items():
        np.testing.assert_array_equal(state[key], value, err_msg=key)
    model.save_pretrained(tmp_path / "resaved")
    for file in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / file).read_text()) == json.loads((tmp_path / "resaved" / file).read_text())


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_stored_tiny_logits_are_what_hugging_face_computes(name, tmp_path):
    stale = hf_references.stale(hf_references.TINY_FILE)
    live = hf_references.hf_tiny_references(name, tmp_path)
    for (ids, logits), (want_ids, want_logits) in zip(live, hf_references.stored_tiny(name), strict=True):
        assert ids == want_ids, stale
        np.testing.assert_allclose(logits, want_logits, atol=1e-5, rtol=0, err_msg=stale)


@pytest.mark.slow
def test_stored_smollm2_continuations_are_what_hugging_face_generates(smollm2, hf_smollm2_torch):
    stored = json.loads(hf_references.SMOLLM2_FILE.read_text())
    live = hf_references.hf_smollm2_references(hf_smollm2_torch, smollm2.tokenizer)
    assert live == stored, hf_references.stale(hf_references.SMOLLM2_FILE)
