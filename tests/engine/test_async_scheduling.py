"""Async scheduling (``engine.async_scheduling``): the same outputs as without it, steps taken from
lookaheads, and nothing lost when the scheduler decides otherwise (ends, aborts, arrivals,
preemption)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.core.scheduler import ScheduledGroupWork
from engine.worker import sampling_rows
from tests.engine.tiny import ENGINE, generate_queued, prompts, tiny_llm


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    """(async LLM, sync LLM, vocabulary size) of one tiny checkpoint."""
    directory = tmp_path_factory.mktemp("tiny")
    on, config = tiny_llm("llama_gqa_tied", directory)
    off = LLM(str(directory), **{**ENGINE, "async_scheduling": False})
    return on, off, config.vocab_size


@pytest.fixture(autouse=True)
def no_block_leaks(llms):
    yield
    for llm in llms[:2]:
        stats = llm.cache_stats()
        assert stats.device_blocks_free == stats.device_blocks_total
        assert stats.host_blocks_free == stats.host_blocks_total


def _seen(output) -> list:
    """What a user reads of a request's output."""
    return [(c.token_ids, c.text, c.finish_reason, c.cumulative_logprob,
             [sorted((t, round(lp.logprob, 5)) for t, lp in step.items()) for step in c.logprobs or []])
            for c in output.outputs]


def _mixed_params(vocab: int) -> list[SamplingParams]:
    """One request of each kind a lookahead treats differently."""
    return [
        SamplingParams(temperature=0, max_tokens=30, logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=25),
        SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=20),
        SamplingParams(temperature=0.7, seed=3, min_tokens=12, max_tokens=24, stop_token_ids=[5, 9, 17]),
        SamplingParams(temperature=0, presence_penalty=0.5, repetition_penalty=1.2, max_tokens=18),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=1.0, seed=5, top_k=20, max_tokens=40, stop_token_ids=list(range(3, vocab, 97))),
    ]


def test_outputs_are_those_of_the_synchronous_engine(llms):
    on, off, vocab = llms
    params = _mixed_params(vocab)
    batch = prompts(len(params), vocab, seed=4)
    before = on.engine.counters.lookahead_steps
    ours = on.generate(batch, params, use_tqdm=False)
    assert [_seen(o) for o in ours] == [_seen(o) for o in off.generate(batch, params, use_tqdm=False)]
    assert on.engine.counters.lookahead_steps > before


def test_a_single_sequence_decodes_mostly_from_lookaheads(llms):
    on, off, vocab = llms
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompt = prompts(1, vocab, seed=8)
    steps, taken = on.engine.counters.steps, on.engine.counters.lookahead_steps
    (ours,) = on.generate(prompt, greedy, use_tqdm=False)
    assert _seen(ours) == _seen(off.generate(prompt, greedy, use_tqdm=False)[0])
    steps, taken = on.engine.counters.steps - steps, on.engine.counters.lookahead_steps - taken
    # All but the prefill and the first decode, the steps whose next tokens open a block too.
    assert taken == steps - 2


def test_parallel_samples_decode_mostly_from_lookaheads(llms):
    """n=2 sampling crosses block boundaries from lookaheads too (its blocks are reserved a
    step early, as a single sequence's), with the outputs of the synchronous engine."""
    on, off, vocab = llms
    params = SamplingParams(n=2, temperature=1.0, seed=13, max_tokens=40, ignore_eos=True)
    prompt = prompts(1, vocab, seed=9)
    steps, taken = on.engine.counters.steps, on.engine.counters.lookahead_steps
    (ours,) = on.generate(prompt, params, use_tqdm=False)
    assert _seen(ours) == _seen(off.generate(prompt, params, use_tqdm=False)[0])
    steps, taken = on.engine.counters.steps - steps, on.engine.counters.lookahead_steps - taken
    assert taken == steps - 2  # all but the prefill and the first decode


def test_greedy_decodes_take_the_decode_programs_arg_max(llms, monkeypatch):
    """Greedy steps run no sampler program (each token is the model's own arg-max, from the
    decode program or the head's), prefills included, with async scheduling and without, and
    give the same outputs."""
    on, off, vocab = llms
    sampled_steps = []
    for name in ("dispatch", "dispatch_next"):
        real = getattr(sampling_rows, name)
        monkeypatch.setattr(sampling_rows, name, lambda *args, real=real, **kw: sampled_steps.append(args[0].shape)
                            or real(*args, **kw))
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    batch = prompts(3, vocab, seed=12)
    ours = on.generate(batch, greedy, use_tqdm=False)
    assert [_seen(o) for o in ours] == [_seen(o) for o in off.generate(batch, greedy, use_tqdm=False)]
    assert not sampled_steps


