"""Random engine runs: random pools, budgets, policies, requests and sampler decisions.

After every step the block accounting is checked (refcounts equal block-table references, each
block free xor referenced, swapped groups hold no device blocks, FCFS order); every plan is
checked (budgets, FCFS admission, no write into a shared block) and executed by the fake cache,
which verifies every KV read; every run is replayed and must give equal states.
"""

import collections
import dataclasses
import os
from unittest import mock

import hypothesis.strategies as st
import numpy as np
from hypothesis import event, given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine.core import block_manager, decode_rows, scheduler, scheduler_decodes, scheduler_update
from engine.core.sequence import SequenceStatus
from tests.engine.fake_engine import FakeCache, make_config, model_actions, sample, serve

SETTINGS = settings.get_profile(os.environ.get("ENGINE_HYPOTHESIS_PROFILE", "engine"))

PREFIXES = ((1, 2, 3, 1, 2), (1, 2, 3, 3), (2,))


@st.composite
def configs(draw):
    """Tiny pools and budgets, so that preemption, swapping and chunking happen all the time."""
    max_num_seqs = draw(st.integers(2, 4))
    reservation = draw(st.sampled_from(["paged"] * 5 + ["orca-max", "orca-pow2", "orca-oracle"]))
    return make_config(
        block_size=draw(st.integers(2, 4)),
        num_device_blocks=draw(st.integers(4, 12)),
        num_host_blocks=draw(st.sampled_from([0, 4, 16, 16])),
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 12)),
        max_num_seqs=max_num_seqs,
        max_model_len=draw(st.integers(8, 24)),
        watermark=draw(st.sampled_from([0.0, 0.2])),
        prefix_caching=reservation == "paged" and draw(st.booleans()),
        reservation=reservation,
        preemption_mode=draw(st.sampled_from([None, None, "recompute", "swap", "swap"])),
        policy=draw(st.sampled_from(["fcfs", "fcfs", "static"])),
        reserve_next_block=draw(st.booleans()),
    )


@st.composite
def requests(draw):
    """(prompt, num_seqs, max_tokens, expected_output_len, may_fork); prompts share prefixes
    often. Sequences fork whatever `may_fork` says: a fork of a sequence that holds a block
    reserved ahead must copy, not share, what it writes next."""
    prompt = draw(st.sampled_from(PREFIXES)) + tuple(draw(st.lists(st.integers(1, 4), max_size=6)))
    return prompt, draw(st.integers(1, 3)), draw(st.integers(1, 16)), draw(st.integers(1, 12)), draw(st.booleans())


@SETTINGS
@given(config=configs(), arrivals=st.lists(st.tuples(st.integers(0, 4), requests()), max_size=8),
       num_steps=st.sampled_from([1, 1, 2, 3, 8]))
def test_outputs_do_not_depend_on_memory_pressure(config, arrivals, num_steps):
    """Random tiny pools, budgets and policies, with multi-step decodes or not: every request
    that is not refused produces exactly what it produces with ample memory, one step at a time."""
    timed = [
        (arrival, f"{'beam' if i % 3 else 'req'}{i}", prompt, min(n, config.max_num_seqs), limit)
        for i, (arrival, (prompt, n, limit, _, _)) in enumerate(arrivals)
    ]
    ample_blocks = dataclasses.replace(config.block_manager, num_device_blocks=512, watermark=0.0)
    ample = dataclasses.replace(config, max_num_batched_tokens=256, block_manager=ample_blocks)
    expected, _ = serve(ample, timed)
    results, _ = serve(config, timed, num_steps=num_steps)
    for request_id, outputs in results.items():
        if "FINISHED_IGNORED" not in {status for _, status in outputs}:
            assert outputs == expected[request_id]


