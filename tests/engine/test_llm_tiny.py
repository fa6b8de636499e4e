"""The engine on tiny random LLaMA-family (LLaMA, Qwen2, Mistral) and OPT models against
Hugging Face: greedy and beam search."""

from __future__ import annotations

import pytest
from safetensors.numpy import load_file, save_file

from engine import LLM, BeamSearchParams, SamplingParams
from tests.engine.tiny import ENGINE, assert_greedy_batch_matches, prompts, tiny_llm
from tests.hf_torch import load_hf_model, require_torch


@pytest.mark.parametrize("name", ["llama_gqa_tied", "qwen2", "opt"])
def test_greedy_batch_matches_hugging_face(name, tmp_path):
    require_torch()
    llm, _ = tiny_llm(name, tmp_path)
    assert_greedy_batch_matches(llm, load_hf_model(tmp_path))


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_beam_search_matches_hugging_face(length_penalty, tmp_path):
    torch = require_torch()
    llm, _ = tiny_llm("llama_gqa_tied", tmp_path)
    hf = load_hf_model(tmp_path)
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=length_penalty)
    batch = prompts(3, hf.config.vocab_size, seed=1)
    outputs = llm.beam_search(batch, params)
    for prompt, output in zip(batch, outputs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3, early_stopping=True,
                               length_penalty=length_penalty, max_new_tokens=8, do_sample=False,
                               pad_token_id=hf.config.eos_token_id)
        expected = [_strip(row[len(prompt):].tolist(), hf.config.eos_token_id) for row in want]
        assert [s.tokens[len(prompt):] for s in output.sequences] == expected
        assert all(s.tokens[: len(prompt)] == prompt for s in output.sequences)
    stats = llm.cache_stats()
    assert stats.device_blocks_free == stats.device_blocks_total


def _strip(tokens, eos):
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def test_a_resaved_checkpoint_is_read_afresh_and_freed_with_its_engines(tmp_path):
    import gc
    import weakref

    first, config = tiny_llm("llama_gqa_tied", tmp_path)
    prompt = prompts(1, config.vocab_size, seed=9)[0]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    before = first.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    second = LLM(str(tmp_path), **ENGINE)
    assert second.engine.runner.params is first.engine.runner.params  # same files: shared
    weights = tmp_path / "model.safetensors"  # re-save different weights in place, as after more training
    save_file({name: -1.5 * array for name, array in load_file(weights).items()}, weights, metadata={"format": "pt"})
    changed = LLM(str(tmp_path), **ENGINE)
    assert changed.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids != before
    held = weakref.ref(changed.engine._model)
    del changed
    gc.collect()
    assert held() is None  # the last engine of those weights is gone, and so are they


def test_an_end_of_turn_id_listed_only_in_generation_config_stops_generation(tmp_path):
    import json

    llm, config = tiny_llm("llama_gqa_tied", tmp_path)
    prompt = prompts(1, config.vocab_size, seed=10)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    tokens = list(free[0].outputs[0].token_ids)
    end_of_turn = tokens[3]  # listed only in generation_config.json, as chat models do
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [config.eos_token_id,
                                                                                   end_of_turn]}))
    chat = LLM(str(tmp_path), **ENGINE)
    out = chat.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == tokens[: tokens.index(end_of_turn) + 1] and out.finish_reason == "stop"


def test_a_sliding_window_model_keeps_within_its_window(tmp_path):
    """Mistral-style models attend to their last ``sliding_window`` tokens; the engine attends to the
    whole context, the same thing within the window, so it keeps max_model_len there and says why."""
    llm, config = tiny_llm("mistral", tmp_path, max_model_len=None)
    assert llm.engine.max_model_len == config.sliding_window == 96
    with pytest.raises(ValueError, match="sliding window of 96 tokens.*lower max_model_len to 96"):
        LLM(str(tmp_path), **{**ENGINE, "max_model_len": 97})


def test_a_sliding_window_model_generates_what_hugging_face_does(tmp_path):
    require_torch()
    llm, _ = tiny_llm("mistral", tmp_path, max_model_len=None)
    assert_greedy_batch_matches(llm, load_hf_model(tmp_path), count=4)