def _drive(llm, events) -> tuple[dict, dict]:
    """Run ``events`` (step numbers → ("add", id, prompt, params) or ("abort", id)) on the
    engine, stepping until every request ends: every request's last output, and the step at
    which each request first left the waiting queue (admitted, ignored, or aborted before its
    step; a request that arrives while a lookahead runs may wait a step more with async
    scheduling: ``LLMEngine._plan``)."""
    engine, last, admitted, step = llm.engine, {}, {}, 0
    while step <= max(events) or engine.has_unfinished_requests():
        for event in events.get(step, []):
            if event[0] == "add":
                engine.add_request(*event[1:])
            else:
                if event[1] in {group.request_id for group in engine.state.waiting}:
                    admitted.setdefault(event[1], step)
                engine.abort_request(event[1])
        waiting = {group.request_id for group in engine.state.waiting}
        for output in engine.step():
            last[output.request_id] = output
        for request_id in waiting - {group.request_id for group in engine.state.waiting}:
            admitted.setdefault(request_id, step)
        step += 1
    return {request_id: _seen(output) for request_id, output in last.items()}, admitted


def _synchronous(off, events, admitted) -> dict:
    """The synchronous engine's outputs for ``events`` with each request added at the step
    that ``admitted`` says it left the async engine's waiting queue (so one aborted while
    waiting never runs in either): the same schedule, step by step."""
    moved: dict[int, list] = {}
    for step in sorted(events):  # so that requests moved to one step keep their order of arrival
        for event in events[step]:
            moved.setdefault(admitted.get(event[1], step) if event[0] == "add" else step, []).append(event)
    outputs, admitted_off = _drive(off, moved)
    assert admitted_off == admitted
    return outputs


def _agree(on, off, events) -> dict:
    """``events`` on the async engine: its outputs, checked against the synchronous engine's
    outputs of the same schedule."""
    ours, admitted = _drive(on, events)
    assert ours == _synchronous(off, events, admitted)
    return ours


def test_arrivals_and_aborts_while_a_lookahead_runs(llms):
    on, off, vocab = llms
    a, b, c = prompts(3, vocab, seed=12)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, seed=2, max_tokens=30, ignore_eos=True)
    events = {0: [("add", "a", a, long)], 5: [("add", "b", b, sampled)], 11: [("abort", "a")],
              12: [("add", "c", c, long)], 20: [("abort", "c")]}
    ours = _agree(on, off, events)
    assert ours["b"][0][2] == "length" and len(ours["a"][0][0]) < 40  # a's last output before its abort


def test_an_arrival_waits_a_step_for_the_lookahead_in_flight(llms):
    """A request that arrives while a lookahead runs enters a step later: the running decode
    takes the lookahead's tokens rather than dropping a step the device is already running.
    The outputs are the synchronous engine's for that schedule."""
    on, off, vocab = llms
    a, b = prompts(2, vocab, seed=30)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = on.engine
    engine.add_request("a", a, greedy)
    for _ in range(6):  # the prefill, the first decode, then decodes from lookaheads
        engine.step()
    engine.add_request("b", b, greedy)
    taken = engine.counters.lookahead_steps
    engine.step()
    assert engine.counters.lookahead_steps == taken + 1
    assert [group.request_id for group in engine.state.waiting] == ["b"]
    engine.step()
    assert not engine.state.waiting
    while engine.has_unfinished_requests():
        engine.step()
    events = {0: [("add", "a", a, greedy)], 6: [("add", "b", b, greedy)]}
    ours, admitted = _drive(on, events)
    assert admitted == {"a": 0, "b": 7}
    assert ours == _synchronous(off, events, admitted)
    events[7] = [("abort", "b")]  # before the step that would admit it: it never runs
    ours, admitted = _drive(on, events)
    assert admitted == {"a": 0, "b": 7} and all(not seen[0] for seen in ours.get("b", []))
    assert ours == _synchronous(off, events, admitted)


def test_a_sequence_that_ends_beside_one_that_goes_on(tmp_path):
    """A short request ends while a long one decodes from lookaheads: no lookahead may keep
    the short one's row going, since (in a fresh engine) its next slots are in the block the
    long one takes next."""
    on, config = tiny_llm("llama_gqa_tied", tmp_path)
    off = LLM(str(tmp_path), **{**ENGINE, "async_scheduling": False})
    short, long = prompts(2, config.vocab_size, seed=58)  # 1 and 60 tokens: blocks 8 and 0-7, 9, ...
    events = {0: [("add", "long", long, SamplingParams(temperature=0, max_tokens=20, logprobs=1, ignore_eos=True))],
              2: [("add", "short", short, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))]}
    _agree(on, off, events)
    assert on.engine.counters.lookahead_steps >= 10  # of the long one's 19 decodes


