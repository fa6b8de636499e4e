"""A vLLM user's offline script, with only the import changed: parameters changed in place,
the model's generation-config defaults, vLLM's names."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import pathlib
import random

import numpy as np
import pytest

from engine import LLM, RequestOutputKind, SamplingParams
from engine.config import EngineConfig
from engine.core import scheduler
from engine.entrypoints import async_engine
from engine.entrypoints.async_engine import AsyncLLMEngine, EngineSnapshot
from engine.entrypoints.metrics import Counter, Gauge, Histogram, Metrics
from engine.entrypoints.protocol import ChatRequest
from engine.entrypoints.server import build_parser, engine_config, model_name
from engine.inputs import TextPrompt, TokensPrompt
from engine.llm_engine import LLMEngine
from models import ModelLoadError
from tests.engine.tiny import ENGINE
from tests.models.test_hub import cache_with
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


# -- LLM(...) arguments vLLM users pass ------------------------------------------------------

@pytest.fixture(scope="module")
def llm_with_tokenizer(checkpoint):
    """The tiny model (no tokenizer of its own) with SmolLM2's tokenizer, by name."""
    return LLM(checkpoint, **ENGINE, tokenizer="SmolLM2-135M-Instruct", generation_config="vllm")


def test_another_tokenizer_decodes_the_output(llm_with_tokenizer):
    tokenizer = llm_with_tokenizer.get_tokenizer()
    assert len(tokenizer) == 49152
    out = llm_with_tokenizer.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert out.outputs[0].text


def test_trust_remote_code_is_accepted_and_a_model_that_needs_it_is_refused(checkpoint, tmp_path):
    assert LLM(checkpoint, **ENGINE, trust_remote_code=True).generate([PROMPT], use_tqdm=False)[0].outputs
    config = json.loads((pathlib.Path(checkpoint) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {**config, "model_type": "my_model", "auto_map": {"AutoModelForCausalLM": "modeling_my.MyModel"}}))
    with pytest.raises(ModelLoadError, match="runs no remote code, whatever trust_remote_code says"):
        LLM(str(tmp_path), **ENGINE, trust_remote_code=True)


def test_enforce_eager_skips_the_start_up_compilation_with_the_same_outputs(checkpoint, llm):
    eager = LLM(checkpoint, **{**ENGINE, "warmup": True}, enforce_eager=True)
    assert not eager.engine.config.compiles_at_start and eager.engine.warm_ups_left == 0
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert (eager.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
            == llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids)


def test_max_logprobs_bounds_what_a_request_may_ask(checkpoint, llm):
    refused = llm.generate([PROMPT], SamplingParams(max_tokens=2, logprobs=21), use_tqdm=False)[0]
    assert "logprobs=21 is more than max_logprobs=20" in refused.error and not refused.outputs
    wide = LLM(checkpoint, **ENGINE, max_logprobs=40)
    out = wide.generate([PROMPT], SamplingParams(max_tokens=2, logprobs=30, prompt_logprobs=25), use_tqdm=False)[0]
    assert all(len(step) >= 30 for step in out.outputs[0].logprobs)
    assert all(len(step) >= 25 for step in out.prompt_logprobs[1:])


def test_vllms_dtype_names(checkpoint):
    assert EngineConfig(dtype="half").param_dtype == "float16" == EngineConfig(dtype="float16").param_dtype
    assert EngineConfig(dtype="float").param_dtype == "float32"
    with pytest.raises(ValueError, match="dtype float16 is not computed natively on cpu; use 'bfloat16'"):
        LLM(checkpoint, **ENGINE, dtype="half")
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM(checkpoint, **ENGINE, dtype="fp16")


def test_the_seed_seeds_pythons_and_numpys_generators_too(checkpoint):
    LLM(checkpoint, **ENGINE, seed=7)
    assert random.random() == random.Random(7).random()
    assert np.random.rand() == np.random.RandomState(7).rand()


def test_disable_log_stats_false_logs_throughput_and_cache_use(checkpoint, caplog):
    engine = LLMEngine(EngineConfig(checkpoint, **ENGINE, disable_log_stats=False, log_stats_interval=0))
    engine.add_request("logged", PROMPT, SamplingParams(max_tokens=3))
    with caplog.at_level(logging.INFO, logger="engine.stats"):
        while engine.has_unfinished_requests():
            engine.step()
    assert any("Avg generation throughput" in r.message and "KV cache usage" in r.message for r in caplog.records)
    assert LLM(checkpoint, **ENGINE).engine.config.disable_log_stats  # LLM's default, as vLLM's


def test_stats_are_computed_for_a_log_line_or_a_metrics_read_only(checkpoint, monkeypatch):
    """The stats walk every block table: the engine asks for them only when a log line is due,
    and the server's snapshot (taken after every step) when /metrics reads it, as of its step."""
    engine = LLMEngine(EngineConfig(checkpoint, **ENGINE, disable_log_stats=False, log_stats_interval=60))
    computed, stats = [], scheduler.stats

    def counted(state):
        computed.append(state)
        return stats(state)

    monkeypatch.setattr(scheduler, "stats", counted)
    monkeypatch.setattr(async_engine, "scheduler_stats", counted)
    engine.add_request("measured", PROMPT, SamplingParams(max_tokens=4))
    engine.step()
    snapshots = [EngineSnapshot.of(engine)]
    while engine.has_unfinished_requests():
        engine.step()
        snapshots.append(EngineSnapshot.of(engine))
    assert not computed  # no line was due within 60 s, and nothing read a snapshot
    assert snapshots[0].scheduler.num_running == 1 and snapshots[-1].scheduler.num_running == 0
    assert len(computed) == 2 and snapshots[-1].scheduler == engine.stats()


