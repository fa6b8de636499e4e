"""Requests as a user sees them: prefix caching, refusals, aborts, stop rules, prompt log-probs."""

from __future__ import annotations

import dataclasses

import pytest

from engine import RequestOutputKind, SamplingParams
from engine.core.scheduler import InvalidRequestError
from tests.engine.tiny import prompts, tiny_llm
from tests.hf_torch import load_hf_model, next_token_logprobs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="module")
def llm_and_config(checkpoint):
    """(our LLM, HF's config) of a tiny checkpoint."""
    return tiny_llm("llama_gqa_tied", checkpoint)


@pytest.fixture(autouse=True)
def no_block_leaks(llm_and_config):
    yield
    stats = llm_and_config[0].cache_stats()
    assert stats.device_blocks_free == stats.device_blocks_total
    assert stats.host_blocks_free == stats.host_blocks_total


def test_prefix_caching_prefills_only_the_suffix(llm_and_config, tmp_path):
    cached, _ = tiny_llm("llama_gqa_tied", tmp_path, enable_prefix_caching=True)
    prefix = list(range(3, 99))  # 96 tokens: 12 full blocks of 8
    first, second = prefix + [60, 61, 62], prefix + [70, 71]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    cached.generate([first], greedy, use_tqdm=False)
    before = cached.engine.counters.prompt_tokens
    with_cache = cached.generate([second], greedy, use_tqdm=False)[0]
    assert cached.engine.counters.prompt_tokens - before == len(second) - len(prefix)
    assert cached.cache_stats().prefix_cache_hits >= len(prefix) // 8
    without_cache = llm_and_config[0].generate([second], greedy, use_tqdm=False)[0]
    assert with_cache.outputs[0].token_ids == without_cache.outputs[0].token_ids
    assert cached.reset_prefix_cache()
    before = cached.engine.counters.prompt_tokens
    cached.generate([second], greedy, use_tqdm=False)
    assert cached.engine.counters.prompt_tokens - before == len(second)


def test_too_long_prompt_fails_alone_with_the_limit_in_the_message(llm_and_config):
    llm, config = llm_and_config
    ok = prompts(2, config.vocab_size, seed=9)
    outputs = llm.generate([ok[0], list(range(3, 3 + 200)), ok[1]], SamplingParams(max_tokens=5), use_tqdm=False)
    error = outputs[1].error
    assert error is not None and "200 tokens" in error and "max_model_len is 128" in error
    assert outputs[1].finished and not outputs[1].outputs
    assert all(len(o.outputs[0].token_ids) == 5 for o in (outputs[0], outputs[2]))


def test_bad_token_ids_are_refused(llm_and_config):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm_and_config[0].engine.add_request("bad", [5, 10**6], SamplingParams())


