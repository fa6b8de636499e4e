"""The server's engine loop and OpenAI layer, in process: failures reach only their own requests."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json

import pytest

from engine import SamplingParams
from engine.entrypoints import request_outputs
from engine.entrypoints.async_engine import AsyncLLMEngine
from engine.entrypoints.openai_serving import OpenAIServing
from engine.entrypoints.protocol import CompletionRequest, RequestError
from engine.sampling_params import RequestOutputKind
from tests.engine.test_llm_requests import _fail_on_call
from tests.engine.tiny import prompts, tiny_llm


@pytest.fixture(scope="module")
def llm_and_config(tmp_path_factory):
    return tiny_llm("llama_gqa_tied", tmp_path_factory.mktemp("tiny"))


async def _tokens(engine: AsyncLLMEngine, prompt, params, request_id: str):
    last = None
    async for output in engine.generate(prompt, params, request_id):
        last = output
    return last.outputs[0].token_ids


def _run_then_stop(engine: AsyncLLMEngine, read):
    """``read()`` run to its end (within a minute), then the engine's loop stopped."""
    try:
        return asyncio.run(asyncio.wait_for(read(), 60))
    finally:
        engine.shutdown()


def test_a_failed_step_fails_its_request_and_the_loop_keeps_serving(llm_and_config, monkeypatch):
    llm, config = llm_and_config
    prompt = prompts(1, config.vocab_size, seed=40)[0]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    expected = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    runner = llm.engine.runner
    monkeypatch.setattr(runner, "run", _fail_on_call(runner, "run", call=2))
    engine = AsyncLLMEngine(llm.engine)
    try:
        with pytest.raises(RuntimeError, match="engine step failed"):
            asyncio.run(_tokens(engine, prompt, greedy, "first"))
        assert engine.is_healthy
        assert asyncio.run(_tokens(engine, prompt, greedy, "second")) == expected
    finally:
        engine.shutdown()
    stats = llm.cache_stats()
    assert stats.device_blocks_free == stats.device_blocks_total


def test_a_stopped_engine_refuses_new_requests_at_once(llm_and_config):
    llm, _ = llm_and_config
    engine = AsyncLLMEngine(llm.engine)
    engine.shutdown()
    with pytest.raises(RuntimeError, match="the engine has stopped"):
        asyncio.run(asyncio.wait_for(_tokens(engine, [5, 6, 7], SamplingParams(max_tokens=2), "late"), 10))


def test_what_the_cache_can_never_hold_is_refused_streamed_or_not(tmp_path):
    """A prompt over the cache's 32 slots (the context is lowered to them) is a 400 before
    anything streams; samples that together outgrow the cache part-way are a 400 too, or an
    error event ending the stream."""
    small, _ = tiny_llm("llama_gqa_tied", tmp_path, num_blocks=4)  # 32 KV slots
    engine = AsyncLLMEngine(small.engine)
    serving = OpenAIServing(engine, ["tiny"])
    long_prompt, prompt = list(range(3, 43)), list(range(3, 13))  # 40 and 10 tokens
    group = dict(prompt=prompt, n=3, temperature=1.0, max_tokens=20, ignore_eos=True)

    async def events():
        return [event async for event in serving.completion_stream(CompletionRequest(**group, stream=True))]

    try:
        for request in (serving.completion, serving.completion_stream):
            with pytest.raises(RequestError, match="max_model_len is 32") as refused:
                asyncio.run(request(CompletionRequest(prompt=long_prompt, max_tokens=4, stream=False)))
            assert refused.value.status == 400
        with pytest.raises(RequestError, match="KV blocks") as outgrown:
            asyncio.run(serving.completion(CompletionRequest(**group)))
        assert outgrown.value.status == 400
        *_, error, done = asyncio.run(events())  # (this model has no tokenizer, so no text went out first)
        assert json.loads(error.removeprefix("data: "))["error"]["code"] == 400 and done == "data: [DONE]\n\n"
    finally:
        engine.shutdown()


