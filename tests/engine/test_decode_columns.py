"""A step's decodes as columns: the rows' works (``engine.core.scheduled_rows``) answer the
lookahead's questions as their records do, and plain rows (``engine.plain_rows``) record
what the per-row path records, step by step."""

from __future__ import annotations

import dataclasses

import pytest

from engine import SamplingParams, async_scheduling, plain_rows
from engine.core.scheduled_rows import PlannedWorks
from engine.sampling_params import RequestOutputKind
from tests.engine.tiny import prompts, tiny_llm


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    llm, _ = tiny_llm("llama_gqa_tied", tmp_path_factory.mktemp("tiny"))
    return llm


def _params(vocab: int) -> list[SamplingParams]:
    """Requests whose rows are plain (no text, logprobs, constraint or beams), stopping every
    way one can, some not static (penalties, min_tokens), some streamed."""
    stops = list(range(3, vocab, 41))
    return [
        SamplingParams(temperature=0, max_tokens=27, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=23, stop_token_ids=stops),
        SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=20, output_kind=RequestOutputKind.DELTA),
        SamplingParams(temperature=0.7, seed=3, min_tokens=12, max_tokens=24, stop_token_ids=stops),
        SamplingParams(temperature=0, presence_penalty=0.5, max_tokens=18, output_kind=RequestOutputKind.CUMULATIVE),
        SamplingParams(temperature=1.0, seed=5, top_k=20, max_tokens=40),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0.9, seed=8, max_tokens=33, stop_token_ids=stops),
    ]


def _run(llm, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]]) -> list:
    """Every output of every step (what a streaming user reads), with requests arriving at
    the steps ``arrivals`` gives."""
    engine, seen, step = llm.engine, [], 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for request_id, prompt, params in arrivals.get(step, []):
            engine.add_request(request_id, prompt, params)
        seen.append(sorted((o.request_id, [(c.index, c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs],
                            o.finished) for o in engine.step()))
        step += 1
    return seen


def _workload(vocab: int, tag: str) -> dict:
    params = _params(vocab)
    batch = prompts(len(params), vocab, seed=9)
    arrivals = {}
    for i, (prompt, p) in enumerate(zip(batch, params)):
        arrivals.setdefault(3 * (i % 3), []).append((f"{tag}{i}", prompt, p))
    return arrivals


def test_plain_rows_record_what_the_per_row_path_records(llm, monkeypatch):
    vocab = llm.engine.model_config.vocab_size
    recorded = []
    record = plain_rows.record
    monkeypatch.setattr(plain_rows, "record", lambda *args: recorded.append(1) or record(*args))
    at_once = _run(llm, _workload(vocab, "a"))
    assert len(recorded) > 20, "the steps were not recorded at once"
    monkeypatch.setattr(plain_rows, "of", lambda *args: None)
    assert _run(llm, _workload(vocab, "a")) == at_once


def test_the_rows_columns_answer_as_their_records(llm, monkeypatch):
    """Whether a lookahead may follow, and whether it computed the plan: the same answers from
    the rows' columns as from the same works as records."""
    vocab = llm.engine.model_config.vocab_size
    asked = {"eligible": 0, "computed": 0}
    eligible, computed = async_scheduling.eligible, async_scheduling.computed

    def checked_eligible(works, requests, state, block_size):
        answer = eligible(works, requests, state, block_size)
        if isinstance(works, PlannedWorks):
            asked["eligible"] += 1
            assert answer == eligible(tuple(works), requests, state, block_size)
        return answer

    def checked_computed(lookahead, plan):
        answer = computed(lookahead, plan)
        if isinstance(lookahead.works, PlannedWorks) or isinstance(plan.scheduled, PlannedWorks):
            asked["computed"] += 1
            as_records = (dataclasses.replace(lookahead, works=tuple(lookahead.works)),
                          dataclasses.replace(plan, scheduled=tuple(plan.scheduled)))
            assert answer == computed(*as_records)
        return answer

    monkeypatch.setattr(async_scheduling, "eligible", checked_eligible)
    monkeypatch.setattr(async_scheduling, "computed", checked_computed)
    before = llm.engine.counters.lookahead_steps
    _run(llm, _workload(vocab, "b"))
    assert asked["eligible"] > 10 and asked["computed"] > 10
    assert llm.engine.counters.lookahead_steps > before + 10