def _trace(config, requests, num_steps):
    """Every plan and every state after update of `fake_engine.serve`'s run of `requests`, the
    states with every running group a record."""
    state, cache, trace = scheduler.initial_state(config), FakeCache(config.block_manager.block_size), []
    for step in range(500):
        for arrival, request_id, prompt, num_seqs, max_tokens in requests:
            if arrival == step:
                state = scheduler.add_request(state, request_id, prompt, max_tokens=max_tokens, num_seqs=num_seqs,
                                              expected_output_len=max_tokens, may_fork=request_id.startswith("beam"))
        state, out = scheduler.schedule(state, num_steps=num_steps)
        cache.apply(out)
        state = scheduler.update(state, model_actions(state, cache.run(state, out)))
        trace.append((out, state.without_rows()))
        if not (state.waiting or state.num_running or state.swapped) and step >= max(r[0] for r in requests):
            return trace
    raise AssertionError("requests did not finish")


@SETTINGS
@given(config=configs(), arrivals=st.lists(st.tuples(st.integers(0, 4), requests()), min_size=1, max_size=8),
       num_steps=st.sampled_from([1, 1, 2, 8]))
def test_decodes_held_as_rows_are_planned_and_recorded_as_records_are(config, arrivals, num_steps):
    """The scheduler gives the same plans, blocks and outputs at every step whether it holds
    the running single-sequence decodes as rows (`engine.core.decode_rows`) or as records."""
    timed = [(arrival, f"{'beam' if i % 3 == 1 else 'req'}{i}", prompt, min(n, config.max_num_seqs), limit)
             for i, (arrival, (prompt, n, limit, _, _)) in enumerate(arrivals)]
    with_rows = _trace(config, timed, num_steps)
    with mock.patch.object(decode_rows, "qualifies", return_value=False):
        as_records = _trace(config, timed, num_steps)
    assert with_rows == as_records


def draw_actions(data, state: scheduler.SchedulerState, logits: dict) -> list:
    """Random sampler decisions; a fork only replaces a sequence that ended before it, and a
    request keeps at least one sequence."""
    actions, room = [], collections.Counter()
    kept = {group.request_id: len(group.seqs) for group in state.running}
    for work, row in logits.items():
        if work.num_steps > 1:  # the tokens of a multi-step decode: keep them all, or stop after some
            (seq_id,) = work.seq_ids
            kind = data.draw(st.sampled_from(["append"] * 5 + ["stop"]))
            kept_tokens = row if kind == "append" else row[: data.draw(st.integers(1, len(row)))]
            actions.append(scheduler.AppendMany(seq_id, kept_tokens))
            if kind == "stop":
                actions.append(scheduler.Finish(seq_id, SequenceStatus.FINISHED_STOPPED))
                room[work.request_id] += 1
            continue
        for index, seq_id in enumerate(work.seq_ids):
            token = sample(row, index)
            kind = data.draw(st.sampled_from(["append"] * 20 + ["stop", "drop", "fork", "fork"]))
            if kind == "drop" and kept[work.request_id] > 1:
                actions.append(scheduler.Drop(seq_id))
                room[work.request_id] += 1
                kept[work.request_id] -= 1
                continue
            if kind == "fork" and room[work.request_id] > 0:
                actions.append(scheduler.Fork(seq_id, None, sample(row, 99)))
                room[work.request_id] -= 1
                kept[work.request_id] += 1
            actions.append(scheduler.Append(seq_id, token))
            if kind == "stop":
                actions.append(scheduler.Finish(seq_id, SequenceStatus.FINISHED_STOPPED))
                room[work.request_id] += 1
    return actions