def test_abort_frees_every_block_and_others_finish(llm_and_config):
    llm, config = llm_and_config
    engine = llm.engine
    a, b = prompts(2, config.vocab_size, seed=10)
    engine.add_request("keep", a, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("drop", b, SamplingParams(n=3, max_tokens=20, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.stats().blocks.device_blocks_used > 0
    engine.abort_request("drop")
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["keep"]
    assert len(finished[0].outputs[0].token_ids) == 20


def test_stop_token_ids_min_tokens_and_logprobs(llm_and_config):
    llm, config = llm_and_config
    prompt = prompts(1, config.vocab_size, seed=11)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    tokens = list(free[0].outputs[0].token_ids)
    stop_at = tokens[4]
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at],
                                                    logprobs=3, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert list(stopped.token_ids) == tokens[: tokens.index(stop_at) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at
    assert len(stopped.logprobs) == len(stopped.token_ids)
    assert all(len(step) >= 3 and token in step for step, token in zip(stopped.logprobs, stopped.token_ids))
    banned = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at],
                                                   min_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert stop_at not in banned.token_ids[:8]


@pytest.mark.parametrize("how", ["one_step", "chunked_prefill", "prefix_cached"])
def test_prompt_logprobs_match_a_full_forward(llm_and_config, checkpoint, tmp_path, how):
    llm, config = llm_and_config
    hf = load_hf_model(checkpoint)
    prompt = prompts(4, config.vocab_size, seed=12)[-1][:20]
    assert len(prompt) == 20
    if how == "chunked_prefill":  # the 20-token prompt is prefilled 6 tokens at a time
        llm, _ = tiny_llm("llama_gqa_tied", tmp_path, max_num_seqs=4, max_num_batched_tokens=6)
    if how == "prefix_cached":  # its first two blocks are in the prefix cache
        llm, _ = tiny_llm("llama_gqa_tied", tmp_path, enable_prefix_caching=True)
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    logprobs = next_token_logprobs(hf, prompt)
    for position in range(1, len(prompt)):
        got = out.prompt_logprobs[position][prompt[position]]
        assert abs(got - logprobs[position - 1, prompt[position]]) < 1e-4


def test_prompt_logprobs_of_a_batch_are_each_prompts_own(llm_and_config, tmp_path):
    """Prompts that ask for 0, 1 or 5 prompt log-probabilities (or none), scored together in
    one step, in chunks over several steps, or alone: each its own entries, the same tokens
    and ranks (the values to float32's last bits: a prefill of other prompts beside it is
    another product)."""
    llm, config = llm_and_config
    chunked, _ = tiny_llm("llama_gqa_tied", tmp_path, max_num_seqs=8, max_num_batched_tokens=24)
    batch = prompts(6, config.vocab_size, seed=13)
    counts = [0, 1, 5, None, 2, 1]
    params = [SamplingParams(max_tokens=1, prompt_logprobs=count) for count in counts]
    together = llm.generate(batch, params, use_tqdm=False)
    in_chunks = chunked.generate(batch, params, use_tqdm=False)
    for prompt, each, count, *outputs in zip(batch, params, counts, together, in_chunks):
        alone = llm.generate([prompt], each, use_tqdm=False)[0].prompt_logprobs
        if count is None:
            assert alone is None and all(output.prompt_logprobs is None for output in outputs)
            continue
        assert len(alone) == len(prompt) and alone[0] is None
        for position, entry in enumerate(alone[1:], start=1):
            assert prompt[position] in entry
            ranks = sorted(v.rank for t, v in entry.items() if t != prompt[position] or v.rank <= count)
            assert ranks == list(range(1, count + 1))
            for output in outputs:
                other = output.prompt_logprobs[position]
                assert {t: v.rank for t, v in other.items()} == {t: v.rank for t, v in entry.items()}
                assert all(abs(other[t] - v) < 1e-5 for t, v in entry.items())


def _fail_on_call(target, name: str, call: int, *, after: bool = False):
    """Replace ``target.name`` with a wrapper whose ``call``-th call raises (before running the
    original, or after it when ``after``: the original consumed its donated inputs)."""
    original, calls = getattr(target, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == call and not after:
            raise RuntimeError("injected failure")
        result = original(*args, **kwargs)
        if len(calls) == call:
            raise RuntimeError("injected failure")
        return result

    return failing


@pytest.mark.parametrize("after", [False, True], ids=["before the model", "caches consumed"])
def test_a_failed_step_frees_its_requests_and_the_engine_keeps_serving(llm_and_config, monkeypatch, after):
    llm, config = llm_and_config
    batch = prompts(3, config.vocab_size, seed=30)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    expected = [o.outputs[0].token_ids for o in llm.generate(batch, greedy, use_tqdm=False)]
    runner = llm.engine.runner
    monkeypatch.setattr(runner, "run", _fail_on_call(runner, "run", call=3, after=after))
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate(batch, greedy, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests()
    assert [o.outputs[0].token_ids for o in llm.generate(batch, greedy, use_tqdm=False)] == expected


def test_a_bad_prompt_in_a_list_leaves_nothing_queued(llm_and_config):
    llm, config = llm_and_config
    prompt = prompts(1, config.vocab_size, seed=31)[0]
    with pytest.raises(TypeError):
        llm.generate([prompt, None], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)) == 1


def test_the_context_is_what_the_cache_holds_and_a_group_that_outgrows_it_says_so(tmp_path, caplog):
    small, config = tiny_llm("llama_gqa_tied", tmp_path, num_blocks=4)  # 32 KV slots; max_model_len 128 asked
    assert small.engine.max_model_len == 32 and "max_model_len is lowered to that" in caplog.text
    prompt = prompts(2, config.vocab_size, seed=32)[1][:10]
    alone = small.generate([prompt], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False)
    assert alone[0].error is None and alone[0].outputs[0].finish_reason == "length"
    assert len(alone[0].outputs[0].token_ids) == 32 - len(prompt)  # to the context, as at any max_model_len
    # Three samples of 30 tokens need more than the 32 slots: stopped part-way, with the reason.
    group = small.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=20, ignore_eos=True),
                           use_tqdm=False)[0]
    assert "KV blocks" in group.error and "stopped before its end" in caplog.text
    assert all(c.finish_reason == "length" and 0 < len(c.token_ids) < 20 for c in group.outputs)
    stats = small.cache_stats()
    assert stats.device_blocks_free == stats.device_blocks_total


def test_prompts_as_vllm_dicts_or_numpy_token_ids(llm_and_config):
    import numpy as np

    llm, config = llm_and_config
    ids = prompts(1, config.vocab_size, seed=33)[0]
    greedy = SamplingParams(temperature=0, max_tokens=4)
    expected = llm.generate([ids], greedy, use_tqdm=False)[0].outputs[0].token_ids
    for form in ({"prompt_token_ids": ids}, [{"prompt_token_ids": ids}], np.array(ids), [np.array(ids)],
                 [np.int64(t) for t in ids]):
        (out,) = llm.generate(form, greedy, use_tqdm=False)
        assert out.outputs[0].token_ids == expected and out.prompt_token_ids == tuple(ids)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"tokens": ids}, greedy, use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm_and_config):
    """vLLM's left truncation: a prompt longer than max_model_len (128 here) runs on its last
    k tokens, exactly as if only those had been sent."""
    llm, config = llm_and_config
    long_prompt = prompts(2, config.vocab_size, seed=15)[1] * 4  # 240 tokens
    kept = long_prompt[-50:]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    truncated = llm.generate([long_prompt], SamplingParams(temperature=0, max_tokens=6, truncate_prompt_tokens=50),
                             use_tqdm=False)[0]
    assert truncated.error is None and list(truncated.prompt_token_ids) == kept
    assert truncated.outputs[0].token_ids == llm.generate([kept], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert "max_model_len" in llm.generate([long_prompt], greedy, use_tqdm=False)[0].error
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be None or an integer >= 1"):
        SamplingParams(truncate_prompt_tokens=0)


@pytest.mark.parametrize("reservation", ["orca-oracle", "orca-pow2"])
def test_oracle_reservations_need_the_engine_api(reservation, tmp_path):
    llm, _ = tiny_llm("llama_gqa_tied", tmp_path, reservation=reservation)
    with pytest.raises(ValueError, match="expected_output_len=n"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), expected_output_len=4)
    while llm.engine.has_unfinished_requests():
        outputs = llm.engine.step()
    assert len(outputs[0].outputs[0].token_ids) == 4


def test_more_samples_than_max_num_seqs_name_the_field(tmp_path):
    llm, _ = tiny_llm("llama_gqa_tied", tmp_path, max_num_seqs=2)
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(n=2, best_of=3, temperature=1.0, max_tokens=4), use_tqdm=False)
    assert "best_of=3 needs 3 sequences at once, more than max_num_seqs=2" in out.error
    assert not llm.engine.has_unfinished_requests()


def test_final_only_requests_return_just_their_final_output(llm_and_config):
    """``output_kind=FINAL_ONLY`` (what ``LLM.generate`` uses): no output while running, and the
    final one equal to a cumulative request's."""
    llm, config = llm_and_config
    prompt = prompts(1, config.vocab_size, seed=4)[0]
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    final_only = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
    engine, seen = llm.engine, {"cumulative": [], "final": []}
    engine.add_request("cumulative", prompt, params)
    engine.add_request("final", prompt, final_only)
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(output)
    assert len(seen["cumulative"]) == 7 and [o.finished for o in seen["final"]] == [True]
    final = seen["final"][0].outputs[0].token_ids
    assert final == seen["cumulative"][-1].outputs[0].token_ids
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == final


def test_an_output_kind_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="delta")
