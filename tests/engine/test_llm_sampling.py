"""Sampling as a user sees it: reproducible seeds, truncation, the distribution itself, penalties."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import scipy.special
import scipy.stats

from engine import BeamSearchParams, Logprob, SamplingParams
from engine.config import EngineConfig
from engine.request_state import RequestState
from engine.seq_progress import SeqProgress
from engine.worker import sampling_rows
from tests.engine.tiny import prompts, tiny_llm
from tests.hf_torch import load_hf_model, next_token_logprobs, require_torch


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="module")
def llm_and_config(checkpoint):
    """(our LLM, HF's config) of a tiny checkpoint."""
    return tiny_llm("llama_gqa_tied", checkpoint, max_num_seqs=64, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def hf(llm_and_config, checkpoint):
    """HF's torch model of the checkpoint ``llm_and_config`` wrote (needs torch)."""
    return load_hf_model(checkpoint)


def test_parallel_samples_differ_share_blocks_and_reproduce(llm_and_config):
    llm, config = llm_and_config
    # Many full blocks: each sample also holds its last block and, with async scheduling, at
    # times one reserved a step early (``SchedulerConfig.reserve_next_block``).
    prompt = prompts(1, config.vocab_size, seed=3)[0] + list(range(3, 80))
    params = SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=1234)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    samples = [c.token_ids for c in first.outputs]
    assert len(set(samples)) > 1, "n=4 samples should differ"
    assert samples == [c.token_ids for c in again.outputs], "the same seed must reproduce the samples"

    engine = llm.engine
    used = {}
    for n in (1, 4):
        engine.add_request(f"share-{n}", prompt, SamplingParams(n=n, temperature=1.0, max_tokens=10, seed=1,
                                                                ignore_eos=True))
        for _ in range(3):
            engine.step()
        used[n] = engine.stats().blocks.device_blocks_used
        while engine.has_unfinished_requests():
            engine.step()
    assert used[4] < 2 * used[1], f"4 samples used {used[4]} blocks, one used {used[1]}: the prompt is not shared"


def test_seeded_request_is_independent_of_its_batch(llm_and_config):
    llm, config = llm_and_config
    batch = prompts(6, config.vocab_size, seed=4)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=7)
    alone = llm.generate([batch[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=8)] * 5
    together = llm.generate(batch, [seeded] + others, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == together


def test_any_seed_top_k_or_stop_token_id_is_served(llm_and_config):
    """Values vLLM accepts that do not fit the sampler's arrays: 64-bit and negative seeds, a
    top_k above the vocabulary (keeps everything), stop token ids past it (never sampled)."""
    llm, config = llm_and_config
    vocab = config.vocab_size
    prompt = prompts(1, vocab, seed=8)[0]
    for seed in (-1, 2**40 + 3):
        params = SamplingParams(temperature=1.0, max_tokens=6, seed=seed)
        first, again = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
        assert first.error is None and first.outputs[0].token_ids == again.outputs[0].token_ids
    unbounded = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=6, seed=5, top_k=vocab + 44),
                             use_tqdm=False)[0]
    plain = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=6, seed=5), use_tqdm=False)[0]
    assert unbounded.outputs[0].token_ids == plain.outputs[0].token_ids
    far = SamplingParams(temperature=0, max_tokens=6, min_tokens=3, stop_token_ids=[2**40], ignore_eos=True)
    assert len(llm.generate([prompt], far, use_tqdm=False)[0].outputs[0].token_ids) == 6
    assert llm.cache_stats().device_blocks_free == llm.cache_stats().device_blocks_total


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=1, max_tokens=12),
                                    SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=12)],
                         ids=["top_k=1", "tiny top_p"])
def test_truncation_to_one_token_is_greedy(llm_and_config, params):
    llm, config = llm_and_config
    batch = prompts(4, config.vocab_size, seed=5)
    greedy = llm.generate(batch, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    truncated = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in truncated] == [o.outputs[0].token_ids for o in greedy]


