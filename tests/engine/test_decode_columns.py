"""A step's decodes as columns: the rows' works (``engine.core.scheduled_rows``) answer the
lookahead's questions as their records do, and plain rows (``engine.plain_rows``) record
what the per-row path records, step by step; with multi-step decode (``engine.multi_step``)
too, where a loop's tokens are recorded at once and the loop after it is planned from the
columns."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from engine import LLM, SamplingParams, async_scheduling, multi_step, plain_rows
from engine.core import decode_rows, scheduled_rows, scheduler
from engine.core.scheduled_rows import PlannedWorks
from engine.sampling_params import RequestOutputKind
from engine.worker import sampling_rows
from tests.engine.tiny import ENGINE, prompts, tiny_llm

STEPS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    llm, _ = tiny_llm("llama_gqa_tied", directory)
    return llm, directory


@pytest.fixture(scope="module")
def llm(checkpoint):
    return checkpoint[0]


@pytest.fixture(scope="module")
def multi(checkpoint):
    """An LLM of the same model running multi-step decodes of ``STEPS``."""
    return LLM(str(checkpoint[1]), **{**ENGINE, "num_scheduler_steps": STEPS})


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


def _checked_computed(asked: dict):
    """``async_scheduling.computed``, asserting that its answer on a lookahead or plan held as
    the rows' columns is its answer on the same works as records (counted in ``asked``)."""
    computed = async_scheduling.computed

    def checked(lookahead, plan):
        answer = computed(lookahead, plan)
        if isinstance(lookahead.works, PlannedWorks) or isinstance(plan.scheduled, PlannedWorks):
            asked["computed"] += 1
            as_records = (dataclasses.replace(lookahead, works=tuple(lookahead.works)),
                          dataclasses.replace(plan, scheduled=tuple(plan.scheduled)))
            assert answer == computed(*as_records)
        return answer

    return checked


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
    eligible = async_scheduling.eligible

    def checked_eligible(works, requests, state, block_size):
        answer = eligible(works, requests, state, block_size)
        if isinstance(works, PlannedWorks):
            asked["eligible"] += 1
            assert answer == eligible(tuple(works), requests, state, block_size)
        return answer

    monkeypatch.setattr(async_scheduling, "eligible", checked_eligible)
    monkeypatch.setattr(async_scheduling, "computed", _checked_computed(asked))
    before = llm.engine.counters.lookahead_steps
    _run(llm, _workload(vocab, "b"))
    assert asked["eligible"] > 10 and asked["computed"] > 10
    assert llm.engine.counters.lookahead_steps > before + 10


def test_steps_of_rows_and_prompts_are_prepared_from_the_columns_as_from_records(llm, monkeypatch):
    """A step of the rows' decodes and of newly admitted prompts: its logits plan and its
    model inputs from the rows' columns are those of the same works as records."""
    vocab, runner = llm.engine.model_config.vocab_size, llm.engine.runner
    asked = {"plan": 0, "prepare": 0}
    plan, prepare = sampling_rows.logits_plan, runner.prepare

    def mixed(works) -> bool:
        planned, others = scheduled_rows.rows_of(works)
        return planned is not None and any(work.is_prefill for work in others)

    def checked_plan(works, requests):
        tokens, rows, prompt_rows = answer = plan(works, requests)
        if mixed(works):
            asked["plan"] += 1
            as_records = plan(tuple(works), requests)
            assert (tokens, prompt_rows) == (as_records[0], as_records[2])
            assert [(r.logits_row, r.request, r.seq_id) for r in rows] == [
                (r.logits_row, r.request, r.seq_id) for r in as_records[1]]
        return answer

    def checked_prepare(works, logits_tokens, **options):
        inputs = prepare(works, logits_tokens, **options)
        if mixed(works):
            asked["prepare"] += 1
            expected = prepare(tuple(works), logits_tokens, **options)
            assert jax.tree.structure(inputs) == jax.tree.structure(expected)
            assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(inputs), jax.tree.leaves(expected)))
        return inputs

    monkeypatch.setattr(sampling_rows, "logits_plan", checked_plan)
    monkeypatch.setattr(runner, "prepare", checked_prepare)
    _run(llm, _workload(vocab, "m"))
    assert asked["plan"] >= 2 and asked["prepare"] >= 2


