"""Multi-step decode (``num_scheduler_steps``, ``engine.multi_step``): the same outputs as one
step per dispatch, whatever stops mid-loop, preempts, aborts or arrives; no block leaked."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.tiny import ENGINE, generate_queued, prompts, tiny_llm

STEPS = 8


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    """(one step per dispatch, 8 per dispatch, the checkpoint's directory, vocabulary size)."""
    directory = tmp_path_factory.mktemp("tiny")
    single, config = tiny_llm("llama_gqa_tied", directory)
    multi = LLM(str(directory), **{**ENGINE, "num_scheduler_steps": STEPS})
    return single, multi, directory, config.vocab_size


def assert_no_block_held(llm: LLM) -> None:
    stats = llm.cache_stats()
    assert stats.device_blocks_free == stats.device_blocks_total
    assert stats.host_blocks_free == stats.host_blocks_total


@pytest.fixture(autouse=True)
def no_block_leaks(llms):
    yield
    for llm in llms[:2]:
        assert_no_block_held(llm)


def seen(output) -> list:
    """What a user reads of a request's output: tokens, reasons, and the tokens and ranks of
    every log-probabilities entry (their values: :func:`logprobs`)."""
    return [(c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob is None,
             [sorted((t, lp.rank) for t, lp in step.items()) for step in c.logprobs or []])
            for c in output.outputs]


def logprobs(output) -> list[float]:
    """Every log-probability a request reports, cumulative ones included, in order."""
    return [value for c in output.outputs
            for value in [c.cumulative_logprob or 0.0]
            + [lp.logprob for step in c.logprobs or [] for _, lp in sorted(step.items())]]


def assert_same_outputs(outputs, expected) -> None:
    """Equal as a user reads them; log-probabilities to float32's last bits (the loop is
    another XLA program than the single step's, which may round them otherwise)."""
    assert [seen(o) for o in outputs] == [seen(o) for o in expected]
    for ours, theirs in zip(outputs, expected):
        assert logprobs(ours) == pytest.approx(logprobs(theirs), rel=1e-5, abs=1e-5)


def every_kind(vocab: int) -> list[SamplingParams]:
    """Requests of every sampling setting the loop runs on the device, and ones it cannot."""
    stops = list(range(3, vocab, 41))  # frequent enough to end sequences in the middle of a loop
    return [
        SamplingParams(temperature=0, max_tokens=30, logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=25),
        SamplingParams(temperature=1.0, top_k=20, seed=5, max_tokens=13),
        SamplingParams(temperature=0.9, min_p=0.1, seed=2, max_tokens=21, logprobs=2),
        SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=19),
        SamplingParams(n=2, best_of=3, temperature=1.0, seed=13, max_tokens=11),
        SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.3, max_tokens=27),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, seed=17, max_tokens=22),
        SamplingParams(temperature=1.0, seed=19, max_tokens=40, stop_token_ids=stops),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0.7, seed=3, min_tokens=12, max_tokens=24, stop_token_ids=stops),
        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
    ]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_outputs_equal_those_of_single_steps(llms, async_scheduling):
    """With async scheduling (a loop dispatched while the one before runs) and without."""
    single, multi, directory, vocab = llms
    if not async_scheduling:
        multi = LLM(str(directory), **{**ENGINE, "num_scheduler_steps": STEPS, "async_scheduling": False})
    params = every_kind(vocab)
    batch = prompts(len(params), vocab, seed=4)
    loops = multi.engine.counters.multi_steps
    expected = single.generate(batch, params, use_tqdm=False)
    outputs = multi.generate(batch, params, use_tqdm=False)
    assert_same_outputs(outputs, expected)
    assert multi.engine.counters.multi_steps > loops
    assert_no_block_held(multi)
    # some sequence stopped inside a loop, short of its max_tokens
    assert any(c.finish_reason == "stop" and 0 < len(c.token_ids) % STEPS for o in outputs for c in o.outputs)


def test_a_lone_greedy_sequence_runs_in_loops_of_the_steps_asked(llms):
    single, multi, _, vocab = llms
    greedy = SamplingParams(temperature=0, max_tokens=61, ignore_eos=True)
    prompt = prompts(1, vocab, seed=8)
    counters = multi.engine.counters
    steps, loops, taken = counters.steps, counters.multi_steps, counters.lookahead_steps
    (ours,) = multi.generate(prompt, greedy, use_tqdm=False)
    assert_same_outputs([ours], single.generate(prompt, greedy, use_tqdm=False))
    # the prefill samples the first token, then 60 more in loops of 8, the last of 4
    assert counters.steps - steps == 1 + 8
    assert counters.multi_steps - loops == 8
    # every loop but the first was dispatched while the one before it ran (async scheduling)
    assert counters.lookahead_steps - taken == 7