_PARAMS = st.builds(
    SamplingParams,
    n=st.sampled_from([1, 1, 2]),
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    seed=st.integers(0, 9),
    max_tokens=st.integers(4, 16),
    min_tokens=st.sampled_from([0, 0, 4]),
    presence_penalty=st.sampled_from([0.0, 0.0, 0.5]),
    stop_token_ids=st.sampled_from([[], [], [7, 30, 99]]),
)


@pytest.fixture(scope="module")
def seated_llms(tmp_path_factory):
    """(async LLM, sync LLM, vocabulary size) running two sequences at once: arrivals queue."""
    directory = tmp_path_factory.mktemp("tiny_seated")
    on, config = tiny_llm("llama_gqa_tied", directory, max_num_seqs=2)
    off = LLM(str(directory), **{**ENGINE, "max_num_seqs": 2, "async_scheduling": False})
    return on, off, config.vocab_size


_ARRIVALS = st.lists(st.tuples(st.integers(0, 12), _PARAMS), min_size=1, max_size=6)
_ABORTS = st.lists(st.tuples(st.integers(0, 5), st.integers(1, 20)), max_size=3)


@settings(max_examples=40, deadline=None)  # about 20 s; 15 once let a block-layout-dependent overwrite through
@given(arrivals=_ARRIVALS, aborts=_ABORTS, seed=st.integers(0, 99))
def test_any_arrivals_and_aborts_give_the_synchronous_outputs(llms, arrivals, aborts, seed):
    """Requests of random kinds arriving at random steps, some aborted later: every request's
    last output is the synchronous engine's."""
    _agree(*llms[:2], _events(arrivals, aborts, prompts(len(arrivals), llms[2], seed=seed)))


@settings(max_examples=8, deadline=None)  # about 10 s
@given(arrivals=_ARRIVALS, aborts=_ABORTS, seed=st.integers(0, 99))
def test_any_arrivals_and_aborts_queued_for_seats_give_the_synchronous_outputs(seated_llms, arrivals, aborts, seed):
    """The same with two seats: most arrivals wait for one, while lookaheads run."""
    on, off, vocab = seated_llms
    _agree(on, off, _events(arrivals, aborts, prompts(len(arrivals), vocab, seed=seed)))
    for llm in (on, off):
        stats = llm.cache_stats()
        assert stats.device_blocks_free == stats.device_blocks_total


def _events(arrivals, aborts, batch) -> dict[int, list]:
    """`_drive`'s events: request i added at its arrival step, aborted ``delay`` steps after."""
    events: dict[int, list] = {}
    for i, ((step, params), prompt) in enumerate(zip(arrivals, batch)):
        events.setdefault(step, []).append(("add", f"r{i}", prompt, params))
    for index, delay in aborts:
        if index < len(arrivals):
            events.setdefault(arrivals[index][0] + delay, []).append(("abort", f"r{index}"))
    return events


def test_preemption_and_recompute_give_the_same_outputs(tmp_path):
    small = dict(num_blocks=24, max_num_seqs=8)  # 192 slots for 6 sequences of up to 90 tokens
    on, config = tiny_llm("llama_gqa_tied", tmp_path, **small)
    off = LLM(str(tmp_path), **{**ENGINE, **small, "async_scheduling": False})
    batch = prompts(6, config.vocab_size, seed=21)
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=40, ignore_eos=True)
    ours = on.generate(batch, params, use_tqdm=False)
    assert [_seen(o) for o in ours] == [_seen(o) for o in off.generate(batch, params, use_tqdm=False)]
    assert on.engine.state.num_preemptions > 0 and on.engine.counters.lookahead_steps > 0