def test_unknown_arguments_fail_loudly(checkpoint):
    with pytest.raises(TypeError, match="unexpected keyword argument 'gpu_memory_fraction'"):
        LLM(checkpoint, **ENGINE, gpu_memory_fraction=0.5)


# -- outputs and the async engine under vLLM's names ------------------------------------------

def _drain(engine, request_id, prompt, params) -> list:
    engine.add_request(request_id, prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [out for out in engine.step() if out.request_id == request_id]
    return outputs


def test_delta_outputs_add_up_to_the_cumulative_ones(llm_with_tokenizer):
    engine = llm_with_tokenizer.engine
    params = dict(n=2, temperature=1.0, seed=3, max_tokens=12, logprobs=2, prompt_logprobs=1, stop=["e"])
    cumulative = _drain(engine, "cumulative", PROMPT, SamplingParams(**params))[-1]
    deltas = _drain(engine, "delta", PROMPT, SamplingParams(**params, output_kind=RequestOutputKind.DELTA))
    assert len(deltas) > 1 and deltas[0].prompt_logprobs == cumulative.prompt_logprobs
    assert all(out.prompt_logprobs is None for out in deltas[1:])
    for whole in cumulative.outputs:
        parts = [c for out in deltas for c in out.outputs if c.index == whole.index]
        assert all(c.token_ids or c.finish_reason for c in parts)
        assert "".join(c.text for c in parts) == whole.text
        assert sum((c.token_ids for c in parts), ()) == whole.token_ids
        assert sum((c.logprobs for c in parts), ()) == whole.logprobs
        assert parts[-1].finish_reason == whole.finish_reason


def test_delta_with_best_of_is_refused(llm):
    with pytest.raises(ValueError, match="output_kind must be CUMULATIVE or FINAL_ONLY when best_of > n"):
        llm.engine.add_request("x", PROMPT, SamplingParams(n=1, best_of=2, output_kind=RequestOutputKind.DELTA))


def test_num_cached_tokens_counts_the_prompt_found_in_the_prefix_cache(llm):
    prompt = list(range(10, 30))  # 20 tokens: two whole blocks of 8
    first = llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    again = llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 16)


def test_async_generate_takes_vllms_keywords_and_prompt_dicts(llm):
    async def run():
        engine = AsyncLLMEngine(llm.engine)
        try:
            return [out async for out in engine.generate(prompt=TokensPrompt(prompt_token_ids=PROMPT),
                                                         sampling_params=SamplingParams(temperature=0, max_tokens=3),
                                                         request_id="keywords")]
        finally:
            engine.shutdown()

    outputs = asyncio.run(run())
    assert outputs[-1].finished and outputs[-1].prompt_token_ids == tuple(PROMPT)
    offline = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert offline[0].outputs[0].token_ids == outputs[-1].outputs[0].token_ids
    assert TextPrompt(prompt="hi") == {"prompt": "hi"}


def test_get_metrics_are_the_servers_metrics_as_objects(checkpoint):
    llm = LLM(checkpoint, **ENGINE)
    outputs = llm.generate([PROMPT, PROMPT[:2]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    metrics = {(m.name, tuple(sorted(m.labels.items()))): m for m in llm.get_metrics()}
    by_name = {name: m for (name, _), m in metrics.items()}
    assert isinstance(by_name["vllm:generation_tokens"], Counter)
    assert by_name["vllm:generation_tokens"].value == sum(len(o.outputs[0].token_ids) for o in outputs) == 8
    assert by_name["vllm:prompt_tokens"].value == 6
    assert isinstance(by_name["vllm:num_requests_running"], Gauge) and by_name["vllm:num_requests_running"].value == 0
    e2e = by_name["vllm:e2e_request_latency_seconds"]
    assert isinstance(e2e, Histogram) and e2e.count == 2 and e2e.buckets["+Inf"] == 2
    served = Metrics("tiny", block_size=8).exposition(EngineSnapshot.of(llm.engine)).decode()
    served_names = {line.split()[2] for line in served.splitlines() if line.startswith("# TYPE")}
    assert set(by_name) == {name.removesuffix("_total") for name in served_names if not name.endswith("_created")}


# -- model names and the server's command line ------------------------------------------------

def test_a_hub_id_from_the_local_cache_serves_as_the_directory_does(checkpoint, tmp_path, monkeypatch):
    cache_with(tmp_path, "test-org/tiny", checkpoint)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    params = SamplingParams(temperature=0, max_tokens=5)
    by_id = LLM("test-org/tiny", **ENGINE).generate([PROMPT], params, use_tqdm=False)[0]
    assert by_id.outputs[0].token_ids == LLM(checkpoint, **ENGINE).generate([PROMPT], params,
                                                                            use_tqdm=False)[0].outputs[0].token_ids


def test_serve_takes_the_model_and_vllms_engine_flags():
    parser = build_parser()
    assert model_name(parser.parse_args(["org/model"])) == model_name(parser.parse_args(["--model", "org/model"]))
    with pytest.raises(ValueError, match="the model is given twice"):
        model_name(parser.parse_args(["org/a", "--model", "org/b"]))
    config = engine_config(parser.parse_args(["org/model", "--dtype", "half", "--enforce-eager", "--max-logprobs",
                                              "5", "--tokenizer", "org/tok", "--trust-remote-code",
                                              "--disable-log-stats"]))
    assert (config.model, config.param_dtype, config.enforce_eager, config.max_logprobs, config.tokenizer,
            config.trust_remote_code, config.disable_log_stats) == ("org/model", "float16", True, 5, "org/tok",
                                                                   True, True)
    assert not engine_config(parser.parse_args([])).disable_log_stats  # the server logs stats, as vLLM's