def test_a_penalised_sequence_runs_loops_dispatched_ahead_too(llms):
    """The loop after a penalised one counts its tokens, written on the device into the tokens
    the penalties count, where that array (a power of two wide) has room for them."""
    single, multi, _, vocab = llms
    params = SamplingParams(temperature=0.8, seed=5, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=61,
                            ignore_eos=True)
    prompt = prompts(1, vocab, seed=6)
    counters = multi.engine.counters
    loops, taken = counters.multi_steps, counters.lookahead_steps
    (ours,) = multi.generate(prompt, params, use_tqdm=False)
    assert_same_outputs([ours], single.generate(prompt, params, use_tqdm=False))
    assert counters.multi_steps - loops == 8
    # Built by the host after 1 and 17 tokens (16 and 64 wide: room for a loop, or for as many
    # tokens again), the loops after 9, 25, 33, 41, 49 and 57 tokens fit theirs.
    assert counters.lookahead_steps - taken == 6


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_sequences_resume_with_the_same_output(llms, mode):
    """A pool too small for every sequence: multi-step reservations that do not fit fall back
    to single steps, sequences are preempted and resumed, and each gets its unconstrained output."""
    single, _, directory, vocab = llms
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=40, ignore_eos=True) for i in range(8)]
    batch = prompts(len(params), vocab, seed=6)
    small = LLM(str(directory), **{**ENGINE, "num_blocks": 24, "preemption_mode": mode,
                                   "num_scheduler_steps": STEPS})
    outputs = small.generate(batch, params, use_tqdm=False)
    assert_same_outputs(outputs, single.generate(batch, params, use_tqdm=False))
    assert small.cache_stats().num_preemptions > 0, "the pool was meant to be too small"
    assert small.engine.counters.multi_steps > 0
    assert_no_block_held(small)


def test_requests_queued_for_a_seat_leave_loops_dispatched_ahead(llms):
    """More requests than seats: while the rest wait, each loop is still dispatched while the
    one before runs (no admission can follow until a sequence ends); the outputs are those of
    single steps with as many seats."""
    _, _, directory, vocab = llms
    seats = dict(ENGINE, max_num_seqs=4)  # n=4 needs four
    single, multi = (LLM(str(directory), **seats, num_scheduler_steps=steps) for steps in (1, STEPS))
    params = every_kind(vocab)
    batch = prompts(len(params), vocab, seed=14)
    outputs, taken = generate_queued(multi, batch, params)
    assert_same_outputs(outputs, generate_queued(single, batch, params)[0])
    assert taken >= 3  # none before the queue counted
    assert_no_block_held(multi)


def _run(llm: LLM, arrivals: dict[int, list], aborts: dict[int, str] | None = None) -> dict:
    """Drive ``llm.engine`` step by step: requests ``(request_id, prompt, params)`` added
    before step ``i`` of ``arrivals[i]``, request ids aborted before step ``i`` of ``aborts``.
    Returns each request's last output."""
    engine, finals, step = llm.engine, {}, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for request_id, prompt, params in arrivals.get(step, []):
            engine.add_request(request_id, prompt, params)
        if (aborts or {}).get(step):
            engine.abort_request(aborts[step])
        finals.update((output.request_id, output) for output in engine.step())
        step += 1
    return finals


def test_requests_arriving_or_aborted_during_loops(llms):
    """Arrivals join at the next step (a prefill, then loops again); a request aborted between
    loops frees its blocks; the others' outputs are those of single steps."""
    single, multi, _, vocab = llms
    batch = prompts(6, vocab, seed=9)
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=30 + i, ignore_eos=True) for i in range(6)]
    requests = [(f"r{i}", prompt, p) for i, (prompt, p) in enumerate(zip(batch, params))]
    arrivals = {0: requests[:3], 2: requests[3:5], 3: requests[5:]}
    loops = multi.engine.counters.multi_steps
    ours = _run(multi, arrivals, aborts={3: "r1"})
    assert multi.engine.counters.multi_steps - loops >= 3
    # aborted (no output after that, as in vLLM) after a loop or more
    assert ours["r1"].outputs[0].finish_reason is None and 1 < len(ours["r1"].outputs[0].token_ids) < 31
    assert "r1" not in multi.engine.requests
    expected = _run(single, {0: [r for r in requests if r[0] != "r1"]})
    assert_same_outputs([ours[request_id] for request_id in expected], list(expected.values()))


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="num_scheduler_steps must be an integer >= 1"):
        LLM(num_scheduler_steps=0)


def test_the_warm_up_compiles_the_greedy_loops(llms):
    """With warm-up on, a greedy batch's loops run programs compiled at start-up."""
    from engine.worker import stages

    _, _, directory, vocab = llms
    warm = LLM(str(directory), **{**ENGINE, "num_scheduler_steps": STEPS, "warmup": True})

    def loops() -> set:
        return {key for key in stages._compiled if key[0] == "decode_steps"}

    compiled = loops()
    batch = prompts(5, vocab, seed=12)
    warm.generate(batch, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert warm.engine.counters.multi_steps > 0
    assert loops() == compiled
    assert_no_block_held(warm)