def test_sample_frequencies_follow_the_softmax(llm_and_config, hf):
    """2048 one-token samples at temperature 0.7 against the model's own distribution (chi-square)."""
    llm, config = llm_and_config
    prompt = prompts(1, config.vocab_size, seed=6)[0]
    probs = scipy.special.softmax(next_token_logprobs(hf, prompt)[-1] / 0.7)
    params = [SamplingParams(n=64, temperature=0.7, max_tokens=1, seed=s) for s in range(32)]
    outputs = llm.generate([prompt] * 32, params, use_tqdm=False)
    tokens = [c.token_ids[0] for o in outputs for c in o.outputs]
    counts = np.bincount(tokens, minlength=len(probs)).astype(float)
    expected = probs * len(tokens)
    common = expected >= 5
    observed = np.append(counts[common], counts[~common].sum())
    wanted = np.append(expected[common], expected[~common].sum())
    assert scipy.stats.chisquare(observed, wanted).pvalue > 1e-3


@pytest.mark.parametrize("field,value,match", [
    ("temperature", -1.0, "temperature must be a number >= 0"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("n", 0, "n must be an integer >= 1"),
    ("max_tokens", 0, "max_tokens must be an integer >= 1"),
    ("logprobs", -1, "logprobs must be None or an integer >= 0"),
    ("prompt_logprobs", True, "prompt_logprobs must be None or an integer >= 0"),
    ("n", True, "n must be an integer >= 1, got True"),
    ("stop", 5, "stop must be a string or a list of non-empty strings, got 5"),
    ("stop_token_ids", 5, "stop_token_ids must be a list of non-negative token ids, got 5"),
    ("bad_words", 5, "bad_words must be a list of words"),
    ("top_p", "a", r"top_p must be in \(0, 1\], got 'a'"),
    ("temperature", None, "temperature must be a number >= 0, got None"),
    ("logit_bias", {-1: 1.0}, r"logit_bias must be a mapping from non-negative token ids to numbers in \[-1e\+09"),
    ("logit_bias", {3: float("nan")}, "logit_bias must be a mapping"),
    ("logit_bias", {3: 1e39}, r"logit_bias must be .*, got \(3, 1e\+39\)"),
    ("logit_bias", 5, "logit_bias must be a mapping"),
    ("allowed_token_ids", [], "allowed_token_ids must be None or a non-empty list"),
    ("allowed_token_ids", [3, -1], "allowed_token_ids must be None or a non-empty list"),
    ("allowed_token_ids", 5, "allowed_token_ids must be None or a non-empty list"),
])
def test_invalid_sampling_params_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field,value,match", [
    ("max_num_seqs", 2.5, "max_num_seqs must be an integer >= 1, got 2.5"),
    ("num_blocks", 2.5, "num_blocks must be None or an integer >= 1"),
    ("block_size", 16.0, "block_size must be a power of two up to 256, got 16.0"),
    ("swap_space", "4", "swap_space must be a number of GiB >= 0, got '4'"),
    ("seed", 1.5, "seed must be an integer or None, got 1.5"),
    ("max_num_batched_tokens", 0, "max_num_batched_tokens must be None or an integer >= 1, got 0"),
])
def test_invalid_engine_settings_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**{field: value})


def test_beam_search_params_name_a_bad_field():
    with pytest.raises(ValueError, match="length_penalty must be a finite number, got 'x'"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty="x")


def test_best_of_returns_the_n_most_likely_candidates(llm_and_config):
    llm, config = llm_and_config
    prompt = prompts(1, config.vocab_size, seed=13)[0]
    candidates = llm.generate([prompt], SamplingParams(n=5, temperature=1.0, max_tokens=6, seed=21, logprobs=0),
                              use_tqdm=False)[0].outputs
    best = llm.generate([prompt], SamplingParams(n=2, best_of=5, temperature=1.0, max_tokens=6, seed=21),
                        use_tqdm=False)[0].outputs
    ranked = sorted(candidates, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked]
    assert [c.index for c in best] == [0, 1]


