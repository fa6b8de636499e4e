"""The engine in a process of its own (``EngineProcess``, the server's ``--engine-process``):
the same outputs as the engine in process, errors that reach their callers, no block kept by
an abandoned stream, and a server that says so when its engine process dies."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import multiprocessing
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from engine import BeamSearchParams, SamplingParams
from engine.config import EngineConfig
from engine.core.scheduler import InvalidRequestError
from engine.entrypoints.engine_loop import Add
from engine.entrypoints.engine_process import EngineProcess, _Child
from engine.entrypoints.server import create_app
from engine.sampling_params import RequestOutputKind
from models.config import ModelLoadError
from tests.engine.server import running_server
from tests.engine.tiny import ENGINE, prompts, tiny_llm

DELTA, CUMULATIVE, FINAL = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    llm, config = tiny_llm("llama_gqa_tied", directory)
    return directory, llm, config


@pytest.fixture(scope="module")
def process(model):
    engine = EngineProcess(EngineConfig(model=str(model[0]), **ENGINE))
    yield engine
    engine.shutdown()


async def _outputs(engine, prompt, params, request_id: str) -> list:
    return [output async for output in engine.generate(prompt, params, request_id)]


def _whole(outputs: list, params):
    """What a request's outputs add up to: the last, or (deltas) every delta joined per choice."""
    if getattr(params, "output_kind", None) is not DELTA:
        return outputs[-1].outputs
    joined = {}
    for output in outputs:
        for c in output.outputs:
            before = joined.get(c.index)
            joined[c.index] = c if before is None else dataclasses.replace(
                c, text=before.text + c.text, token_ids=before.token_ids + c.token_ids,
                logprobs=None if c.logprobs is None else before.logprobs + c.logprobs)
    return tuple(joined[i] for i in sorted(joined))


def _assert_same(got, expected) -> None:
    """The same completions: tokens, text and finish exactly; log-probabilities (the same tokens
    and ranks) within 1e-4, as batching a request beside others changes their last bits."""
    assert [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in got] == [
        (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in expected]
    for mine, theirs in zip(got, expected):
        assert mine.cumulative_logprob == pytest.approx(theirs.cumulative_logprob, abs=1e-4)
        assert (mine.logprobs is None) == (theirs.logprobs is None)
        for a, b in zip(mine.logprobs or (), theirs.logprobs or ()):
            assert {t: v.rank for t, v in a.items()} == {t: v.rank for t, v in b.items()}
            assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)


def _all_blocks_free(engine, since: float, timeout: float = 30) -> bool:
    """Whether a snapshot of the engine taken after ``since`` (``time.time()`` before the
    requests in question were sent) shows every device block free and no request running or
    waiting, within ``timeout`` (the child sends its numbers when it falls idle)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snapshot = engine.snapshot
        blocks = snapshot.scheduler.blocks
        if (snapshot.time > since and blocks.device_blocks_free == blocks.device_blocks_total
                and not snapshot.scheduler.num_running and not snapshot.scheduler.num_waiting):
            return True
        time.sleep(0.05)
    return False


def test_outputs_equal_the_engine_in_process(model, process):
    """Greedy and seeded sampling, n=2, log-probabilities of the samples and of the prompt,
    beam search; deltas, cumulative and final outputs; all at once, as a server runs them."""
    _, llm, config = model
    cases = [
        SamplingParams(temperature=0, max_tokens=12, logprobs=2, prompt_logprobs=1, output_kind=DELTA),
        SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=10, ignore_eos=True, output_kind=CUMULATIVE),
        SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, output_kind=FINAL),
        SamplingParams(n=2, temperature=0.7, seed=9, max_tokens=8, logprobs=1, output_kind=DELTA),
        BeamSearchParams(beam_width=2, max_tokens=6),
    ]
    inputs = prompts(len(cases), config.vocab_size, seed=50)

    async def every():
        return await asyncio.gather(*(_outputs(process, p, c, f"case-{i}")
                                      for i, (p, c) in enumerate(zip(inputs, cases))))

    start = time.time()
    got = asyncio.run(asyncio.wait_for(every(), 120))
    for prompt, params, outputs in zip(inputs, cases, got):
        if isinstance(params, BeamSearchParams):
            (beams,) = llm.beam_search([{"prompt_token_ids": prompt}], params)
            assert [list(c.token_ids) for c in outputs[-1].outputs] == [s.tokens[len(prompt):] for s in beams.sequences]
            continue
        (expected,) = llm.generate([prompt], dataclasses.replace(params, output_kind=CUMULATIVE), use_tqdm=False)
        _assert_same(_whole(outputs, params), expected.outputs)
        assert all(o.prompt_token_ids == tuple(prompt) for o in outputs)
        assert (outputs[0].prompt_logprobs is None) == (expected.prompt_logprobs is None)
        for a, b in zip(outputs[0].prompt_logprobs or (), expected.prompt_logprobs or ()):
            assert (a is None and b is None) or list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)
        assert [o.finished for o in outputs][-1] and not any(o.finished for o in outputs[:-1])
        assert outputs[-1].metrics.first_token_time >= outputs[-1].metrics.arrival_time
    assert _all_blocks_free(process, since=start)


def test_a_refused_request_raises_its_error_and_the_engine_keeps_serving(model, process):
    _, llm, config = model
    too_long = list(range(3, 3 + ENGINE["max_model_len"] + 1))
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        asyncio.run(_outputs(process, too_long, SamplingParams(max_tokens=2), "too-long"))
    prompt = prompts(1, config.vocab_size, seed=51)[0]
    params = SamplingParams(temperature=0, max_tokens=5)
    (expected,) = llm.generate([prompt], params, use_tqdm=False)
    assert asyncio.run(_outputs(process, prompt, params, "after"))[-1].outputs == expected.outputs
    assert process.is_healthy


def test_an_abandoned_stream_frees_every_block_and_its_id_can_run_again(model, process):
    """A reader that stops (a client that disconnects) aborts its request in the child; a new
    request under the same id then gets its own prompt and outputs."""
    prompt, again = prompts(2, model[2].vocab_size, seed=52)
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=100, ignore_eos=True, output_kind=DELTA)
    before = process.snapshot.generation_tokens

    async def two_then_stop():
        async with contextlib.aclosing(process.generate(prompt, params, "abandoned")) as outputs:
            return [await anext(outputs), await anext(outputs)]

    start = time.time()
    assert len(asyncio.run(two_then_stop())) == 2
    assert _all_blocks_free(process, since=start)
    assert process.snapshot.generation_tokens - before < 2 * 100  # it stopped part-way
    outputs = asyncio.run(_outputs(process, again, SamplingParams(max_tokens=3, ignore_eos=True), "abandoned"))
    assert all(o.prompt_token_ids == tuple(again) for o in outputs) and len(outputs[-1].outputs[0].token_ids) == 3


def test_an_id_already_running_is_refused(process):
    async def both():
        first = process.generate([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), "twice")
        async with contextlib.aclosing(first):
            await anext(first)
            with pytest.raises(InvalidRequestError, match="already running"):
                await anext(process.generate([8, 9], SamplingParams(max_tokens=2), "twice"))
            return [output async for output in first]

    assert asyncio.run(asyncio.wait_for(both(), 60))[-1].finished


def test_a_prompt_larger_than_the_pipe_does_not_hold_up_the_others(process):
    """A prompt of 30,000 token ids (more than a pipe holds at once) is sent from a thread of
    its own: the caller's event loop goes on, and the engine refuses it for its length."""
    async def both():
        huge = asyncio.ensure_future(_outputs(process, [5] * 30_000, SamplingParams(max_tokens=2), "huge"))
        small = await _outputs(process, [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), "small")
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            await huge
        return small

    assert len(asyncio.run(asyncio.wait_for(both(), 60))[-1].outputs[0].token_ids) == 4


