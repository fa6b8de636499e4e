"""The PagedAttention paper's figures and the serving behaviours it describes, as tests."""

import pytest

from engine.core import block_manager, scheduler
from engine.core.sequence import SequenceStatus
from tests.engine.fake_engine import append_ones

EOS, FOUR, SCORE, AND, SEVEN, YEARS, AGO, OUR, FATHERS, BROUGHT, MOTHERS = range(11)
PROMPT = (FOUR, SCORE, AND, SEVEN, YEARS, AGO, OUR)


def new_state(block_size=4, num_device_blocks=8, watermark=0.0, reservation="paged", **overrides):
    """A scheduler over a small device pool (max_model_len 64)."""
    blocks = block_manager.BlockManagerConfig(
        block_size=block_size,
        num_device_blocks=num_device_blocks,
        num_host_blocks=8,
        max_model_len=64,
        watermark=watermark,
        reservation=reservation,
    )
    settings = dict(max_num_batched_tokens=64, max_num_seqs=8) | overrides
    config = scheduler.SchedulerConfig(max_model_len=64, block_manager=blocks, **settings)
    return scheduler.initial_state(config)


def step(state, actions=()):
    """Record the previous step's `actions`, then plan the next one."""
    if state.pending is not None:
        state = scheduler.update(state, actions)
    return scheduler.schedule(state)


def refcounts(state, blocks):
    return tuple(state.blocks.device.refcounts[block] for block in blocks)


def test_fig6_a_seven_token_prompt_fills_one_and_three_quarter_blocks():
    """Fig. 6: the prompt takes two blocks, the second holding 3 tokens; the first generated
    token fills it; the second needs a new block."""
    state = scheduler.add_request(new_state(), "fig6", PROMPT, max_tokens=3)
    state, out = step(state)
    (prefill,) = out.scheduled
    assert (prefill.block_table, prefill.token_ids, prefill.do_sample) == ((0, 1), PROMPT, True)
    state, out = step(state, [scheduler.Append(0, FATHERS)])
    assert scheduler.stats(state).blocks.tokens_stored == 7
    (decode,) = out.scheduled
    assert (decode.start, decode.block_table, decode.is_prefill) == (7, (0, 1), False)
    state, out = step(state, [scheduler.Append(0, BROUGHT)])
    assert (out.scheduled[0].start, out.scheduled[0].block_table) == (8, (0, 1, 2))


def test_fig8_parallel_samples_share_the_prompt_and_copy_on_write():
    """Fig. 8: two samples share the prompt's blocks (refcount 2); the first write to the
    shared, partly filled last block copies it; the other sample then writes in place."""
    state = scheduler.add_request(new_state(), "fig8", PROMPT, max_tokens=4, num_seqs=2)
    state, out = step(state)
    (prefill,) = out.scheduled
    assert prefill.seq_ids == (0, 1) and prefill.block_table == (0, 1)
    assert refcounts(state, (0, 1)) == (2, 2)
    state, out = step(state, [scheduler.Append(0, FATHERS), scheduler.Append(1, MOTHERS)])
    assert out.blocks_to_copy == ((1, 2),)
    assert [work.block_table for work in out.scheduled] == [(0, 2), (0, 1)]
    assert refcounts(state, (0, 1, 2)) == (2, 1, 1)
    state = scheduler.update(state, [scheduler.Append(0, 11), scheduler.Append(1, 12)])
    assert scheduler.stats(state).blocks.blocks_saved_by_sharing == 1


def test_fig9_beam_search_shares_prefixes_and_frees_dropped_beams():
    """Fig. 9: beams share the prompt block and the blocks of common ancestors; a dropped
    beam's own blocks are freed; a fork's shared last block is copied on write."""
    state = scheduler.add_request(new_state(), "fig9", PROMPT[:4], max_tokens=8, num_seqs=3)
    state, out = step(state)
    state, out = step(state, [scheduler.Append(0, 20), scheduler.Append(1, 21), scheduler.Append(2, 22)])
    assert [work.block_table for work in out.scheduled] == [(0, 1), (0, 2), (0, 3)]
    beam_0_twice = [scheduler.Fork(0, None, 31), scheduler.Append(0, 30), scheduler.Append(1, 32), scheduler.Drop(2)]
    state = scheduler.update(state, beam_0_twice)
    assert block_manager.block_table(state.blocks, 3) == (0, 1)  # the child of beam 0
    assert refcounts(state, (0, 1, 2, 3)) == (3, 2, 1, 0)
    state, out = scheduler.schedule(state)
    assert out.blocks_to_copy == ((1, 4),)
    assert [work.seq_ids for work in out.scheduled] == [(0,), (1,), (3,)]
    assert refcounts(state, (0, 1, 2, 4)) == (3, 1, 1, 1)
    ends = [scheduler.Append(seq_id, EOS) for seq_id in (0, 1, 3)]
    ends += [scheduler.Finish(seq_id, SequenceStatus.FINISHED_STOPPED) for seq_id in (0, 1, 3)]
    state = scheduler.update(state, ends)
    assert [group.request_id for group in state.finished] == ["fig9"]
    assert block_manager.num_free_device_blocks(state.blocks) == 8


