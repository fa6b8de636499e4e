"""``stream_interval``: a streamed request's outputs after its first come every that many tokens,
and each says what the output at every token said at that point."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine import LLM, RequestOutputKind, SamplingParams
from engine.config import EngineConfig
from engine.entrypoints.async_engine import AsyncLLMEngine
from engine.entrypoints.openai_serving import OpenAIServing
from engine.entrypoints.protocol import CompletionRequest
from engine.entrypoints.server import build_parser, engine_config
from tests.engine.tiny import ENGINE
from tests.models.tiny_models import write_checkpoint

PROMPT = [5, 6, 7, 8]
INTERVAL = 4


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """The tiny model with SmolLM2's tokenizer (so outputs have text): an output per token, one
    per ``INTERVAL`` tokens, and that with loops of 3 decode steps (``num_scheduler_steps``)."""
    directory = tmp_path_factory.mktemp("tiny_stream_interval")
    write_checkpoint("llama_gqa_tied", directory)
    settings = dict(ENGINE, tokenizer="SmolLM2-135M-Instruct", generation_config="vllm")
    return {"every token": LLM(str(directory), **settings),
            "spaced": LLM(str(directory), **settings, stream_interval=INTERVAL),
            "spaced, loops": LLM(str(directory), **settings, stream_interval=INTERVAL, num_scheduler_steps=3)}


def _views(llm: LLM, params: SamplingParams) -> list[tuple[int, dict]]:
    """Each output of one request as (its longest completion's tokens, what a user has been
    told of every completion by then: text, tokens, log-probabilities, finish reason), deltas
    added up."""
    engine = llm.engine
    engine.add_request("r", PROMPT, params)
    told, views = {}, []
    while engine.has_unfinished_requests():
        for output in engine.step():
            for c in output.outputs:
                text, tokens, logprobs, _ = told.get(c.index, ("", (), (), None))
                if params.output_kind is RequestOutputKind.DELTA:
                    told[c.index] = (text + c.text, tokens + c.token_ids, logprobs + (c.logprobs or ()),
                                     c.finish_reason)
                else:
                    told[c.index] = (c.text, c.token_ids, c.logprobs, c.finish_reason)
            views.append((max(len(t[1]) for t in told.values()), dict(told), output.prompt_logprobs))
    return views


SAMPLED = dict(n=2, temperature=1.0, seed=3, max_tokens=14, logprobs=2, prompt_logprobs=1)
PLAIN = dict(temperature=0.8, seed=5, max_tokens=14, prompt_logprobs=0)  # rows recorded at once (plain_rows)


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
@pytest.mark.parametrize("stop", [[], ["e"]])
@pytest.mark.parametrize("settings", [SAMPLED, PLAIN], ids=["n=2 logprobs", "plain"])
@pytest.mark.parametrize("spacing", ["spaced", "spaced, loops"])
def test_spaced_outputs_say_what_outputs_at_every_token_said(engines, kind, stop, settings, spacing):
    params = SamplingParams(**settings, stop=stop, output_kind=kind)
    every_token, spaced = _views(engines["every token"], params), _views(engines[spacing], params)
    longest = [length for length, _, _ in spaced]
    final = longest[-1]
    assert [length for length, _, _ in every_token] == list(range(1, final + 1))
    if spacing == "spaced":  # one token a step: an output at 1, 1 + INTERVAL, ... and the last
        assert longest == sorted({*range(1, final + 1, INTERVAL), final})
    else:  # loops of 3 tokens: the first, then each at least INTERVAL after the one before
        assert longest[0] == 1 and all(b - a >= INTERVAL for a, b in zip(longest, longest[1:-1]))
    by_length = {length: told for length, told, _ in every_token}
    for length, told, _ in spaced:
        assert told == by_length[length]
    assert all(f is not None for *_, f in spaced[-1][1].values())
    assert spaced[0][2] == every_token[0][2] is not None  # the prompt's log-probabilities, with the first
    if kind is RequestOutputKind.DELTA:
        assert all(prompt_logprobs is None for _, _, prompt_logprobs in spaced[1:])


def test_a_served_stream_sends_its_text_in_chunks_of_that_many_tokens(engines):
    """The OpenAI server's stream (``--stream-interval``): outputs after the first token and
    every ``INTERVAL`` after it, so at most 4 chunks for 10 tokens, adding up to the whole
    answer's text and tokens."""
    args = build_parser().parse_args(["--stream-interval", str(INTERVAL)])
    assert engine_config(args).stream_interval == INTERVAL
    engine = AsyncLLMEngine(engines["spaced"].engine)
    serving = OpenAIServing(engine, ["tiny"])
    request = dict(prompt=PROMPT, max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)

    async def chunks():
        return [event async for event in serving.completion_stream(CompletionRequest(**request, stream=True))]

    try:
        whole = asyncio.run(serving.completion(CompletionRequest(**request)))["choices"][0]
        events = asyncio.run(chunks())
    finally:
        engine.shutdown()
    assert events[-1] == "data: [DONE]\n\n"
    choices = [json.loads(event.removeprefix("data: "))["choices"][0] for event in events[:-1]]
    sizes = [len(choice["logprobs"]["tokens"]) for choice in choices if choice["logprobs"]]
    assert sum(sizes) == 10 and len(sizes) <= 1 + -(-9 // INTERVAL)
    assert "".join(choice["text"] for choice in choices) == whole["text"]


def test_an_interval_below_one_is_refused_saying_what_to_give():
    with pytest.raises(ValueError, match="stream_interval must be an integer >= 1"):
        EngineConfig(stream_interval=0)