def test_the_server_answers_and_counts_through_an_engine_process(process):
    client = TestClient(create_app(process, ["tiny"]))
    start, before = time.time(), process.snapshot.generation_tokens
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    whole = client.post("/v1/completions", json=body).json()
    assert whole["usage"]["completion_tokens"] == 6
    with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                         "stream_options": {"include_usage": True}}) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 6
    assert client.get("/health").status_code == 200
    assert _all_blocks_free(process, since=start)
    metrics = client.get("/metrics").text  # (the app's counters start at this engine's first snapshot)
    generated = [line for line in metrics.splitlines() if line.startswith("vllm:generation_tokens_total")]
    assert generated and float(generated[0].split()[-1]) == process.snapshot.generation_tokens
    assert process.snapshot.generation_tokens - before == 12


def test_a_dead_engine_process_fails_its_streams_and_the_health_check(model):
    engine = EngineProcess(EngineConfig(model=str(model[0]), **ENGINE))
    client = TestClient(create_app(engine, ["tiny"]))
    params = SamplingParams(max_tokens=100, ignore_eos=True, output_kind=DELTA)

    async def read_until_killed():
        async for _ in engine.generate([5, 6, 7], params, "doomed"):
            engine._process.kill()

    try:
        with pytest.raises(RuntimeError, match="engine process exited"):
            asyncio.run(asyncio.wait_for(read_until_killed(), 60))
        assert not engine.is_healthy and client.get("/health").status_code == 503
        with pytest.raises(RuntimeError, match="the engine has stopped"):
            asyncio.run(_outputs(engine, [5, 6], SamplingParams(max_tokens=2), "late"))
    finally:
        engine.shutdown()


def test_a_model_that_cannot_load_is_the_callers_error(tmp_path):
    with pytest.raises(ModelLoadError):
        EngineProcess(EngineConfig(model=str(tmp_path / "missing"), **ENGINE))


def test_python_m_engine_serve_with_an_engine_process(model):
    """The flag as a user passes it: the child is spawned from ``python -m engine.serve``."""
    args = ["--model", str(model[0]), "--engine-process", "--max-model-len", "128", "--num-blocks", "64",
            "--max-num-seqs", "8", "--swap-space", "0.01", "--enforce-eager"]
    with running_server(*args, timeout=300) as url:
        response = httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 6


class _Crash(BaseException):
    """What an engine step might die of that is not an Exception (the loop's own failures)."""


def test_a_loop_that_dies_tells_its_requests_and_the_parent(model, monkeypatch):
    """The child's side, run here on the module's engine: a step that dies of a BaseException
    ends the loop; each live request gets the error, then the parent hears why, and the
    child's run says it failed (its exit code is 1)."""
    engine = model[1].engine
    requests_out, requests_in = multiprocessing.Pipe(duplex=False)
    outputs_out, outputs_in = multiprocessing.Pipe(duplex=False)
    requests_in.send(Add("doomed", [5, 6, 7], SamplingParams(max_tokens=4)))

    def crash():
        raise _Crash("the device went away")

    monkeypatch.setattr(engine, "step", crash)
    try:
        assert not _Child(engine, requests_out, outputs_in).run()
    finally:
        monkeypatch.undo()
        engine.abort_request("doomed")
    (kind, deliveries, _), failed = outputs_out.recv(), outputs_out.recv()
    assert kind == "outputs" and [(r, type(e), last) for r, e, last in deliveries] == [("doomed", RuntimeError, True)]
    assert "the device went away" in str(deliveries[0][1])
    assert failed == ("failed", "_Crash: the device went away") and not outputs_out.poll()