def test_logit_bias_matches_hugging_face_sequence_bias(llm_and_config, hf):
    """Greedy with biases that change the output (each prompt's own first token banned, two
    tokens pushed up) gives HF ``generate``'s tokens under the same ``sequence_bias``."""
    torch = require_torch()
    llm, _ = llm_and_config
    batch = prompts(6, hf.config.vocab_size, seed=11)
    plain = llm.generate(batch, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for prompt, output in zip(batch, plain):
        first = output.outputs[0].token_ids[0]
        bias = {first: -100.0, 17: 2.5, 40: 1.5}
        ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logit_bias=bias),
                            use_tqdm=False)[0].outputs[0].token_ids
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                 sequence_bias={(t,): b for t, b in bias.items()},
                                 pad_token_id=hf.config.eos_token_id)[0, len(prompt):].tolist()
        assert list(ours) == theirs[: len(ours)] and ours[0] != first


def test_logit_bias_bans_and_forces_tokens_only_in_its_own_request(llm_and_config):
    """At temperature 1: tokens biased by -100 never come up, a token biased by +100 always
    does, and a seeded request batched with biased ones samples what it samples alone."""
    llm, config = llm_and_config
    prompt = prompts(1, config.vocab_size, seed=12)[0]
    unbiased = SamplingParams(n=8, temperature=1.0, max_tokens=6, seed=4)
    alone = llm.generate([prompt], unbiased, use_tqdm=False)[0]
    common = sorted({t for c in alone.outputs for t in c.token_ids})
    banned = SamplingParams(n=8, temperature=1.0, max_tokens=6, seed=4, logit_bias={t: -100 for t in common})
    forced = SamplingParams(temperature=1.0, max_tokens=6, seed=4, logit_bias={99: 100}, logprobs=0)
    outputs = llm.generate([prompt] * 3, [banned, unbiased, forced], use_tqdm=False)
    assert not {t for c in outputs[0].outputs for t in c.token_ids} & set(common)
    assert [c.token_ids for c in outputs[1].outputs] == [c.token_ids for c in alone.outputs]
    forced_output = outputs[2].outputs[0]
    assert list(forced_output.token_ids) == [99] * 6
    # Reported log-probabilities are the model's own, as in vLLM: the bias is not in them.
    assert all(step[99] < -1.0 for step in forced_output.logprobs)


def test_logit_bias_on_an_unknown_token_is_refused_and_holds_nothing(llm_and_config):
    llm, config = llm_and_config
    vocab = config.vocab_size
    (output,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, logit_bias={vocab: 5.0}), use_tqdm=False)
    assert "logit_bias token ids" in output.error and f"[0, {vocab})" in output.error
    stats = llm.cache_stats()
    assert stats.device_blocks_free == stats.device_blocks_total


def test_numpy_integers_are_integers_and_clone_copies():
    params = SamplingParams(n=np.int64(2), seed=np.int64(7), max_tokens=np.int32(5), top_k=np.int16(3))
    assert (params.n, params.seed, params.max_tokens, params.top_k) == (2, 7, 5, 3)
    assert all(type(v) is int for v in (params.n, params.num_candidates, params.seed, params.max_tokens,
                                        params.top_k))
    assert params.clone() == params and params.clone() is not params
    # best_of stays unset, so replacing n with dataclasses.replace moves the candidates with it
    assert dataclasses.replace(SamplingParams(), n=3).num_candidates == 3
    assert dataclasses.replace(SamplingParams(n=4, temperature=0.8), n=1).num_candidates == 1


def _sampled_with_logprobs(llm, vocab_size: int):
    """(prompt, output) of 4 seeded samples reporting 3 log-probabilities a token, 2 a prompt token."""
    prompt = prompts(1, vocab_size, seed=13)[0]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=3, seed=2, logprobs=3, prompt_logprobs=2)
    return prompt, llm.generate([prompt], params, use_tqdm=False)[0]


