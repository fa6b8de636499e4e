"""The scheduler driven like the engine drives it, over the checking fake engine: resumption
after preemption, replay, abort, and the errors an engine or a user can cause."""

import dataclasses

import numpy as np
import pytest

from engine.core import block_manager, scheduler, scheduler_update
from engine.core.sequence import SequenceStatus
from tests.engine.fake_engine import VOCAB, append_ones, make_config, serve

SYSTEM_PROMPT = (5, 6, 7, 8, 9, 10)


def workload(num_requests=12):
    """Requests arriving three per step; half share a 6-token system prompt; every fourth forks
    and drops like beam search; 1 to 3 sequences each."""
    requests = []
    for i in range(num_requests):
        own = tuple((i * 7 + j * 3) % VOCAB or 1 for j in range(1 + i % 7))
        prompt = (SYSTEM_PROMPT if i % 2 else ()) + own
        name = ("beam" if i % 4 == 1 else "req") + str(i)
        requests.append((i // 3, name, prompt, 1 + i % 3, 6 + i % 7))
    return requests


@pytest.mark.parametrize("preemption_mode", [None, "recompute", "swap"])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preempted_requests_resume_exactly(preemption_mode, prefix_caching):
    """Under memory pressure (preemption, swapping) the outputs equal those with a large pool."""
    expected, _ = serve(make_config(), workload())
    config = make_config(
        num_device_blocks=18, num_host_blocks=12, max_num_batched_tokens=12,
        preemption_mode=preemption_mode, prefix_caching=prefix_caching,
    )
    results, state = serve(config, workload())
    assert results == expected
    assert state.num_preemptions > 0
    if preemption_mode == "swap":
        assert state.num_swap_outs > 0
    if prefix_caching:
        assert state.blocks.prefix_cache.num_hits > 0
    assert block_manager.num_free_device_blocks(state.blocks) == 18


def test_requests_admitted_together_compute_their_common_full_blocks_once():
    """With prefix caching, a request admitted after another in the same step shares the full
    blocks that step completes for it (vLLM V1 too): it computes only the rest, and every
    output equals a run without caching."""
    prompt = (*SYSTEM_PROMPT, 11, 12, 13)  # two full blocks of 4 shared, then private tokens
    requests = [(0, f"req{i}", prompt[: 8 + i % 2] + (i + 1,), 1 + i % 2, 5) for i in range(4)]
    config = make_config(prefix_caching=True)
    state = requests_added(scheduler.initial_state(config), requests)
    state, out = scheduler.schedule(state)
    first, *others = out.scheduled
    assert (first.start, len(first.token_ids)) == (0, 9)
    for work in others:
        assert work.start == 8 and work.block_table[:2] == first.block_table[:2]
    assert state.blocks.device.refcounts[first.block_table[0]] == sum(num_seqs for *_, num_seqs, _ in requests)
    state = scheduler.update(state, append_ones(out))
    assert not state.blocks.prefix_cache.scheduled
    assert state.blocks.prefix_cache.num_hits == 2 * len(others)
    assert scheduler.reset_prefix_cache(state) is None, "running requests hold cached blocks"

    results, state = serve(config, requests)
    assert results == serve(make_config(prefix_caching=False), requests)[0]
    assert block_manager.num_free_device_blocks(state.blocks) == config.block_manager.num_device_blocks


def requests_added(state, requests):
    for _, request_id, prompt, num_seqs, max_tokens in requests:
        state = scheduler.add_request(state, request_id, prompt, max_tokens=max_tokens, num_seqs=num_seqs)
    return state


def test_a_decode_reserves_the_block_of_its_next_token_unless_an_admission_may_follow():
    """With ``reserve_next_block`` (async scheduling) each decode's table holds its next
    token's slot: a block is taken a step early when that token opens it, unless the sequence
    samples its last token, or requests wait that the step did not try to admit (the engine
    defers arrivals: ``admit=False``). Requests that wait for a seat do not stop it: the step
    tried them (``queue_tried``). The outputs are those without, and every block comes back."""
    requests = [(0, "a", (1, 2, 3, 4, 5), 1, 9)]
    config = make_config(block_size=4, reserve_next_block=True)
    state = requests_added(scheduler.initial_state(config), requests)
    tables = []
    while state.running or state.waiting:
        state, out = scheduler.schedule(state)
        tables += [(work.context_len, len(work.block_table)) for work in out.scheduled if not work.is_prefill]
        state = scheduler.update(state, append_ones(out))
    # Context 8: the next token (position 8) opens a third block, taken now.
    assert tables == [(6, 2), (7, 2), (8, 3), (9, 3), (10, 3), (11, 3), (12, 4), (13, 4)]
    assert block_manager.num_free_device_blocks(state.blocks) == config.block_manager.num_device_blocks
    assert serve(config, requests)[0] == serve(make_config(block_size=4), requests)[0]

    last = requests_added(scheduler.initial_state(config), [(0, "a", (1, 2, 3, 4, 5), 1, 4)])
    for _ in range(4):
        last, out = scheduler.schedule(last)
        last = scheduler.update(last, append_ones(out))
    assert [(work.context_len, len(work.block_table)) for work in out.scheduled] == [(8, 2)]  # its last token

    for seats, admit, reserved in ((1, True, True), (2, False, False)):
        waiting = requests_added(scheduler.initial_state(dataclasses.replace(config, max_num_seqs=seats)), requests)
        for _ in range(3):
            waiting, out = scheduler.schedule(waiting)
            waiting = scheduler.update(waiting, append_ones(out))
        waiting, out = scheduler.schedule(requests_added(waiting, [(0, "b", (1, 2), 1, 3)]), admit=admit)
        assert [group.request_id for group in waiting.waiting] == ["b"]  # no seat, or not tried
        assert out.queue_tried is admit and waiting.queue_settled is admit
        assert [(work.context_len, len(work.block_table)) for work in out.scheduled] == [(8, 3 if reserved else 2)]


def test_parallel_samples_reserve_their_next_blocks_and_beams_do_not():
    """Sequences of a group that does not fork (parallel sampling) each get their next block a
    step early; a beam-search group's (``may_fork``) do not: a fork would share the block only
    to copy it."""
    config = make_config(block_size=4, reserve_next_block=True)

    def tables(may_fork):
        state = scheduler.add_request(scheduler.initial_state(config), "a", (1, 2, 3, 4, 5), max_tokens=6, num_seqs=2,
                                may_fork=may_fork)
        seen = []
        while state.running or state.waiting:
            state, out = scheduler.schedule(state)
            seen += [(work.seq_ids, work.context_len, work.block_table) for work in out.scheduled
                     if not work.is_prefill]
            state = scheduler.update(state, append_ones(out))
        assert block_manager.num_free_device_blocks(state.blocks) == config.block_manager.num_device_blocks
        return seen

    assert [(seq_ids, context, len(table)) for seq_ids, context, table in tables(may_fork=False)] == [
        ((0,), 6, 2), ((1,), 6, 2), ((0,), 7, 2), ((1,), 7, 2), ((0,), 8, 3), ((1,), 8, 3), ((0,), 9, 3), ((1,), 9, 3),
        ((0,), 10, 3), ((1,), 10, 3)]
    last = {seq_ids: table for seq_ids, _, table in tables(may_fork=False)}
    assert last[(0,)][0] == last[(1,)][0] and len({last[(0,)][2], last[(1,)][2]}) == 2  # own blocks ahead
    assert [len(table) for *_, table in tables(may_fork=True)] == [2] * 6 + [3] * 4
    pair = [(0, "a", (1, 2, 3, 4, 5), 2, 6)]
    assert serve(config, pair)[0] == serve(make_config(block_size=4), pair)[0]


def test_a_step_without_admissions_leaves_arrivals_waiting():
    """``admit=False`` (the engine's, while a lookahead runs) plans the running decodes alone,
    even though the new request fits, and reserves no block ahead while it waits; the next
    step admits it."""
    config = make_config(block_size=4, reserve_next_block=True)
    state, out = scheduler.schedule(requests_added(scheduler.initial_state(config), [(0, "a", (1, 2, 3), 1, 9)]))
    state = requests_added(scheduler.update(state, append_ones(out)), [(0, "b", (4, 5), 1, 3)])
    deferred, out = scheduler.schedule(state, admit=False)  # a's next token opens its second block
    assert [(work.request_id, work.is_prefill, len(work.block_table)) for work in out.scheduled] == [("a", False, 1)]
    assert [group.request_id for group in deferred.waiting] == ["b"]
    deferred = scheduler.update(deferred, append_ones(out))
    admitted, out = scheduler.schedule(deferred)
    assert [(work.request_id, work.is_prefill) for work in out.scheduled] == [("a", False), ("b", True)]
    assert not admitted.waiting


def test_the_same_calls_give_equal_states():
    config = make_config(num_device_blocks=18, max_num_batched_tokens=12, prefix_caching=True)
    assert serve(config, workload())[1] == serve(config, workload())[1]


def run_until(state, condition, max_steps=20):
    """Schedule and append sampled tokens until `condition(state)` holds right after schedule()."""
    for _ in range(max_steps):
        state, out = scheduler.schedule(state)
        if condition(state):
            return state
        state = scheduler.update(state, append_ones(out))
    raise AssertionError("condition never held")


@pytest.mark.parametrize("where", ["waiting", "mid-chunk", "running", "swapped"])
def test_abort_frees_everything_wherever_the_request_is(where):
    config = make_config(
        num_device_blocks=3, num_host_blocks=8, max_num_batched_tokens=4, max_num_seqs=4,
        preemption_mode="swap",
    )
    state = scheduler.add_request(scheduler.initial_state(config), "pair", range(7), max_tokens=8, num_seqs=2)
    state = scheduler.add_request(state, "single", range(3), max_tokens=8)
    reached = {
        "waiting": lambda s: True,
        "mid-chunk": lambda s: s.running and s.running[0].in_prefill,
        "running": lambda s: s.running and not s.running[0].in_prefill,
        "swapped": lambda s: s.swapped,
    }[where]
    state = run_until(state, reached)
    target = {"swapped": "single"}.get(where, "pair")
    state = scheduler.abort(state, target)
    assert {seq.status for seq in state.finished[-1].seqs} == {SequenceStatus.FINISHED_ABORTED}
    for other in [group.request_id for group in state.waiting + state.running + state.swapped]:
        state = scheduler.abort(state, other)
    assert block_manager.num_free_device_blocks(state.blocks) == 3 and len(state.blocks.host.free) == 8
    assert scheduler.abort(state, "pair") == state


@pytest.mark.parametrize("where", ["waiting", "running", "swapped"])
def test_a_live_request_id_is_refused_and_free_again_once_it_leaves(where):
    config = make_config(num_device_blocks=3, num_host_blocks=8, max_num_batched_tokens=4, max_num_seqs=4,
                         preemption_mode="swap")
    state = scheduler.add_request(scheduler.initial_state(config), "pair", range(7), max_tokens=2, num_seqs=2)
    state = scheduler.add_request(state, "single", range(3), max_tokens=2)
    state = run_until(state, {"waiting": lambda s: True, "running": lambda s: s.running and not s.running[0].in_prefill,
                              "swapped": lambda s: s.swapped}[where])
    target = {"swapped": "single"}.get(where, "pair")
    with pytest.raises(scheduler.InvalidRequestError, match=f"request id '{target}' is in use; pick a unique one"):
        scheduler.add_request(state, target, range(3), max_tokens=2)
    state = scheduler.abort(state, target)
    assert scheduler.find_group(state, target) is None
    state = scheduler.add_request(state, target, range(3), max_tokens=2)  # free again
    assert state.waiting[-1].request_id == target
    state = scheduler.update(state, append_ones(state.pending))  # the step run_until planned
    for _ in range(12):  # every request runs to its max_tokens and leaves
        state, out = scheduler.schedule(state)
        state = scheduler.update(state, append_ones(out))
    assert not state.live_ids and not (state.waiting or state.running or state.swapped)
    assert scheduler.add_request(state, "single", range(3), max_tokens=2).live_ids == {"single"}


def test_engine_misuse_is_reported():
    state = scheduler.initial_state(make_config())
    state = scheduler.add_request(state, "a", range(4), max_tokens=4, num_seqs=2)
    with pytest.raises(scheduler.SchedulerUsageError, match="call it first"):
        scheduler.update(state, [])
    state, _ = scheduler.schedule(state)
    with pytest.raises(scheduler.SchedulerUsageError, match="update"):
        scheduler.schedule(state)
    misuse = {
        "need an Append": [scheduler.Append(0, 1)],
        "several Appends": [scheduler.Append(0, 1), scheduler.Append(0, 2), scheduler.Append(1, 1)],
        "grow": [scheduler.Fork(0, None, 3), scheduler.Append(0, 1), scheduler.Append(1, 1)],
        "not sampled": [scheduler.Append(7, 1), scheduler.Append(0, 1), scheduler.Append(1, 1)],
        "FINISHED_": [scheduler.Append(0, 1), scheduler.Finish(1, SequenceStatus.RUNNING)],
        "in use": [scheduler.Fork(0, 1, 3), scheduler.Drop(0), scheduler.Append(1, 1)],
        "lose all": [scheduler.Drop(0), scheduler.Drop(1)],
    }
    for message, actions in misuse.items():
        with pytest.raises(scheduler.SchedulerUsageError, match=message):
            scheduler.update(state, actions)


@pytest.mark.parametrize(
    "prompt, kwargs, message",
    [
        ((), dict(max_tokens=1), "empty"),
        ((1,), dict(max_tokens=1, num_seqs=0), "num_seqs"),
        ((1,), dict(max_tokens=1, num_seqs=9), "max_num_seqs"),
        ((1,), dict(max_tokens=0), "max_tokens"),
        ((1,), dict(max_tokens=1, request_id="dup"), "unique"),
    ],
)
def test_bad_requests_say_what_to_change(prompt, kwargs, message):
    state = scheduler.add_request(scheduler.initial_state(make_config()), "dup", (1,), max_tokens=1)
    with pytest.raises(scheduler.InvalidRequestError, match=message):
        scheduler.add_request(state, kwargs.pop("request_id", "new"), prompt, **kwargs)
    oracle = scheduler.initial_state(make_config(reservation="orca-oracle"))
    with pytest.raises(scheduler.InvalidRequestError, match="expected_output_len"):
        scheduler.add_request(oracle, "r", (1,), max_tokens=1)


def test_bad_scheduler_config_says_what_to_change():
    with pytest.raises(block_manager.ConfigError, match="max_num_batched_tokens"):
        make_config(max_num_batched_tokens=4, max_num_seqs=8)
    with pytest.raises(block_manager.ConfigError, match="max_model_len"):
        scheduler.SchedulerConfig(
            max_num_batched_tokens=256, max_model_len=9, block_manager=make_config().block_manager
        )


def test_a_step_of_rows_and_newer_records_ends_sequences_in_the_general_order():
    """A decode held as a row and a newer request's prefill (a record) both reach max_tokens in
    one step: the rows' update frees their blocks in the order the general path frees them
    (by arrival), so the free list, and every block given out later, is the same."""
    state = scheduler.add_request(scheduler.initial_state(make_config()), "old", (1, 2, 3), max_tokens=2)
    state, out = scheduler.schedule(state)
    state = scheduler.update(state, append_ones(out))
    assert len(state.rows) == 1
    state = scheduler.add_request(state, "new", (4, 5, 6, 7, 1), max_tokens=1)
    state, out = scheduler.schedule(state)
    assert [work.request_id for work in out.scheduled] == ["old", "new"]
    actions = append_ones(out)
    assert scheduler_update._update_rows(state, actions) is not None, "the rows' update took this step"
    updated = scheduler.update(state, actions)
    assert [group.request_id for group in updated.finished] == ["old", "new"]
    assert updated.without_rows() == scheduler_update.update_in_general(state, actions)
    assert not updated.num_running


def test_a_loops_tokens_for_every_row_at_once_are_checked_against_its_steps():
    """A multi-step decode of rows (its works the rows' columns) records an AppendEach of each
    row's kept tokens as the AppendManys would; one with more tokens than a row's steps, or
    none, is refused as theirs are, naming what is wrong."""
    config = make_config(block_size=4, reserve_next_block=True)
    state = scheduler.initial_state(config)
    for name in ("a", "b"):
        state = scheduler.add_request(state, name, (1, 2, 3), max_tokens=20)
    state, out = scheduler.schedule(state)
    state = scheduler.update(state, append_ones(out))
    assert len(state.rows) == 2
    state, out = scheduler.schedule(state, num_steps=3)
    assert out.num_steps == 3 and len(scheduler_update.scheduled_rows.rows_of(out.scheduled)[0]) == 2
    seq_ids = np.array([work.seq_ids[0] for work in out.scheduled], np.int64)

    def each(tokens, counts):
        return scheduler.AppendEach(seq_ids, np.array(tokens, np.int64), np.array(counts, np.int64))

    kept = each([[7, 8, 9], [4, 5, -1]], [3, 2])
    many = [scheduler.AppendMany(int(seq_ids[0]), (7, 8, 9)), scheduler.AppendMany(int(seq_ids[1]), (4, 5))]
    assert scheduler_update._update_rows(state, [kept]) is not None, "the rows' update took the AppendEach"
    assert scheduler.update(state, [kept]).without_rows() == scheduler.update(state, many).without_rows()
    for tokens, counts in (([[7, 8, 9, 10], [4, 5, 6, 7]], [4, 2]), ([[7, 8, 9], [4, 5, 6]], [3, 0])):
        with pytest.raises(scheduler.SchedulerUsageError, match="AppendMany gives sequence"):
            scheduler.update(state, [each(tokens, counts)])
    with pytest.raises(scheduler.SchedulerUsageError, match=r"counts \[2\] of at most k"):
        each([[7, 8, 9], [4, 5, 6]], [4, 2])


def test_a_loop_of_rows_and_an_aborted_record_group_records_the_rows_tokens():
    """A multi-step decode of rows and of a group still held as a record (its two samples
    share the prompt's last block until this step copies it), the group aborted before the
    update: the rows' tokens are recorded, and the state is the general path's."""
    config = make_config(block_size=4)
    state = scheduler.initial_state(config)
    for name in ("a", "b"):
        state = scheduler.add_request(state, name, (1, 2, 3), max_tokens=20)
    state = scheduler.add_request(state, "pair", (1, 2, 4), max_tokens=20, num_seqs=2)
    state, out = scheduler.schedule(state)
    state = scheduler.update(state, append_ones(out))
    assert [len(state.rows), len(state.running_groups)] == [2, 1], "the pair shares a block: a record"
    state, out = scheduler.schedule(state, num_steps=3)
    assert out.num_steps == 3 and len(out.scheduled) == 4
    state = scheduler.abort(state, "pair")
    seq_ids = np.array([work.seq_ids[0] for work in out.scheduled[:2]], np.int64)
    each = scheduler.AppendEach(seq_ids, np.array([[7, 8, 9], [4, 5, 6]], np.int64), np.array([3, 2], np.int64))
    updated = scheduler.update(state, [each])
    assert updated.without_rows() == scheduler_update.update_in_general(state, [each])
    assert [scheduler.find_group(updated, name).seqs[0].output_token_ids for name in "ab"] == [(1, 7, 8, 9), (1, 4, 5)]


def test_a_group_leaving_the_rows_runs_on_before_newer_records():
    """A request of two samples held as rows loses one (a stop token) while a newer request of
    two, still a record, runs beside it: it leaves the rows and runs on as a record before the
    newer one, in arrival order, as the general path keeps it."""
    state = scheduler.initial_state(make_config(block_size=4))
    state = scheduler.add_request(state, "p", (1, 2, 3, 4), max_tokens=20, num_seqs=2)  # a full block: rows at once
    state, out = scheduler.schedule(state)
    state = scheduler.update(state, append_ones(out))
    state = scheduler.add_request(state, "q", (5, 6, 7), max_tokens=20, num_seqs=2)  # a shared last block: a record
    state, out = scheduler.schedule(state)
    assert (state.rows.request_ids, [group.request_id for group in state.running_groups]) == (("p", "p"), ["q"])
    actions = append_ones(out)
    actions.insert(1, scheduler.Finish(int(state.rows.seq_ids[0]), SequenceStatus.FINISHED_STOPPED))
    assert scheduler_update._update_rows(state, actions) is not None, "the rows' update took this step"
    updated = scheduler.update(state, actions)
    assert [group.request_id for group in updated.running_groups] == ["p", "q"] and not len(updated.rows)
    assert updated.without_rows() == scheduler_update.update_in_general(state, actions)


def test_one_append_each_of_the_rows_and_a_prefills_first_tokens_takes_the_rows_update():
    """The output processor records a step of decode rows and a newer request's prefill as one
    AppendEach of every sequence (the rows' first), a Finish after it for a row that stopped:
    the rows' update takes it (not the general path, which remakes every row as a record, a
    cost that grew with the batch in every step that admits a request), with the same state."""
    state = scheduler.initial_state(make_config(block_size=4))
    for name in ("a", "b", "c"):
        state = scheduler.add_request(state, name, (1, 2, 3), max_tokens=20)
    state, out = scheduler.schedule(state)
    state = scheduler.update(state, append_ones(out))
    state = scheduler.add_request(state, "new", (4, 5, 6, 7, 1), max_tokens=20, num_seqs=2)
    state, out = scheduler.schedule(state)
    assert len(state.rows) == 3 and [group.request_id for group in state.running_groups] == ["new"]
    seq_ids = [seq_id for work in out.scheduled for seq_id in work.seq_ids]
    actions = [scheduler.AppendEach(np.array(seq_ids, np.int64), np.arange(5, 5 + len(seq_ids), dtype=np.int64)),
               scheduler.Finish(seq_ids[1], SequenceStatus.FINISHED_STOPPED)]
    assert scheduler_update._update_rows(state, actions) is not None, "the rows' update took this step"
    updated = scheduler.update(state, actions)
    assert updated.without_rows() == scheduler_update.update_in_general(state, actions)
    assert [scheduler.find_group(updated, name).seqs[0].output_token_ids for name in ("a", "c")] == [(1, 5), (1, 7)]
    assert [seq.output_token_ids for seq in scheduler.find_group(updated, "new").seqs] == [(8,), (9,)]