@pytest.mark.parametrize("queued_for", ["seats", "blocks"])
def test_requests_queued_behind_a_full_batch_leave_the_lookaheads_on(tmp_path, queued_for):
    """More requests than the engine runs at once: while the rest wait for a seat (or for
    blocks, here with preemption too), the running decodes still come from lookaheads, since
    no admission can follow until a sequence ends. The outputs are the synchronous engine's."""
    limit = dict(max_num_seqs=3) if queued_for == "seats" else dict(num_blocks=24, max_num_seqs=8)
    on, config = tiny_llm("llama_gqa_tied", tmp_path, **limit)
    off = LLM(str(tmp_path), **{**ENGINE, **limit, "async_scheduling": False})
    params = _mixed_params(config.vocab_size) + [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 2
    batch = prompts(len(params), config.vocab_size, seed=23)
    ours, taken = generate_queued(on, batch, params)
    assert [_seen(o) for o in ours] == [_seen(o) for o in generate_queued(off, batch, params)[0]]
    assert taken >= 10  # of the steps in which requests waited (none before the queue counted)
    stats = on.cache_stats()
    assert stats.device_blocks_free == stats.device_blocks_total and stats.host_blocks_free == stats.host_blocks_total


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_the_advanced_inputs_are_those_prepare_makes(llms, rows):
    runner = llms[0].engine.runner
    starts = [8 * (i % 5) + 7 - i % 8 for i in range(rows)]  # blocks of 8: row 0's next token opens one
    works = [ScheduledGroupWork("r", (i,), (4 + i,), start, tuple(range(3 * i, 3 * i + 10)), False, True)
             for i, start in enumerate(starts)]
    advanced = runner.advance(runner.prepare(works, range(rows)))
    following = [work.changed(token_ids=(0,), start=work.start + 1) for work in works]
    wanted = runner.prepare(following, range(rows))
    for got, want in zip(jax.tree.leaves(advanced.replace(input_ids=wanted.input_ids)), jax.tree.leaves(wanted)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_tables_given_since_are_those_prepare_makes(llms, rows):
    runner = llms[0].engine.runner
    size = runner.block_size
    # Row i's next token opens its table's last block when i is even: the block the scheduler
    # reserved after the lookahead's inputs were computed from the shorter table.
    starts = [size * (2 + i % 3) - 1 if i % 2 == 0 else size * (2 + i % 3) - 3 for i in range(rows)]
    works = [ScheduledGroupWork("r", (i,), (4 + i,), start, tuple(range(5 * i, 5 * i + -(-(start + 1) // size))),
                                False, True) for i, start in enumerate(starts)]
    reserved = [work.changed(block_table=work.block_table + (900 + i,)) if i % 2 == 0 else work
                for i, work in enumerate(works)]
    given = runner.with_tables_of(runner.advance(runner.prepare(works, range(rows))), reserved)
    wanted = runner.prepare([work.changed(token_ids=(0,), start=work.start + 1) for work in reserved], range(rows))
    np.testing.assert_array_equal(given.metadata.block_tables, wanted.metadata.block_tables)
    np.testing.assert_array_equal(given.metadata.slot_mapping, wanted.metadata.slot_mapping)


def test_penalised_sequences_decode_from_lookaheads(llms):
    """Penalties count the token still on the device: a lookahead's sampling parameters write it
    into the tokens they count (``sampling_rows.next_batch``), until that power-of-two-wide
    array is full and the host builds it again, twice as wide: the same outputs as without
    async scheduling."""
    on, off, vocab = llms
    params = [SamplingParams(temperature=0, frequency_penalty=1.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, presence_penalty=0.8, repetition_penalty=1.3, max_tokens=40,
                             ignore_eos=True)]
    batch = prompts(2, vocab, seed=3)
    counters = on.engine.counters
    steps, taken = counters.steps, counters.lookahead_steps
    ours = on.generate(batch, params, use_tqdm=False)
    assert [_seen(o) for o in ours] == [_seen(o) for o in off.generate(batch, params, use_tqdm=False)]
    # All but the prefill and the steps whose arrays the host builds: after 1, 3, 9 and 33
    # tokens (each a power of two wide with room for as many again, filled by lookaheads).
    assert counters.lookahead_steps - taken == counters.steps - steps - 5


def test_no_lookahead_where_its_inputs_would_depend_on_the_token(llms):
    """Until ``min_tokens``, EOS is banned as the host counts the tokens: it must see each one first."""
    on, _, vocab = llms
    engine = on.engine
    engine.add_request("p", prompts(1, vocab, seed=3)[0], SamplingParams(temperature=0, min_tokens=12,
                                                                         max_tokens=12, ignore_eos=True))
    before = engine.counters.lookahead_steps
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.counters.lookahead_steps == before


def test_an_orca_reservation_gives_the_same_outputs(tmp_path):
    """Blocks reserved ahead (the paper's Orca baselines) join a table when a token needs them:
    the lookahead leaves those steps to the scheduler."""
    on, config = tiny_llm("llama_gqa_tied", tmp_path, reservation="orca-max")
    off = LLM(str(tmp_path), **{**ENGINE, "reservation": "orca-max", "async_scheduling": False})
    batch = prompts(2, config.vocab_size, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    ours = on.generate(batch, greedy, use_tqdm=False)
    assert [_seen(o) for o in ours] == [_seen(o) for o in off.generate(batch, greedy, use_tqdm=False)]
    assert on.engine.counters.lookahead_steps > 0


def test_the_server_flag_and_a_bad_value():
    from engine.config import EngineConfig
    from engine.entrypoints.server import build_parser, engine_config

    assert engine_config(build_parser().parse_args([])).async_scheduling is True
    assert engine_config(build_parser().parse_args(["--no-async-scheduling"])).async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling must be True or False"):
        EngineConfig(async_scheduling="yes")