def test_logprobs_carry_vllm_rank_and_logprob_fields(llm_and_config):
    """Each reported log-probability is a float that also answers vLLM's ``Logprob`` fields:
    the top alternatives rank 1, 2, 3 in order. They survive pickling (multiprocessing, caches)."""
    llm, config = llm_and_config
    _, output = _sampled_with_logprobs(llm, config.vocab_size)
    for completion in output.outputs:
        for token, step in zip(completion.token_ids, completion.logprobs):
            assert all(isinstance(v, Logprob) and v.logprob == float(v) for v in step.values())
            alternatives = sorted((v for t, v in step.items() if t != token or v.rank <= 3), key=lambda v: v.rank)
            assert [v.rank for v in alternatives] == [1, 2, 3] and alternatives == sorted(alternatives, reverse=True)
    assert pickle.loads(pickle.dumps(output)).outputs[0].logprobs == output.outputs[0].logprobs
    again = pickle.loads(pickle.dumps(output.outputs[0].logprobs[0]))
    assert [v.rank for v in again.values()] == [v.rank for v in output.outputs[0].logprobs[0].values()]


def test_a_tokens_rank_is_its_place_in_hugging_faces_distribution(llm_and_config, hf):
    """The rank reported for a sampled token, or a prompt token, is its place in HF's
    distribution for the same prompt."""
    llm, config = llm_and_config
    prompt, output = _sampled_with_logprobs(llm, config.vocab_size)
    reference = next_token_logprobs(hf, prompt)

    def place(scores, token):  # 1 + how many tokens HF ranks above it (our float32 may differ by one)
        return 1 + int((scores > scores[token]).sum())

    for completion in output.outputs:
        first = completion.token_ids[0]
        assert abs(completion.logprobs[0][first].rank - place(reference[-1], first)) <= 1
    for position, step in enumerate(output.prompt_logprobs[1:], start=1):
        actual = prompt[position]
        assert abs(step[actual].rank - place(reference[position - 1], actual)) <= 1


def test_cumulative_logprob_is_reported_when_logprobs_are_tracked(llm_and_config):
    """Samples without logprobs report no cumulative log-probability (as vLLM's V1 engine),
    and their batches skip the normaliser; asking for logprobs, or for the best of several
    samples, reports the sum of the chosen tokens' log-probabilities. Mixing them in one batch
    changes no token."""
    llm, config = llm_and_config
    batch = prompts(3, config.vocab_size, seed=15)
    plain = SamplingParams(temperature=0, max_tokens=6)
    logged = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    sampled = SamplingParams(n=2, best_of=3, temperature=1.0, max_tokens=6, seed=5)
    alone = llm.generate(batch, plain, use_tqdm=False)
    mixed = llm.generate(batch, [plain, logged, sampled], use_tqdm=False)
    assert [o.outputs[0].cumulative_logprob for o in alone] == [None] * 3
    assert mixed[0].outputs[0].cumulative_logprob is None
    assert [o.outputs[0].token_ids for o in alone[:2]] == [o.outputs[0].token_ids for o in mixed[:2]]
    completion = mixed[1].outputs[0]
    chosen = [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)]
    assert completion.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-4) and sum(chosen) < 0
    assert all(c.cumulative_logprob is not None and c.cumulative_logprob < 0 for c in mixed[2].outputs)


ALLOWED = [11, 23, 57, 201]


def _allowed_batch(llm, vocab_size: int):
    """(prompt, outputs) of one batch: 8 samples and a greedy token within ``ALLOWED``, 8 free samples."""
    prompt = prompts(1, vocab_size, seed=14)[0]
    sampled = SamplingParams(n=8, temperature=1.0, max_tokens=5, seed=3, allowed_token_ids=ALLOWED)
    greedy = SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=ALLOWED)
    free = SamplingParams(n=8, temperature=1.0, max_tokens=5, seed=3)
    return prompt, llm.generate([prompt] * 3, [sampled, greedy, free], use_tqdm=False)


