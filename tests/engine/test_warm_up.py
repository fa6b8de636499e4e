"""Start-up: after the warm-up, serving compiles nothing (every step's shapes were bucketed and
compiled, and the greedy sampler for each of them; sampling with a temperature once the server
has been idle a few seconds)."""

from __future__ import annotations

import time

from engine import BeamSearchParams, SamplingParams
from engine.entrypoints.async_engine import AsyncLLMEngine
from engine.worker import sampler, stages
from tests.engine.tiny import prompts, tiny_llm


def test_no_step_compiles_after_warm_up(tmp_path, monkeypatch):
    llm, config = tiny_llm("llama_gqa_tied", tmp_path, warmup=True, max_num_batched_tokens=64)
    compiled = []
    original = stages._compile
    monkeypatch.setattr(stages, "_compile", lambda key, lowered: compiled.append(key[0]) or original(key, lowered))
    vocab = config.vocab_size
    samplers = sampler.sample._cache_size()
    # Prompts of 1-60 tokens, several per step and chunked (64 tokens a step): every mix of
    # prefill tokens and logits rows; then decodes of 1-16 sequences, greedy, which the
    # sampler's warm-up covers too.
    llm.generate(prompts(16, vocab), SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert sampler.sample._cache_size() == samplers
    # Sampling with a temperature, parallel sampling and beams.
    llm.generate(prompts(3, vocab, seed=2), SamplingParams(n=3, best_of=4, temperature=1.0, max_tokens=5, seed=0),
                 use_tqdm=False)
    llm.beam_search(prompts(2, vocab, seed=3), BeamSearchParams(beam_width=3, max_tokens=4))
    assert compiled == []


def test_one_sequence_at_a_time_warms_up_and_matches_a_batch(tmp_path):
    # max_num_seqs 1 with a context (128) shorter than the token budget (256): the warm-up
    # used to build a 256-token prefill of two sequences, which one row cannot hold.
    llm, config = tiny_llm("llama_gqa_tied", tmp_path, warmup=True, max_num_seqs=1)
    batch = prompts(3, config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=5)
    alone = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    together, _ = tiny_llm("llama_gqa_tied", tmp_path)
    assert alone == [o.outputs[0].token_ids for o in together.generate(batch, params, use_tqdm=False)]
    stats = llm.cache_stats()
    assert stats.device_blocks_free == stats.device_blocks_total


def test_an_idle_server_compiles_sampling_with_a_temperature(tmp_path):
    llm, config = tiny_llm("llama_gqa_tied", tmp_path, warmup=True, max_num_batched_tokens=64)
    assert llm.engine.warm_ups_left > 0
    server_loop = AsyncLLMEngine(llm.engine)
    try:
        deadline = time.monotonic() + 120
        while llm.engine.warm_ups_left and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        server_loop.shutdown()
    assert llm.engine.warm_ups_left == 0
    samplers = sampler.sample._cache_size()
    # Batches of 1-16 rows, seeded or not, at vLLM's and OpenAI's default temperature of 1;
    # then requests with n > 1 (whose rows share a logits row at first), greedy or not.
    vocab = config.vocab_size
    llm.generate(prompts(16, vocab, seed=4), [SamplingParams(max_tokens=6, seed=i % 2 or None) for i in range(16)],
                 use_tqdm=False)
    for temperature in (1.0, 0.0):
        for num_prompts, n in ((3, 2), (1, 4)):
            params = SamplingParams(n=n, temperature=temperature, max_tokens=3)
            llm.generate(prompts(num_prompts, vocab, seed=5), params, use_tqdm=False)
    assert sampler.sample._cache_size() == samplers


def test_prompt_logprobs_compile_no_sampler_program_with_bfloat16_weights(tmp_path):
    """Their logits rows are a whole token bucket, which the sampler's warm-up does not cover;
    the sampled rows are padded to a size it does (two rows at least, with 16-bit weights)."""
    llm, _ = tiny_llm("llama_gqa_tied", tmp_path, warmup=True, max_num_batched_tokens=64, max_num_seqs=4,
                      dtype="bfloat16")
    samplers = sampler.sample._cache_size()
    llm.generate([list(range(3, 43))], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1), use_tqdm=False)
    assert sampler.sample._cache_size() == samplers


def test_a_long_prefill_runs_three_quarters_of_a_power_of_two(tmp_path, monkeypatch):
    """1100 prompt tokens in one step run as 1536 rows, not 2048, and give the tokens the
    same prompts give one at a time."""
    llm, config = tiny_llm("llama_gqa_tied", tmp_path, num_blocks=512, max_num_batched_tokens=2048)
    batch = [list(range(3 + i, 113 + i)) for i in range(10)]
    params = SamplingParams(temperature=0, max_tokens=3)
    rows = []
    run = llm.engine.runner.run
    monkeypatch.setattr(llm.engine.runner, "run", lambda inputs, caches: rows.append(len(inputs.input_ids))
                        or run(inputs, caches))
    together = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    assert rows[0] == 1536
    alone = [llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids for prompt in batch]
    assert together == alone


def test_small_decode_steps_run_as_one_program_with_the_same_tokens(tmp_path, monkeypatch):
    llm, config = tiny_llm("llama_gqa_tied", tmp_path)
    runner = llm.engine.runner
    assert runner.one_program_buckets == (1, 2, 4, 8, 16)  # every decode bucket up to 32 rows
    called = []
    call = stages.call
    monkeypatch.setattr(stages, "call",
                        lambda stage, *args, **kwargs: called.append(stage) or call(stage, *args, **kwargs))
    batch, params = prompts(3, config.vocab_size), SamplingParams(temperature=0, max_tokens=6)
    whole = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    assert called.count("embed") == 1  # the prefill by stages; the 5 decode steps as one program
    assert list(runner._whole_model) == [4]  # of 4 rows, for 3 sequences
    runner.one_program_buckets = ()
    assert [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)] == whole


def test_every_decode_step_is_one_program_on_accelerators(tmp_path, monkeypatch):
    """On a CPU, compiling a whole-model program per bucket would cost the start-up seconds;
    on a GPU or TPU a program per stage would cost a dispatch per layer at every step."""
    import jax

    from engine.worker.model_runner import ModelRunner

    llm, _ = tiny_llm("llama_gqa_tied", tmp_path)
    runner = llm.engine.runner
    settings = dict(block_size=8, max_model_len=128, max_num_seqs=256, max_num_batched_tokens=512)
    on_cpu = ModelRunner(runner.config, runner.params, **settings)
    assert max(on_cpu.one_program_buckets) == 32 < max(on_cpu.decode_buckets)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    on_gpu = ModelRunner(runner.config, runner.params, **settings)
    assert on_gpu.one_program_buckets == on_gpu.decode_buckets == (1, 2, 4, 8, 16, 32, 64, 128, 256)