def bundle_appends(actions: list) -> list:
    """`actions` with every Append (or, when there is no Append, every AppendMany) in one
    AppendEach, first (the others after it, in order); `actions` itself when there is none."""
    appends = [action for action in actions if type(action) is scheduler.Append]
    if appends:
        each = scheduler.AppendEach(np.array([a.seq_id for a in appends], np.int64),
                                    np.array([a.token_id for a in appends], np.int64))
        return [each] + [action for action in actions if type(action) is not scheduler.Append]
    many = [action for action in actions if type(action) is scheduler.AppendMany]
    if not many:
        return actions
    width = max(len(a.token_ids) for a in many)
    tokens = np.array([a.token_ids + (-1,) * (width - len(a.token_ids)) for a in many], np.int64)
    each = scheduler.AppendEach(np.array([a.seq_id for a in many], np.int64), tokens,
                                np.array([len(a.token_ids) for a in many], np.int64))
    return [each] + [action for action in actions if type(action) is not scheduler.AppendMany]


def check_blocks(state: scheduler.SchedulerState) -> None:
    """Refcounts match the block tables; every block is free xor referenced; queues agree
    with where each sequence's blocks are."""
    blocks, size = state.blocks, state.config.block_manager.block_size
    on_device = {seq.seq_id: seq for group in state.running for seq in group.unfinished_seqs}
    on_host = {seq.seq_id: seq for group in state.swapped for seq in group.unfinished_seqs}
    assert set(blocks.seqs) == on_device.keys() | on_host.keys()
    for pool, holders, in_pool in ((blocks.device, on_device, True), (blocks.host, on_host, False)):
        counts = [0] * len(pool.refcounts)
        for seq_id, seq in holders.items():
            entry = blocks.seqs[seq_id]
            assert entry.on_device is in_pool
            assert len(entry.block_table) * size >= seq.len - 1
            for block in entry.block_table + entry.reserved:
                counts[block] += 1
        assert counts == [pool.refcounts[block] for block in range(len(counts))]
        referenced = {block for block, count in enumerate(counts) if count}
        evictable = blocks.prefix_cache.evictable if in_pool else ()
        unreferenced = (*pool.free, *evictable)
        assert len(set(unreferenced)) == len(unreferenced)
        assert not referenced & set(unreferenced)
        assert len(referenced) + len(unreferenced) == len(counts)
    cached = set(blocks.prefix_cache.by_block)
    assert set(blocks.prefix_cache.evictable) <= cached
    assert not cached & set(blocks.device.free)
    queues = {"WAITING": state.waiting, "RUNNING": state.running, "SWAPPED": state.swapped}
    for status, queue in queues.items():
        arrivals = [group.arrival for group in queue]
        assert arrivals == sorted(arrivals)
        assert all(seq.status.name == status for group in queue for seq in group.unfinished_seqs)
    if not (state.waiting or state.running or state.swapped):
        assert block_manager.num_free_device_blocks(blocks) == len(blocks.device.refcounts)
        assert len(blocks.host.free) == len(blocks.host.refcounts)