def test_allowed_token_ids_are_the_only_tokens_generated(llm_and_config):
    """vLLM's allowed_token_ids: sampled and greedy tokens stay in the list, other requests in
    the batch are free, and ids outside the vocabulary are refused."""
    llm, config = llm_and_config
    prompt, outputs = _allowed_batch(llm, config.vocab_size)
    assert {t for c in outputs[0].outputs for t in c.token_ids} <= set(ALLOWED)
    assert outputs[1].outputs[0].token_ids[0] in ALLOWED
    assert {t for c in outputs[2].outputs for t in c.token_ids} - set(ALLOWED)
    (refused,) = llm.generate([prompt], SamplingParams(allowed_token_ids=[config.vocab_size]), use_tqdm=False)
    assert "allowed_token_ids token ids" in refused.error


def test_greedy_with_allowed_token_ids_picks_hugging_faces_most_likely_of_them(llm_and_config, hf):
    llm, config = llm_and_config
    prompt, outputs = _allowed_batch(llm, config.vocab_size)
    last = next_token_logprobs(hf, prompt)[-1]
    assert outputs[1].outputs[0].token_ids[0] == ALLOWED[int(last[ALLOWED].argmax())]


def _request(params, generated=(), bad_word_ids=()) -> RequestState:
    request = RequestState("r", None, (1, 2), params, seed=0, max_tokens=8, eos_token_ids=(0,),
                           bad_word_ids=bad_word_ids)
    request.seqs = {0: SeqProgress(index=0, token_ids=list(generated))}
    return request


@pytest.mark.parametrize("params, generated, bad_word_ids, suffices", [
    (SamplingParams(temperature=0), (), (), True),
    (SamplingParams(temperature=0, min_tokens=2), (5, 6), (), True),  # min_tokens reached: EOS no longer banned
    (SamplingParams(temperature=0, min_tokens=2), (5,), (), False),
    (SamplingParams(temperature=0), (), ((9,),), False),
    (SamplingParams(temperature=0, logprobs=0), (), (), False),
    (SamplingParams(temperature=0, repetition_penalty=1.2), (), (), False),
    (SamplingParams(temperature=0, presence_penalty=0.5), (), (), False),
    (SamplingParams(temperature=0, logit_bias={5: 1.0}), (), (), False),
    (SamplingParams(temperature=0, allowed_token_ids=[1, 2]), (), (), False),
    (SamplingParams(temperature=0.8), (), (), False),
    (SamplingParams(temperature=0.8, n=2, best_of=3), (), (), False),
    (BeamSearchParams(beam_width=2, max_tokens=4), (), (), False),
])
def test_the_head_may_skip_exact_logits_only_when_the_sampler_takes_the_arg_max(params, generated, bad_word_ids,
                                                                                 suffices):
    """A step whose rows are all plain greedy lets the head compute exactly only the logits that
    can be largest (``Metadata.argmax_rows``); any penalty, bias, banned or allowed token,
    temperature or log-probability needs them all. The sampler's own switches agree."""
    rows = [sampling_rows.Row(0, _request(params, generated, bad_word_ids), 0)]
    assert sampling_rows.argmax_suffices(rows) is suffices
    batch = sampling_rows.batch_for(rows, 0, 64)
    plain = (batch.all_greedy and not batch.penalties and not batch.logprobs and not batch.ranks
             and not batch.num_top_logprobs and not batch.banned.shape[1] and not batch.bias_tokens.shape[1]
             and not batch.allowed.shape[1])
    assert plain is suffices
    assert not sampling_rows.argmax_suffices(rows + [sampling_rows.Row(0, _request(SamplingParams(temperature=0.8)),
                                                                       0)])
    assert not sampling_rows.argmax_suffices([])
