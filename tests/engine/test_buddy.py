"""Buddy placement of the Orca baselines: aligned power-of-two runs, smallest buddy first."""

import hypothesis.strategies as st
import pytest
from hypothesis import given

from engine.config import EngineConfig
from engine.core import block_manager, buddy
from engine.core.block_manager import AllocStatus
from engine.core.sequence import Sequence, SequenceGroup
from engine.entrypoints import server


def test_order_rounds_up_to_a_power_of_two():
    assert [buddy.order_for(n) for n in (0, 1, 2, 3, 4, 5, 9, 16, 17)] == [0, 0, 1, 2, 2, 3, 4, 4, 5]


def test_a_run_comes_from_the_smallest_free_buddy():
    # Blocks 0-7 free except 1; 8-15 all free. A two-block run fits in 2-3 (inside the
    # split buddy 0-7), which keeps the whole buddy 8-15 for a larger request.
    free = set(range(16)) - {1}
    assert buddy.find_run(free, 16, 1) == 2
    assert buddy.find_run(free, 16, 0) == 0  # the lone free block next to the taken one
    assert buddy.find_run(free, 16, 3) == 8


def test_enough_free_blocks_but_no_aligned_run():
    free = {1, 2, 5, 6}  # four free blocks, no two of them buddies
    assert buddy.find_run(free, 8, 1) is None
    assert buddy.find_run(free, 8, 0) == 1


def test_a_pool_that_is_not_a_power_of_two_has_no_run_past_its_end():
    assert buddy.find_run(set(range(12)), 12, 3) == 0
    assert buddy.find_run(set(range(8, 12)), 12, 3) is None
    assert buddy.find_run(set(range(8, 12)), 12, 2) == 8
    assert not buddy.fits_in_empty_pool(12, 4)


@given(num_blocks=st.integers(1, 40), data=st.data())
def test_find_run_returns_an_aligned_free_run_whenever_one_exists(num_blocks, data):
    free = data.draw(st.sets(st.integers(0, num_blocks - 1)))
    order = data.draw(st.integers(0, 6))
    size = 1 << order
    aligned_free = [start for start in range(0, num_blocks - size + 1, size)
                    if all(block in free for block in range(start, start + size))]
    first = buddy.find_run(free, num_blocks, order)
    assert (first is None) == (not aligned_free)
    if first is not None:
        assert first in aligned_free


def config(**overrides):
    settings = dict(block_size=4, num_device_blocks=16, num_host_blocks=8, max_model_len=64,
                    watermark=0.0, reservation="orca-oracle")
    return block_manager.BlockManagerConfig(**(settings | overrides))


def group(request_id, prompt_len, output_len, first_seq_id=0, num_seqs=1):
    seqs = tuple(Sequence(first_seq_id + i, tuple(range(prompt_len))) for i in range(num_seqs))
    return SequenceGroup(request_id, seqs, arrival=0, max_tokens=output_len, num_seqs=num_seqs,
                         expected_output_len=output_len)


def held(state, seq_id) -> tuple[int, ...]:
    entry = state.seqs[seq_id]
    return entry.block_table + entry.reserved


def test_an_orca_request_gets_one_aligned_run_rounded_up_to_a_power_of_two():
    """Prompt 10 + output 10 = 5 blocks of 4 slots: the buddy allocator hands out 8."""
    state, _ = block_manager.allocate(block_manager.initial_state(config()), group("a", 10, 10))
    assert held(state, 0) == tuple(range(8))
    assert block_manager.block_table(state, 0) == (0, 1, 2)
    assert block_manager.num_free_device_blocks(state) == 8


def test_an_orca_request_waits_for_a_free_run_even_when_enough_blocks_are_free():
    state = block_manager.initial_state(config())
    for i in range(4):  # four runs of 4 blocks: 0-3, 4-7, 8-11, 12-15
        state, _ = block_manager.allocate(state, group(f"r{i}", 8, 4, first_seq_id=i))
    state = block_manager.free(block_manager.free(state, 0), 2)  # blocks 0-3 and 8-11 free, not buddies
    big = group("big", 12, 12, first_seq_id=9)  # 6 blocks -> a run of 8
    assert block_manager.num_free_device_blocks(state) == 8
    assert block_manager.can_allocate(state, big) is AllocStatus.LATER
    state = block_manager.free(state, 1)  # 0-7 merge into one free buddy
    assert block_manager.can_allocate(state, big) is AllocStatus.OK
    state, _ = block_manager.allocate(state, big)
    assert held(state, 9) == tuple(range(8))


def test_an_orca_request_larger_than_any_run_of_the_pool_never_fits():
    state = block_manager.initial_state(config(num_device_blocks=12))
    assert block_manager.can_allocate(state, group("a", 20, 20)) is AllocStatus.NEVER  # 10 blocks -> 16
    assert block_manager.can_allocate(state, group("b", 16, 16)) is AllocStatus.OK  # 8 blocks


def test_orca_sequences_of_a_group_each_get_a_run_and_free_returns_every_block():
    g = group("g", 6, 6, num_seqs=2)  # shared prompt 2 blocks; each sequence reserves 1 more
    state, _ = block_manager.allocate(block_manager.initial_state(config()), g)
    assert block_manager.block_table(state, 0) == block_manager.block_table(state, 1) == (0, 1)
    assert state.seqs[0].reserved == (2, 3)  # shared 2 + reserved 1 -> a run of 4
    assert state.seqs[1].reserved == (4,)  # from the smallest free buddy, 4-7, not from 8-15
    for seq in g.seqs:
        state = block_manager.free(state, seq.seq_id)
    assert block_manager.num_free_device_blocks(state) == 16
    assert block_manager.can_allocate(state, group("all", 32, 32)) is AllocStatus.OK  # one run of 16 again


def test_an_orca_baseline_with_prefix_caching_is_refused_before_loading_a_model():
    with pytest.raises(ValueError, match="'paged' with enable_prefix_caching"):
        EngineConfig(model="unused", reservation="orca-oracle", enable_prefix_caching=True)


def test_prefix_caching_is_on_by_default_except_for_the_orca_baselines():
    """As in vLLM V1; the paper's baselines had no prefix cache, so they get none unless asked
    (and asking is refused, above)."""
    assert EngineConfig(model="unused").prefix_caching
    assert not EngineConfig(model="unused", enable_prefix_caching=False).prefix_caching
    assert not EngineConfig(model="unused", reservation="orca-max").prefix_caching
    for flag, on in (([], True), (["--no-enable-prefix-caching"], False), (["--enable-prefix-caching"], True)):
        assert server.engine_config(server.build_parser().parse_args(flag)).prefix_caching is on
