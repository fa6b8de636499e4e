"""Block manager: allocation, copy-on-write, forks, swapping and the prefix cache."""

import dataclasses

import hypothesis
import hypothesis.strategies as st
import pytest

from engine.core import block_manager, block_pool, block_swap, prefix_cache
from engine.core.block_manager import AllocStatus, BlockManagerConfig, ConfigError
from engine.core.sequence import Sequence, SequenceGroup


def device_refcounts(state, num_blocks: int) -> tuple[int, ...]:
    """The reference counts of device blocks 0 .. num_blocks - 1."""
    return tuple(state.device.refcounts[block] for block in range(num_blocks))


def make_config(**overrides) -> BlockManagerConfig:
    settings = dict(
        block_size=4, num_device_blocks=8, num_host_blocks=8, max_model_len=64, watermark=0.0
    )
    return BlockManagerConfig(**(settings | overrides))


def make_group(prompt, num_seqs=1, first_seq_id=0, request_id="r") -> SequenceGroup:
    seqs = tuple(Sequence(first_seq_id + i, tuple(prompt)) for i in range(num_seqs))
    return SequenceGroup(request_id, seqs, arrival=0, max_tokens=16, num_seqs=num_seqs)


def grow(seq: Sequence, *tokens: int) -> Sequence:
    """`seq` after sampling `tokens`, with everything before the last token computed."""
    output = seq.output_token_ids + tokens
    num_computed = seq.len + len(tokens) - 1
    return dataclasses.replace(seq, output_token_ids=output, num_computed_tokens=num_computed)


def computed(seq: Sequence) -> Sequence:
    return dataclasses.replace(seq, num_computed_tokens=seq.len)


def test_a_group_shares_its_prompt_blocks():
    group = make_group(range(10), num_seqs=3)
    state, num_cached = block_manager.allocate(block_manager.initial_state(make_config()), group)
    assert num_cached == 0
    tables = {block_manager.block_table(state, seq.seq_id) for seq in group.seqs}
    assert tables == {(0, 1, 2)}
    assert device_refcounts(state, 3) == (3, 3, 3)
    assert block_manager.num_free_device_blocks(state) == 5
    for seq in group.seqs:
        state = block_manager.free(state, seq.seq_id)
    assert device_refcounts(state, 8) == (0,) * 8 and block_manager.num_free_device_blocks(state) == 8


def test_can_allocate_keeps_the_watermark_free():
    state = block_manager.initial_state(make_config(num_device_blocks=10, watermark=0.1))
    assert block_manager.can_allocate(state, make_group(range(40))) is AllocStatus.NEVER  # 10 blocks
    assert block_manager.can_allocate(state, make_group(range(36))) is AllocStatus.OK  # 9 of 10
    state, _ = block_manager.allocate(state, make_group(range(20)))  # 5 blocks
    assert block_manager.can_allocate(state, make_group(range(17), first_seq_id=1)) is AllocStatus.LATER
    assert block_manager.can_allocate(state, make_group(range(16), first_seq_id=1)) is AllocStatus.OK


def test_append_slot_takes_a_block_only_when_the_last_is_full():
    seq = Sequence(0, tuple(range(4)))
    state, _ = block_manager.allocate(block_manager.initial_state(make_config()), make_group(seq.prompt_token_ids))
    seq = grow(seq, 9)
    state, copy = block_manager.append_slot(state, seq)
    assert copy is None and block_manager.block_table(state, 0) == (0, 1)
    unchanged, copy = block_manager.append_slot(state, grow(seq, 9))
    assert unchanged is state and copy is None


def test_copy_on_write_only_for_shared_blocks():
    group = make_group(range(6), num_seqs=2)
    state, _ = block_manager.allocate(block_manager.initial_state(make_config()), group)
    first, second = (grow(seq, 7) for seq in group.seqs)
    assert block_manager.can_append_slots(state, dataclasses.replace(group, seqs=(first, second)))
    state, copy = block_manager.append_slot(state, first)
    assert copy == (1, 2)
    state, copy = block_manager.append_slot(state, second)
    assert copy is None
    assert block_manager.block_table(state, 0) == (0, 2) and block_manager.block_table(state, 1) == (0, 1)
    assert device_refcounts(state, 3) == (2, 1, 1)


def test_copy_on_write_counts_the_last_writer_in_place():
    group = make_group(range(6), num_seqs=2)
    state, _ = block_manager.allocate(block_manager.initial_state(make_config(num_device_blocks=3)), group)
    grown = dataclasses.replace(group, seqs=tuple(grow(seq, 7) for seq in group.seqs))
    assert block_manager.can_append_slots(state, grown)  # one copy, one in-place write: 1 free block is enough