def check_plan(
    before: scheduler.SchedulerState, after: scheduler.SchedulerState, out: scheduler.SchedulerOutput
) -> None:
    """Budgets hold, admission is FCFS, and only unshared blocks (or blocks shared exactly by
    the sequences of one prefill entry) receive tokens, except full blocks the entry completes,
    which groups admitted later in the step may share (prefix caching)."""
    config, size = after.config, after.config.block_manager.block_size
    assert out.num_batched_tokens <= config.max_num_batched_tokens
    assert sum(len(group.unfinished_seqs) for group in after.running) <= config.max_num_seqs
    waiting_before = {group.request_id: group.arrival for group in before.waiting}
    admitted = [group.arrival for group in after.running if group.request_id in waiting_before]
    still_waiting = [group.arrival for group in after.waiting if group.request_id in waiting_before]
    assert not (admitted and out.preempted)
    if admitted and still_waiting:
        assert max(admitted) < min(still_waiting)
    refcounts = after.blocks.device.refcounts
    for work in out.scheduled:
        assert work.num_steps == 1 or (not work.is_prefill and len(work.seq_ids) == 1)
        for index in {p // size for p in range(work.start, work.write_end)}:
            block, completed = work.block_table[index], (index + 1) * size <= work.write_end
            shared = refcounts[block] > len(work.seq_ids)
            assert refcounts[block] >= len(work.seq_ids) and (completed or not shared), f"shared block {block} written"
        for seq_id in work.seq_ids:
            assert block_manager.block_table(after.blocks, seq_id)[: len(work.block_table)] == work.block_table


def check_queue_stays(planned: scheduler.SchedulerState, out: scheduler.SchedulerOutput, actions: list,
                      updated: scheduler.SchedulerState) -> None:
    """What async scheduling's lookaheads rest on (`SchedulerState.queue_settled`): after a
    step of decodes only that tried the queue (`queue_tried`), in which no sequence ended, the
    next step admits and swaps in nothing (no request arriving between them). ``planned``:
    the state after the step's schedule, ``updated`` after its update."""
    decodes_only = out.scheduled and not (
        out.blocks_to_swap_in or out.blocks_to_swap_out or out.preempted or out.ignored
        or any(work.is_prefill for work in out.scheduled))
    ended = any(isinstance(action, (scheduler.Finish, scheduler.Drop, scheduler.Fork)) for action in actions) or (
        _running_seqs(updated) != _running_seqs(planned))  # or at max_tokens
    if ended or not (out.queue_tried and decodes_only and (updated.waiting or updated.swapped)):
        return
    event("a step after one that tried the queue")
    assert planned.queue_settled
    after, following = scheduler.schedule(updated)
    assert not following.blocks_to_swap_in
    assert {g.request_id for g in updated.waiting} <= {g.request_id for g in after.waiting}
    assert {g.request_id for g in updated.swapped} <= {g.request_id for g in after.swapped}


def _running_seqs(state: scheduler.SchedulerState) -> int:
    return sum(len(group.unfinished_seqs) for group in state.running)


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / schedule + update / abort sequences; replayed at the end for equality."""

    @initialize(config=configs(), initial=st.lists(requests(), min_size=2, max_size=6))
    def start(self, config, initial):
        self.config = config
        self.state = scheduler.initial_state(config)
        self.cache = FakeCache(config.block_manager.block_size)
        self.calls, self.states = [], []
        self.add(initial)

    def _record(self, call, state):
        self.calls.append(call)
        self.states.append(state)
        self.state = state

    def add(self, requests):
        for prompt, num_seqs, max_tokens, expected, may_fork in requests:
            kwargs = dict(
                max_tokens=max_tokens, num_seqs=min(num_seqs, self.config.max_num_seqs),
                expected_output_len=expected, may_fork=may_fork,
            )
            call = ("add", f"r{len(self.calls)}", prompt, kwargs)
            self._record(call, scheduler.add_request(self.state, call[1], call[2], **call[3]))

    @rule(data=st.data(), new=st.lists(requests(), max_size=3), num_steps=st.integers(1, 6))
    def advance(self, data, new, num_steps):
        """New requests arrive, then the engine runs a few steps."""
        self.add(new)
        for _ in range(num_steps):
            self._step(data)

    def _step(self, data):
        admit = data.draw(st.integers(0, 4)) > 0  # the engine defers admissions behind a lookahead
        num_steps = data.draw(st.sampled_from([1, 1, 2, 4]))
        state, out = scheduler.schedule(self.state, admit=admit, num_steps=num_steps)
        with mock.patch.object(scheduler_decodes.Decodes, "add_single", lambda decodes, group: False):
            # The one-sequence decodes' shortcuts (the rows' columns, then `add_single` for
            # records) plan what the general path plans.
            as_records, out_of_records = scheduler.schedule(self.state.without_rows(), admit=admit, num_steps=num_steps)
            assert out_of_records == out
            assert as_records == dataclasses.replace(state.without_rows(), pending_rows=None)
        check_plan(self.state, state, out)
        if not admit:
            assert not out.blocks_to_swap_in and {g.request_id for g in self.state.waiting} <= {
                g.request_id for g in state.waiting}, "admit=False let a group in"
            if self.state.waiting:
                event("admission deferred")
        for name in ("blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy", "preempted"):
            if getattr(out, name):
                event(name)
        if out.ignored:
            event("ignored")
        if out.num_steps > 1:
            event("multi-step decode")
        if any(len(w.seq_ids) > 1 for w in out.scheduled):
            event("shared prefill")
        if any(w.is_prefill and not w.do_sample for w in out.scheduled):
            event("chunk")
        if any(len(w.seq_ids) < len(scheduler.find_group(state, w.request_id).unfinished_seqs)
               for w in out.scheduled if w.is_prefill):
            event("re-prefill of diverged sequences")
        self.cache.apply(out)
        logits = self.cache.run(state, out)
        aborted = None
        if state.running and data.draw(st.integers(0, 9)) == 0:
            aborted = data.draw(st.sampled_from([group.request_id for group in state.running]))
            state = scheduler.abort(state, aborted)
        logits = {work: row for work, row in logits.items() if work.request_id != aborted}
        actions = draw_actions(data, state, logits)
        if data.draw(st.booleans()):  # the output processor's form of a step of plain rows
            bundled = bundle_appends(actions)
            if bundled is not actions:
                # As records: the rows' path and the general path hold the same rows differently.
                from_bundled = scheduler.update(state, bundled).without_rows()
                assert from_bundled == scheduler.update(state, actions).without_rows()
                if scheduler_update._update_rows(state, bundled) is not None:
                    event("decode rows from one AppendEach" + (" of several tokens" if bundled[0].counts is not None
                                                               else ""))
                actions = bundled
        updated = scheduler.update(state, actions)
        # The shortcuts (the rows' columns, one token each: most engine steps) and the general
        # path agree; the general path and a second update of the same state read the rows'
        # tokens as they were, whatever the first update appended to the lists they share.
        assert updated.without_rows() == scheduler_update.update_in_general(state, actions)
        from_rows = scheduler_update._update_rows(state, actions)
        if from_rows is not None:
            event("decode rows" + (" and records" if state.running_groups else ""))
            assert from_rows == updated
            if decode_rows.num_groups(state.rows) < len(state.rows):
                event("decode rows of a group of several sequences")
            row_ids = set(state.rows.request_ids)
            if any(group.request_id in row_ids for group in from_rows.running_groups):
                event("a group's sequence stopped: the group left the rows")
        if scheduler_update._fits_one_token_each(state.without_rows(), actions):
            event("one token each")
        if aborted is None:
            check_queue_stays(state, out, actions, updated)
        self._record(("step", admit, num_steps, aborted, tuple(actions)), updated)
        if self.state.blocks.prefix_cache.num_hits:
            event("prefix hit")

    @rule(data=st.data())
    def abort(self, data):
        live = self.state.waiting + self.state.running + self.state.swapped
        ids = [group.request_id for group in live] + ["never-added"]
        request_id = data.draw(st.sampled_from(ids))
        self._record(("abort", request_id), scheduler.abort(self.state, request_id))

    @invariant()
    def blocks_are_consistent(self):
        check_blocks(self.state)

    @invariant()
    def live_ids_are_the_queued_requests(self):
        live = self.state.waiting + self.state.running + self.state.swapped
        assert set(self.state.live_ids) == {group.request_id for group in live}
        assert len(live) == len(self.state.live_ids)

    def teardown(self):
        """The same calls from the same initial state give equal states: the state is a value."""
        state = scheduler.initial_state(self.config)
        for call, expected in zip(self.calls, self.states):
            if call[0] == "add":
                state = scheduler.add_request(state, call[1], call[2], **call[3])
            elif call[0] == "abort":
                state = scheduler.abort(state, call[1])
            else:
                _, admit, num_steps, aborted, actions = call
                state, _ = scheduler.schedule(state, admit=admit, num_steps=num_steps)
                state = scheduler.update(scheduler.abort(state, aborted) if aborted else state, actions)
            assert state == expected


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = SETTINGS
