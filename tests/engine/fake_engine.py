"""A fake engine for scheduler tests: KV cache, model and sampler, all checking the plans.

`FakeCache` stores, for each written slot, the value a real model would: a function of the
whole token prefix ending there. Every scheduled entry first reads back its context through its
block table and compares it with the sequence's tokens, so a wrong block table, a missing
copy-on-write, a swap applied in the wrong order or a bad prefix-cache hit fails loudly. The
"model" then samples from a hash of what it read, so any corruption also changes the outputs.
"""

from hypothesis import settings

from engine.core import block_manager, scheduler
from engine.core.sequence import SequenceStatus

settings.register_profile("engine", max_examples=150, stateful_step_count=40, deadline=None)
settings.register_profile("engine-soak", max_examples=3000, stateful_step_count=60, deadline=None)

VOCAB = 23
EOS = 0


def make_config(
    *, block_size=4, num_device_blocks=64, num_host_blocks=64, max_num_batched_tokens=64,
    max_num_seqs=8, max_model_len=64, watermark=0.0, prefix_caching=False, reservation="paged",
    preemption_mode=None, policy="fcfs", reserve_next_block=False,
) -> scheduler.SchedulerConfig:
    """A scheduler configuration with small, overridable defaults."""
    return scheduler.SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        preemption_mode=preemption_mode,
        policy=policy,
        reserve_next_block=reserve_next_block,
        block_manager=block_manager.BlockManagerConfig(
            block_size=block_size,
            num_device_blocks=num_device_blocks,
            num_host_blocks=num_host_blocks,
            max_model_len=max_model_len,
            watermark=watermark,
            enable_prefix_caching=prefix_caching,
            reservation=reservation,
        ),
    )


def kv_value(token_ids: tuple[int, ...], position: int) -> int:
    """What a model stores for the token at `position`: it depends on the whole prefix."""
    return hash(token_ids[: position + 1])


class FakeCache:
    """Device and host KV blocks as {(block, offset): value}, applying plans like the cache
    engine does (swap out, swap in, copy) and checking every read."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.device: dict[tuple[int, int], int] = {}
        self.host: dict[tuple[int, int], int] = {}

    def _copy_blocks(self, source: dict, target: dict, pairs) -> None:
        assert len({dst for _, dst in pairs}) == len(pairs), "two copies into one block"
        for src, dst in pairs:
            for offset in range(self.block_size):
                target.pop((dst, offset), None)
                if (src, offset) in source:
                    target[(dst, offset)] = source[(src, offset)]

    def apply(self, out: scheduler.SchedulerOutput) -> None:
        """Block operations in the documented order: swap out, swap in, copy."""
        self._copy_blocks(self.device, self.host, out.blocks_to_swap_out)
        self._copy_blocks(self.host, self.device, out.blocks_to_swap_in)
        self._copy_blocks(self.device, self.device, out.blocks_to_copy)

    def _slot(self, table, position):
        return table[position // self.block_size], position % self.block_size

    def run(self, state: scheduler.SchedulerState, out: scheduler.SchedulerOutput) -> dict:
        """Write every entry's tokens' KV (no slot twice), then, as the model's layers do, check
        each entry's context; return a hash of what each sampling entry attends to (its
        'logits'). An entry may thus read blocks another entry of the step writes. A multi-step
        decode (``num_steps`` > 1) goes on as the engine's loop does, each step writing the
        token :func:`sample` drew from the step before: its value is the tuple of its tokens."""
        seqs = {seq.seq_id: seq for group in state.running for seq in group.seqs}
        written = set()
        for work in out.scheduled:
            tokens = seqs[work.seq_ids[0]].token_ids
            for position in range(work.start, work.write_end):
                slot = self._slot(work.block_table, position)
                assert slot not in written, f"slot {slot} written twice in one step"
                written.add(slot)
            for position in range(work.start, work.context_len):
                self.device[self._slot(work.block_table, position)] = kv_value(tokens, position)
        for work in out.scheduled:
            tokens = seqs[work.seq_ids[0]].token_ids
            for seq_id in work.seq_ids:
                assert seqs[seq_id].token_ids[: work.context_len] == tokens[: work.context_len]
            assert work.token_ids == tokens[work.start : work.context_len]
            self._check_context(work, tokens, work.start)
        return {work: self._decode_steps(work, seqs[work.seq_ids[0]].token_ids) if work.num_steps > 1
                else self._logits(work, work.context_len) for work in out.scheduled if work.do_sample}

    def _check_context(self, work: scheduler.ScheduledGroupWork, tokens: tuple, end: int) -> None:
        for position in range(end):
            stored = self.device.get(self._slot(work.block_table, position))
            assert stored == kv_value(tokens, position), f"bad KV at {position} for {work}"

    def _decode_steps(self, work: scheduler.ScheduledGroupWork, tokens: tuple) -> tuple[int, ...]:
        """The tokens a multi-step decode samples; the first step's KV is written already."""
        sampled = ()
        for step in range(work.num_steps):
            if step:
                position = work.context_len + step - 1
                self.device[self._slot(work.block_table, position)] = kv_value(tokens + sampled, position)
                self._check_context(work, tokens + sampled, position)
            sampled += (sample(self._logits(work, work.context_len + step), 0),)
        return sampled

    def _logits(self, work: scheduler.ScheduledGroupWork, context_len: int) -> int:
        return hash(tuple(self.device[self._slot(work.block_table, p)] for p in range(context_len)))