def test_fork_shares_every_block_and_free_releases_only_the_child():
    seq = Sequence(0, tuple(range(6)))
    state, _ = block_manager.allocate(block_manager.initial_state(make_config()), make_group(seq.prompt_token_ids))
    state = block_manager.fork(state, 0, 5)
    assert block_manager.block_table(state, 5) == (0, 1)
    assert device_refcounts(state, 2) == (2, 2)
    state = block_manager.free(state, 5)
    assert device_refcounts(state, 2) == (1, 1)


def test_a_fork_after_a_block_appended_ahead_copies_the_block_it_writes():
    """A block appended before any token needs it (the scheduler's reservation ahead) is shared
    by a fork too; the next token's block, not the table's last, is then copied on write."""
    seq = Sequence(0, tuple(range(6)))
    state, _ = block_manager.allocate(block_manager.initial_state(make_config()), make_group(seq.prompt_token_ids))
    assert block_manager.num_fresh_blocks(state, 0, 1) <= block_manager.num_free_device_blocks(state)
    state = block_manager.append_blocks(state, {0: 1})
    assert block_manager.block_table(state, 0) == (0, 1, 2)
    state = block_manager.fork(state, 0, 5)
    state, copy = block_manager.append_slot(state, grow(seq, 7))  # position 6, in block 1, shared
    assert copy == (1, 3) and block_manager.block_table(state, 0) == (0, 3, 2)
    assert block_manager.block_table(state, 5) == (0, 1, 2) and device_refcounts(state, 4) == (2, 1, 2, 1)
    for seq_id in (0, 5):
        state = block_manager.free(state, seq_id)
    assert block_manager.num_free_device_blocks(state) == 8


def test_swap_out_and_in_keep_sharing():
    group = make_group(range(6), num_seqs=2)
    state, _ = block_manager.allocate(block_manager.initial_state(make_config()), group)
    state, _ = block_manager.append_slot(state, grow(group.seqs[0], 1))
    assert block_swap.can_swap_out(state, group)
    state, pairs = block_swap.swap_out(state, group)
    assert pairs == ((0, 0), (2, 1), (1, 2))
    assert block_manager.num_free_device_blocks(state) == 8
    assert tuple(state.host.refcounts[block] for block in range(3)) == (2, 1, 1)
    assert block_swap.can_swap_in(state, group) is AllocStatus.OK
    state, pairs = block_swap.swap_in(state, group)
    assert [host for host, _ in pairs] == [0, 1, 2]
    assert list(state.device.refcounts.values()).count(0) == 5 and len(state.host.free) == 8
    assert block_manager.block_table(state, 0)[0] == block_manager.block_table(state, 1)[0]


def test_swapping_is_all_or_nothing():
    group = make_group(range(12))
    state, _ = block_manager.allocate(block_manager.initial_state(make_config(num_host_blocks=2)), group)
    assert not block_swap.can_swap_out(state, group)
    small = block_manager.initial_state(make_config(num_device_blocks=3, num_host_blocks=8))
    small, _ = block_manager.allocate(small, group)
    small, _ = block_swap.swap_out(small, group)
    assert block_swap.can_swap_in(small, group) is AllocStatus.NEVER  # 3 blocks + 1 to grow > 3