def test_the_watermark_keeps_admissions_from_taking_the_last_blocks():
    state = new_state(num_device_blocks=10, watermark=0.1)
    state = scheduler.add_request(state, "big", range(36), max_tokens=1)  # 9 of 10 blocks
    state = scheduler.add_request(state, "small", range(4), max_tokens=1)  # 1 block
    state, out = step(state)
    assert [work.request_id for work in out.scheduled] == ["big"]
    state, out = step(state, [scheduler.Append(0, 1)])
    assert [work.request_id for work in out.scheduled] == ["small"]


def test_requests_that_can_never_fit_are_ignored_not_retried():
    state = new_state(num_device_blocks=4)
    state = scheduler.add_request(state, "too-long", range(65), max_tokens=1)
    state = scheduler.add_request(state, "too-big", range(17), max_tokens=1)  # 5 blocks > 4
    state = scheduler.add_request(state, "fits", range(4), max_tokens=1)
    state, out = step(state)
    reasons = dict(out.ignored)
    assert "65 tokens" in reasons["too-long"] and "max_model_len=64" in reasons["too-long"]
    assert "needs 5 KV blocks" in reasons["too-big"] and "has 4 blocks" in reasons["too-big"]
    assert {seq.status for group in state.finished for seq in group.seqs} == {
        SequenceStatus.FINISHED_IGNORED
    }
    assert [work.request_id for work in out.scheduled] == ["fits"]
    state, out = step(state, [scheduler.Append(2, 1)])
    assert not out.ignored and not state.waiting


def test_long_prompts_are_chunked_after_the_decodes():
    state = new_state(max_num_batched_tokens=4, max_num_seqs=2)
    state = scheduler.add_request(state, "short", range(2), max_tokens=8)
    state = scheduler.add_request(state, "long", range(10), max_tokens=8)
    state, out = step(state)
    plans = []
    for _ in range(4):
        plans.append(
            [(w.request_id, w.start, len(w.token_ids), w.do_sample) for w in out.scheduled]
        )
        state, out = step(state, append_ones(out))
    assert plans == [
        [("short", 0, 2, True), ("long", 0, 2, False)],
        [("short", 2, 1, True), ("long", 2, 3, False)],
        [("short", 3, 1, True), ("long", 5, 3, False)],
        [("short", 4, 1, True), ("long", 8, 2, True)],
    ]


@pytest.mark.parametrize("policy, admitted_at", [("fcfs", 1), ("static", 3)])
def test_static_batching_waits_for_the_whole_batch(policy, admitted_at):
    state = scheduler.add_request(new_state(policy=policy), "first", range(4), max_tokens=3)
    state, out = step(state)
    state = scheduler.add_request(state, "second", range(4), max_tokens=3)
    for step_index in range(1, 4):
        state, out = step(state, append_ones(out))
        if any(work.request_id == "second" for work in out.scheduled):
            break
    assert step_index == admitted_at


@pytest.mark.parametrize(
    "reservation, slots",
    [("paged", 12), ("orca-oracle", 32), ("orca-pow2", 64), ("orca-max", 64)],
)
def test_reservation_policies_waste(reservation, slots):
    """Prompt 10, true output 20, block size 4: paged holds 3 blocks; Orca (Oracle) reserves
    10 + 20 slots (8 blocks), Orca (Pow2) 10 + 32 (11 blocks, which the buddy allocator rounds
    up to 16), Orca (Max) max_model_len = 64."""
    state = new_state(num_device_blocks=20, reservation=reservation)
    state = scheduler.add_request(state, "r", range(10), max_tokens=20, expected_output_len=20)
    state, out = step(state)
    state = scheduler.update(state, [scheduler.Append(0, 1)])
    stats = scheduler.stats(state).blocks
    assert (stats.slots_allocated, stats.tokens_stored) == (slots, 10)
    assert stats.kv_waste == pytest.approx(1 - 10 / slots)
    free = block_manager.num_free_device_blocks(state.blocks)
    for _ in range(18):
        state, out = scheduler.schedule(state)
        state = scheduler.update(state, [scheduler.Append(0, 1)])
    grown = free - block_manager.num_free_device_blocks(state.blocks)
    assert grown == (4 if reservation == "paged" else 0)  # slots for 28 tokens: 7 blocks