def sample(logits: int, index: int) -> int:
    """The k-th sample drawn from one logits row: deterministic in the context alone."""
    return hash((logits, index)) % VOCAB


def model_actions(state: scheduler.SchedulerState, logits: dict) -> list:
    """Append the sampled token; stop on EOS. Requests named 'beam*' also fork the smallest
    candidate and drop the largest once their sequences have two tokens (content-determined,
    so runs with different pools and timing make the same decisions)."""
    actions, candidates = [], {}
    for work, row in logits.items():
        if work.num_steps > 1:
            actions += _keep_until_eos(work.seq_ids[0], row)
            continue
        for index, seq_id in enumerate(work.seq_ids):
            candidates.setdefault(work.request_id, []).append((seq_id, sample(row, index), row))
    for request_id, group_candidates in candidates.items():
        seqs = {seq.seq_id: seq for seq in scheduler.find_group(state, request_id).seqs}
        ranked = sorted(group_candidates, key=lambda c: (seqs[c[0]].token_ids, c[1]))
        beam_step = request_id.startswith("beam") and len(ranked) > 1 and len(
            seqs[ranked[0][0]].output_token_ids
        ) == 2
        for seq_id, token, row in ranked:
            if beam_step and (seq_id, token, row) == ranked[-1]:
                actions.append(scheduler.Drop(seq_id))
                continue
            if beam_step and (seq_id, token, row) == ranked[0]:
                actions.append(scheduler.Fork(seq_id, None, sample(row, 99)))
            actions.append(scheduler.Append(seq_id, token))
            if token == EOS:
                actions.append(scheduler.Finish(seq_id, SequenceStatus.FINISHED_STOPPED))
    return actions


def _keep_until_eos(seq_id: int, tokens: tuple[int, ...]) -> list:
    """A multi-step decode's tokens up to the first EOS, which stops the sequence."""
    if EOS not in tokens:
        return [scheduler.AppendMany(seq_id, tokens)]
    return [scheduler.AppendMany(seq_id, tokens[: tokens.index(EOS) + 1]),
            scheduler.Finish(seq_id, SequenceStatus.FINISHED_STOPPED)]


def append_ones(out: scheduler.SchedulerOutput) -> list:
    """An Append of token 1 for every sequence `out` samples."""
    return [scheduler.Append(seq_id, 1) for w in out.scheduled if w.do_sample for seq_id in w.seq_ids]


def outputs_of(group) -> tuple:
    """A request's result, independent of seq ids: its sequences' outputs and statuses, sorted."""
    return tuple(sorted((seq.output_token_ids, seq.status.name) for seq in group.seqs))


def serve(config, requests, max_steps=500, num_steps=1):
    """Run `requests` (arrival_step, request_id, prompt, num_seqs, max_tokens) to completion,
    with multi-step decodes of `num_steps` when the scheduler can."""
    state, results = scheduler.initial_state(config), {}
    cache = FakeCache(config.block_manager.block_size)
    for step in range(max_steps):
        for arrival, request_id, prompt, num_seqs, max_tokens in requests:
            if arrival == step:
                state = scheduler.add_request(
                    state, request_id, prompt, max_tokens=max_tokens, num_seqs=num_seqs,
                    expected_output_len=max_tokens, may_fork=request_id.startswith("beam") and num_seqs > 1,
                )
        state, out = scheduler.schedule(state, num_steps=num_steps)
        cache.apply(out)
        state = scheduler.update(state, model_actions(state, cache.run(state, out)))
        results.update((group.request_id, outputs_of(group)) for group in state.finished)
        if len(results) == len(requests) and step >= max((r[0] for r in requests), default=0):
            return results, state
    raise AssertionError("requests did not finish")
