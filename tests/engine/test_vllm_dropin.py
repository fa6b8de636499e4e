"""A vLLM user's offline script, with only the import changed: parameters changed in place,
the model's generation-config defaults, vLLM's names."""

from __future__ import annotations

import dataclasses
import json

import pytest

from engine import LLM, SamplingParams
from engine.entrypoints.protocol import ChatRequest
from tests.engine.tiny import ENGINE
from tests.models.tiny_models import write_checkpoint

PROMPT = [5, 6, 7, 8]
GENERATION = {"temperature": 0.0, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.1, "max_new_tokens": 7}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny checkpoint whose generation_config.json sets sampling defaults, as many do."""
    directory = tmp_path_factory.mktemp("tiny_generation_config")
    write_checkpoint("llama_gqa_tied", directory)
    path = directory / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **GENERATION}))
    return str(directory)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, **ENGINE)


def test_parameters_can_be_changed_in_place_as_in_vllm(llm):
    params = SamplingParams(temperature=0.0)
    params.max_tokens = 5
    assert len(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids) == 5
    params.temperature = -1.0  # checked when a request takes it
    with pytest.raises(ValueError, match="SamplingParams.temperature must be a number >= 0"):
        llm.generate([PROMPT], params, use_tqdm=False)


def test_a_running_request_keeps_the_parameters_it_was_added_with(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.llm_engine.add_request("kept", PROMPT, params)
    params.max_tokens = 1  # after the request was added: not seen by it
    outputs = []
    while llm.llm_engine.has_unfinished_requests():
        outputs += [out for out in llm.llm_engine.step() if out.finished]
    assert len(outputs[0].outputs[0].token_ids) == 6
    with pytest.raises(dataclasses.FrozenInstanceError, match="clone"):  # the engine's copy
        params.snapshot().max_tokens = 2


def test_default_sampling_params_come_from_the_generation_config(checkpoint, llm):
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.repetition_penalty,
            defaults.max_tokens) == (0.0, 20, 0.9, 1.1, 7)
    assert len(llm.generate([PROMPT], use_tqdm=False)[0].outputs[0].token_ids) <= 7
    assert LLM(checkpoint, **ENGINE, generation_config="vllm").get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="generation_config must be 'auto'"):
        LLM(checkpoint, **ENGINE, generation_config="hf")


def test_the_server_fills_left_out_fields_from_the_generation_config():
    defaults = {"temperature": 0.3, "top_k": 5, "repetition_penalty": 1.2}
    request = ChatRequest(messages=[{"role": "user", "content": "hi"}], temperature=1.0)
    params = request.sampling_params(max_tokens=4, logprobs=None, defaults=defaults)
    assert (params.temperature, params.top_k, params.repetition_penalty, params.top_p) == (1.0, 5, 1.2, 1.0)


@pytest.mark.slow
def test_chat_takes_vllms_template_arguments_and_refuses_tools():
    llm = LLM(max_model_len=256, max_num_seqs=2, warmup=False)
    messages = [{"role": "user", "content": " how are you?"}]
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=template,
                   chat_template_kwargs={"greeting": "Hello,"}, add_generation_prompt=False)[0]
    assert out.prompt == "Hello, how are you?"
    with pytest.raises(ValueError, match="tools are not supported"):
        llm.chat(messages, tools=[{"type": "function", "function": {"name": "f"}}])