def test_plain_rows_record_a_loops_tokens_as_the_per_row_path(llm, multi, monkeypatch):
    """Step by step, and the final outputs those of one step per dispatch."""
    vocab = multi.engine.model_config.vocab_size
    loops = []
    record_steps = plain_rows.record_steps
    monkeypatch.setattr(plain_rows, "record_steps", lambda *args: loops.append(1) or record_steps(*args))
    at_once = _run(multi, _workload(vocab, "c"))
    assert len(loops) >= 3, "no loop was recorded at once"
    assert any(finish == "stop" and len(tokens) % STEPS for step in at_once for _, outputs, _ in step
               for _, tokens, finish, _ in outputs), "no sequence stopped inside a loop"
    monkeypatch.setattr(plain_rows, "of", lambda *args: None)
    assert _run(multi, _workload(vocab, "c")) == at_once
    params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in _params(vocab)]
    batch = prompts(len(params), vocab, seed=9)
    final = [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs]
             for o in multi.generate(batch, params, use_tqdm=False)]
    assert final == [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs]
                     for o in llm.generate(batch, params, use_tqdm=False)]


def test_the_loop_after_is_planned_from_the_columns_as_from_records(multi, monkeypatch):
    """``multi_step.next_works`` on the rows' columns: the same loop (rows, positions, steps,
    tables) or the same refusal as on the works as records; and ``computed`` answers alike."""
    vocab = multi.engine.model_config.vocab_size
    asked = {"next": 0, "computed": 0}
    next_works = multi_step.next_works

    def fields(works):
        return None if works is None else [(w.request_id, w.seq_ids, w.start, w.block_table, w.num_steps)
                                           for w in works]

    def checked_next(works, requests, state, num_steps):
        answer = next_works(works, requests, state, num_steps)
        if isinstance(works, PlannedWorks):
            asked["next"] += 1
            assert fields(answer) == fields(next_works(tuple(works), requests, state, num_steps))
        return answer

    monkeypatch.setattr(multi_step, "next_works", checked_next)
    monkeypatch.setattr(async_scheduling, "computed", _checked_computed(asked))
    before = multi.engine.counters.lookahead_steps
    stops = list(range(3, vocab, 41))
    static = [SamplingParams(temperature=0.8 * (i % 3 > 0), top_p=0.9, seed=i, max_tokens=30 + 7 * i,
                             stop_token_ids=stops if i % 2 else []) for i in range(8)]
    workload = {}
    for i, (prompt, params) in enumerate(zip(prompts(len(static), vocab, 3), static)):
        workload.setdefault(5 * (i % 3), []).append((f"d{i}", prompt, params))
    _run(multi, workload)
    assert asked["next"] > 10 and asked["computed"] > 10
    assert multi.engine.counters.lookahead_steps > before + 5


@pytest.mark.parametrize("engine", ["llm", "multi"])
def test_parallel_samples_held_as_rows_give_what_records_give(engine, request, monkeypatch):
    """Requests of several sequences (``n``, ``best_of``) run as a row per sequence once each
    has its own last block, and leave the rows when one of their sequences stops: every
    step's outputs are those of the groups held as records, one step per dispatch or eight."""
    llm = request.getfixturevalue(engine)
    vocab = llm.engine.model_config.vocab_size
    stops = list(range(3, vocab, 29))
    params = [SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=37, stop_token_ids=stops),
              SamplingParams(n=3, temperature=0.8, top_p=0.9, seed=2, max_tokens=29,
                             output_kind=RequestOutputKind.DELTA),
              SamplingParams(n=2, best_of=3, temperature=0.9, seed=3, max_tokens=25, stop_token_ids=stops,
                             output_kind=RequestOutputKind.FINAL_ONLY),
              SamplingParams(temperature=0, max_tokens=31, ignore_eos=True),
              SamplingParams(n=2, temperature=0.7, seed=4, presence_penalty=0.4, max_tokens=33)]
    batch = prompts(len(params), vocab, seed=5)
    workload = {}
    for i, (prompt, p) in enumerate(zip(batch, params)):
        workload.setdefault(2 * (i % 2), []).append((f"p{engine}{i}", prompt, p))
    held, left = [], []
    update = scheduler.update

    def spied(state, actions):
        after = update(state, actions)
        held.append(decode_rows.num_groups(after.rows) < len(after.rows))
        left.append(any(group.request_id in state.rows.request_ids for group in after.running_groups))
        return after

    monkeypatch.setattr(scheduler, "update", spied)
    as_rows = _run(llm, workload)
    assert sum(held) > 3, "no group of several sequences was held as rows"
    assert any(left), "no group left the rows when one of its sequences stopped"
    qualifies = decode_rows.qualifies
    monkeypatch.setattr(decode_rows, "qualifies", lambda group: len(group.seqs) == 1 and qualifies(group))
    assert _run(llm, workload) == as_rows