@pytest.mark.parametrize("num_prompts", [1, 2])
def test_a_stream_closed_early_aborts_its_requests_and_frees_their_blocks(tmp_path, num_prompts):
    """A client that disconnects mid-stream: the server closes the stream's iterator, which
    aborts every request behind it (one prompt is read straight from its stream, several
    through a task each), and their blocks are freed while the engine keeps serving."""
    llm, _ = tiny_llm("llama_gqa_tied", tmp_path, tokenizer="SmolLM2-135M-Instruct", generation_config="vllm")
    engine = AsyncLLMEngine(llm.engine)
    serving = OpenAIServing(engine, ["tiny"])
    prompt = list(range(40, 60))
    request = dict(prompt=[prompt] * num_prompts if num_prompts > 1 else prompt, n=2, max_tokens=100,
                   ignore_eos=True, temperature=1.0, seed=1)

    async def close_after_two_chunks():
        """Two chunks, then the stream closed; the scheduler's stats and the tokens generated
        once the engine has no request left (within 10 s), the event loop still running, as a
        server's does."""
        before = engine.snapshot.generation_tokens
        events = serving.completion_stream(CompletionRequest(**request, stream=True))
        chunks = [await anext(events), await anext(events)]
        await events.aclose()
        for _ in range(200):
            stats = engine.snapshot.scheduler
            if stats.num_running == stats.num_waiting == 0:
                break
            await asyncio.sleep(0.05)
        return chunks, stats, engine.snapshot.generation_tokens - before

    try:
        chunks, stats, generated = asyncio.run(close_after_two_chunks())
        assert all(chunk.startswith("data: {") for chunk in chunks)
        assert stats.num_running == stats.num_waiting == 0 and stats.blocks.device_blocks_used == 0
        assert generated < num_prompts * 2 * 100 / 2  # stopped early, not run to their end
        after = asyncio.run(serving.completion(CompletionRequest(prompt=prompt, max_tokens=3, temperature=0)))
        assert after["usage"]["completion_tokens"] == 3
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_a_reader_that_falls_behind_gets_what_it_missed_in_one_output(llm_and_config, kind):
    """A stream whose reader is busy while the engine steps (a slow client) gets the outputs
    it missed merged: deltas joined, of cumulative outputs the latest. What it reads adds up to
    what a reader that kept up gets: tokens, log-probabilities, finish reasons, the prompt's
    log-probabilities once."""
    llm, config = llm_and_config
    prompt = prompts(1, config.vocab_size, seed=41)[0]
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=24, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1, output_kind=kind)
    (expected,) = llm.generate([prompt], dataclasses.replace(params, output_kind=RequestOutputKind.CUMULATIVE),
                               use_tqdm=False)
    engine = AsyncLLMEngine(llm.engine)

    async def read():
        outputs = []
        async for output in engine.generate(prompt, params, "slow"):
            outputs.append(output)
            if len(outputs) == 1:
                await asyncio.sleep(0.3)  # the engine goes on meanwhile
        return outputs

    outputs = _run_then_stop(engine, read)
    assert len(outputs) < params.max_tokens  # some came merged
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    if kind is RequestOutputKind.CUMULATIVE:
        assert outputs[-1].outputs == expected.outputs
    else:
        for choice in expected.outputs:
            parts = [c for o in outputs for c in o.outputs if c.index == choice.index]
            assert sum((c.token_ids for c in parts), ()) == choice.token_ids
            assert sum((c.logprobs for c in parts), ()) == choice.logprobs
            assert [c.finish_reason for c in parts][-1] == choice.finish_reason == "length"
            assert parts[-1].cumulative_logprob == choice.cumulative_logprob
        assert [o.prompt_logprobs is not None for o in outputs] == [True] + [False] * (len(outputs) - 1)
    assert outputs[0].prompt_logprobs == expected.prompt_logprobs
    stats = llm.cache_stats()
    assert stats.device_blocks_free == stats.device_blocks_total


def test_a_response_of_several_prompts_that_falls_behind_gets_them_merged(llm_and_config):
    """Several prompts of one response are pumped to it through a queue that holds one output
    per prompt, so a reader that falls behind gets each prompt's missed outputs merged too."""
    llm, config = llm_and_config
    plans = [(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, output_kind=RequestOutputKind.DELTA))
             for p in prompts(2, config.vocab_size, seed=42)]
    expected = [o.outputs[0].token_ids for o in llm.generate([p for p, _ in plans], plans[0][1], use_tqdm=False)]
    engine = AsyncLLMEngine(llm.engine)

    async def read():
        got = {0: [], 1: []}
        async with contextlib.aclosing(request_outputs.merged(engine, plans, "cmpl", lambda *_: None)) as outputs:
            async for index, output in outputs:
                got[index].append(output.outputs[0].token_ids if output.outputs else ())
                if sum(map(len, got.values())) == 2:
                    await asyncio.sleep(1.0)  # the engine ends both meanwhile
        return got

    got = _run_then_stop(engine, read)
    assert [sum(got[i], ()) for i in (0, 1)] == expected
    # Through the pause each prompt had at most one output in the queue, one in its pump's
    # hands, and the rest merged in its stream (pumps that drained their streams sent 34-38).
    assert sum(map(len, got.values())) <= 2 + 2 * 3