def test_stats_count_waste_and_sharing():
    group = make_group(range(6), num_seqs=3)
    state, _ = block_manager.allocate(block_manager.initial_state(make_config()), group)
    stats = block_manager.stats(state, {seq.seq_id: 6 for seq in group.seqs})
    assert (stats.device_blocks_used, stats.slots_allocated, stats.tokens_stored) == (2, 8, 6)
    assert stats.blocks_saved_by_sharing == 4
    assert stats.kv_waste == pytest.approx(0.25)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(block_size=0), "block_size"),
        (dict(num_host_blocks=-1), "num_host_blocks"),
        (dict(watermark=1.0), "watermark"),
        (dict(reservation="orca"), "reservation"),
        (dict(reservation="orca-oracle", enable_prefix_caching=True), "no prefix cache"),
    ],
)
def test_bad_config_says_what_to_change(overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_config(**overrides)


# --- prefix caching -------------------------------------------------------------------------

CACHING = dict(enable_prefix_caching=True)


def admit_and_compute(state, prompt, seq_id):
    """Allocate a one-sequence request and mark its whole prompt computed."""
    group = make_group(prompt, first_seq_id=seq_id)
    state, num_cached = block_manager.allocate(state, group)
    return block_manager.mark_computed(state, [computed(group.seqs[0])]), num_cached


def test_prefix_cache_reuses_computed_full_blocks():
    state, _ = admit_and_compute(block_manager.initial_state(make_config(**CACHING)), range(10), 0)
    state, num_cached = block_manager.allocate(state, make_group(list(range(8)) + [50, 51], first_seq_id=1))
    assert num_cached == 8
    assert block_manager.block_table(state, 1)[:2] == (0, 1) and device_refcounts(state, 2) == (2, 2)
    stats = block_manager.stats(state, {0: 10, 1: 8})
    assert (stats.prefix_cache_hits, stats.prefix_cache_queries) == (2, 4)  # 2 misses, 2 hits


def test_prefix_cache_never_reuses_the_block_of_the_last_prompt_token():
    state, _ = admit_and_compute(block_manager.initial_state(make_config(**CACHING)), range(8), 0)
    _, num_cached = block_manager.allocate(state, make_group(range(8), first_seq_id=1))
    assert num_cached == 4  # the second block holds token 7, whose logits are needed


def test_prefix_cache_ignores_blocks_not_yet_computed():
    state, _ = block_manager.allocate(block_manager.initial_state(make_config(**CACHING)), make_group(range(10)))
    _, num_cached = block_manager.allocate(state, make_group(range(10), first_seq_id=1))
    assert num_cached == 0


def test_prefix_cache_finds_blocks_this_step_completes_until_it_is_recorded():
    state, _ = block_manager.allocate(block_manager.initial_state(make_config(**CACHING)), make_group(range(10)))
    state = block_manager.mark_scheduled(state, make_group(range(10)).seqs[0], 9)  # tokens 0-8: two full blocks
    state, num_cached = block_manager.allocate(state, make_group(list(range(8)) + [7, 7, 7], first_seq_id=1))
    assert num_cached == 8 and block_manager.block_table(state, 1)[:2] == block_manager.block_table(state, 0)[:2]
    state = block_manager.mark_computed(state, [])
    assert not state.prefix_cache.scheduled and not state.prefix_cache.by_block
    _, num_cached = block_manager.allocate(state, make_group(list(range(8)) + [6, 6], first_seq_id=2))
    assert num_cached == 0  # nothing was marked computed


def test_a_block_shared_in_its_step_is_cached_once_when_its_holders_name_its_prefix_differently():
    """Found by the scheduler's soak test: B holds an uncached copy of a block whose cache entry
    is then evicted; C, admitted in the step B computes its next block, shares both blocks of
    B. Recording the step, B chains that next block through the evicted entry and C through a
    new one: the block keeps its first entry, and the cache stays sound."""
    t0, t1 = (1, 2, 3, 4), (5, 6, 7, 8)
    state = block_manager.initial_state(make_config(num_device_blocks=6, **CACHING))
    a, b = make_group(t0 + (9,)).seqs[0], make_group(t0 + t1 + (9,), first_seq_id=1).seqs[0]
    state = block_manager.allocate(state, make_group(a.token_ids))[0]
    state = block_manager.allocate(state, make_group(b.token_ids, first_seq_id=1))[0]
    state = block_manager.mark_computed(state, [computed(a), dataclasses.replace(b, num_computed_tokens=4)])
    assert state.prefix_cache.by_block.keys() == {0}  # B's copy of t0, block 2, stays uncached
    state = block_manager.free(state, a.seq_id)
    state, _ = block_manager.allocate(state, make_group(range(20, 29), first_seq_id=3))  # takes all, evicting block 0
    state = block_manager.free(state, 3)
    assert not state.prefix_cache.by_block
    state = block_manager.mark_scheduled(state, b, b.len)
    c = make_group(t0 + t1 + (7,), first_seq_id=2)
    state, num_cached = block_manager.allocate(state, c)
    assert num_cached == 8
    assert block_manager.block_table(state, 2)[:2] == block_manager.block_table(state, 1)[:2] == (2, 3)
    state = block_manager.mark_computed(state, [computed(b), computed(c.seqs[0])])
    assert sorted(state.prefix_cache.by_block) == [2, 3]
    _, num_cached = block_manager.allocate(state, make_group(t0 + t1 + (6,), first_seq_id=4))
    assert num_cached in (4, 8)  # block 3 is named through the evicted entry: found or not, never wrong


def test_resetting_the_prefix_cache_frees_its_blocks():
    state, _ = admit_and_compute(block_manager.initial_state(make_config(num_device_blocks=4, **CACHING)), range(9), 0)
    state = block_manager.reset_prefix_cache(block_manager.free(state, 0))
    assert not state.prefix_cache.by_key and sorted(state.device.free) == [0, 1, 2, 3]
    assert block_manager.allocate(state, make_group(range(9), first_seq_id=1))[1] == 0


def test_prefix_cache_matches_whole_prefixes_not_single_blocks():
    state, _ = admit_and_compute(block_manager.initial_state(make_config(**CACHING)), range(10), 0)
    _, num_cached = block_manager.allocate(state, make_group([9, 9, 9, 9, 4, 5, 6, 7, 1], first_seq_id=1))
    assert num_cached == 0


def test_prefix_cache_verifies_tokens_on_a_hash_collision():
    assert hash((None, (-1,) * 4)) == hash((None, (-2,) * 4))  # CPython: hash(-1) == hash(-2)
    state, _ = admit_and_compute(block_manager.initial_state(make_config(**CACHING)), [-1] * 4 + [3], 0)
    _, num_cached = block_manager.allocate(state, make_group([-2] * 4 + [3], first_seq_id=1))
    assert num_cached == 0


def test_unreferenced_cached_blocks_are_free_and_evicted_least_recently_used():
    state = block_manager.initial_state(make_config(num_device_blocks=4, **CACHING))
    state, _ = admit_and_compute(state, [1] * 4 + [0], 0)
    state, _ = admit_and_compute(state, [2] * 4 + [0], 1)
    state = block_manager.free(block_manager.free(state, 0), 1)  # blocks 0 then 2 become evictable
    assert block_manager.num_free_device_blocks(state) == 4
    assert state.prefix_cache.evictable == (0, 2)
    state, _ = block_manager.allocate(state, make_group(range(12), first_seq_id=2))  # 3 blocks: evicts 0
    assert set(block_manager.block_table(state, 2)) == {1, 3, 0}
    assert not prefix_cache.is_cached(state.prefix_cache, 0)
    # Only the cached block 2 is left: a block reserved ahead evicts it, as the next append_slot would.
    assert block_manager.num_free_device_blocks(state) == 1
    assert block_manager.block_table(block_manager.append_blocks(state, {2: 1}), 2)[-1] == 2
    state = block_manager.free(state, 2)
    _, num_cached = block_manager.allocate(state, make_group([2] * 4 + [0], first_seq_id=3))
    assert num_cached == 4
    _, num_cached = block_manager.allocate(state, make_group([1] * 4 + [0], first_seq_id=3))
    assert num_cached == 0


@hypothesis.given(st.lists(st.one_of(st.integers(0, 5), st.lists(st.integers(0, 99), max_size=5)), max_size=30))
def test_free_list_hands_out_blocks_first_in_first_out(operations):
    """The persistent free list behaves as a list taken from the front and extended at the end,
    and an older version is unchanged by what is done to a newer one."""
    free, model = block_pool.FreeList.of(range(3)), [0, 1, 2]
    for operation in operations:
        before, before_model = free, list(model)
        if isinstance(operation, int):
            count = min(operation, len(model))
            free, taken = free.take(count)
            assert taken == tuple(model[:count])
            model = model[count:]
        else:
            free, model = free.extend(operation), model + operation
        assert list(free) == model and len(free) == len(model)
        assert list(before) == before_model
    assert free == block_pool.FreeList.of(model) and hash(free) == hash(block_pool.FreeList.of(model))


def test_blocks_appended_for_several_sequences_come_from_reservations_first():
    """Orca reservations hold a sequence's blocks from admission: appending ahead takes those
    first, then fresh blocks from the pool, all at once."""
    state = block_manager.initial_state(make_config(reservation="orca-max", max_model_len=16))
    state, _ = block_manager.allocate(state, make_group(range(3)))
    state, _ = block_manager.allocate(state, make_group(range(3), first_seq_id=1))
    reserved = state.seqs[0].reserved
    assert block_manager.num_fresh_blocks(state, 0, len(reserved) + 1) == 1
    state = block_manager.append_blocks(state, {0: 2, 1: 1})
    assert block_manager.block_table(state, 0)[1:] == reserved[:2] and state.seqs[0].reserved == reserved[2:]
    for seq_id in (0, 1):
        state = block_manager.free(state, seq_id)
    assert block_manager.num_free_device_blocks(state) == state.config.num_device_blocks



def test_freeing_several_sequences_at_once_is_freeing_them_in_turn():
    """`free_each` gives the state of one `free` after another (the free list, the cache's
    eviction order, the refcounts), a sequence named twice included."""
    state = block_manager.initial_state(make_config(num_device_blocks=16, enable_prefix_caching=True))
    for group in (make_group(range(9), num_seqs=2, first_seq_id=1, request_id="a"),
                  make_group(range(20, 33), first_seq_id=3, request_id="b")):
        state, _ = block_manager.allocate(state, group)
        state = block_manager.mark_computed(state, [computed(seq) for seq in group.seqs])
    one_by_one = state
    for seq_id in (3, 1, 1, 2):
        one_by_one = block_manager.free(one_by_one, seq_id)
    assert block_manager.free_each(state, [3, 1, 1, 2]) == one_by_one
    assert one_by_one.prefix_cache.evictable and block_manager.num_free_device_blocks(one_by_one) == 16
    assert block_manager.free_each(state, []) is state
