"""Greedy output of the engine equals Hugging Face ``generate`` on the real SmolLM2, token for
token, however the engine batches, queues, preempts, chunks or caches."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import pallas_paged
from engine import LLM, SamplingParams
from tests.hf_references import NEW_TOKENS

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
WITH_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=5)
# float32 log-probabilities of the native products against XLA's: they sum in other orders.
LOGPROB_TOLERANCE = 1e-3
COMMON = dict(max_model_len=512, block_size=16, swap_space=0.25, warmup=False)

CONFIGS = {
    "batched": dict(num_blocks=256, max_num_seqs=16, max_num_batched_tokens=512),
    "queued": dict(num_blocks=256, max_num_seqs=3, max_num_batched_tokens=512),
    "chunked_prefill": dict(num_blocks=256, max_num_seqs=16, max_num_batched_tokens=16),
    "prefix_caching": dict(num_blocks=256, max_num_seqs=16, max_num_batched_tokens=512, enable_prefix_caching=True),
    "preempt_recompute": dict(num_blocks=24, max_num_seqs=16, max_num_batched_tokens=512, preemption_mode="recompute"),
    "preempt_swap": dict(num_blocks=24, max_num_seqs=16, max_num_batched_tokens=512, preemption_mode="swap"),
    "multi_step": dict(num_blocks=256, max_num_seqs=16, max_num_batched_tokens=512, num_scheduler_steps=8),
    "multi_step_preempt_swap": dict(num_blocks=24, max_num_seqs=16, max_num_batched_tokens=512, preemption_mode="swap",
                                    num_scheduler_steps=8),
}


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.cache_stats()
    assert stats.device_blocks_free == stats.device_blocks_total, stats
    assert stats.host_blocks_free == stats.host_blocks_total, stats


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_hugging_face(name, parity_prompts, hf_parity):
    llm = LLM(**COMMON, **CONFIGS[name])
    outputs = llm.generate(parity_prompts, GREEDY, use_tqdm=False)
    for prompt, output, expected in zip(parity_prompts, outputs, hf_parity):
        assert list(output.outputs[0].token_ids) == expected, llm.get_tokenizer().decode(prompt)
    if "preempt" in name:
        assert llm.cache_stats().num_preemptions > 0, "the pool was meant to be too small"
    if name.startswith("multi_step"):
        assert llm.engine.counters.multi_steps > 0
    assert_all_blocks_free(llm)


def test_prompts_started_together_share_their_common_blocks(parity_prompts, hf_parity):
    """With prefix caching, chat prompts admitted in one step compute the chat template's full
    blocks once (the later ones read the first one's KV, written in the same step), and keep
    Hugging Face's tokens; the duplicate prompts share every full block."""
    llm = LLM(**COMMON, **CONFIGS["prefix_caching"])
    prompts, expected = parity_prompts[-2:] * 2, hf_parity[-2:] * 2
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    stats, block = llm.cache_stats(), COMMON["block_size"]
    first, second = prompts[:2]
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert common >= block, "the chat template should fill a block"
    # the second prompt finds the template's blocks; the repeats every block but their last token's
    assert stats.prefix_cache_hits == common // block + (len(first) - 1) // block + (len(second) - 1) // block
    assert llm.engine.counters.prompt_tokens == sum(map(len, prompts)) - stats.prefix_cache_hits * block
    assert_all_blocks_free(llm)


def test_bfloat16_output_survives_swapping_and_copy_on_write(parity_prompts):
    """bfloat16 weights and (by "auto") cache: preempted by swapping blocks out and in, or
    sharing the prompt's blocks between two samples, each sequence gets the tokens of an
    unconstrained run up to bfloat16's near ties (see assert_same_up_to_near_ties: other
    batches run other programs); nothing leaks."""
    expected = [o.outputs[0] for o in LLM(dtype="bfloat16", **COMMON, **CONFIGS["batched"])
                .generate(parity_prompts, WITH_LOGPROBS, use_tqdm=False)]
    swapped = LLM(dtype="bfloat16", **COMMON, **CONFIGS["preempt_swap"])
    outputs = swapped.generate(parity_prompts, GREEDY, use_tqdm=False)
    assert_same_up_to_near_ties([list(o.outputs[0].token_ids) for o in outputs], expected)
    assert swapped.cache_stats().num_preemptions > 0, "the pool was meant to be too small"
    assert_all_blocks_free(swapped)
    shared = LLM(dtype="bfloat16", **COMMON, **CONFIGS["batched"])
    pairs = shared.generate(parity_prompts, SamplingParams(n=2, temperature=0.0, max_tokens=NEW_TOKENS),
                            use_tqdm=False)
    assert all(list(o.outputs[0].token_ids) == list(o.outputs[1].token_ids) for o in pairs)
    assert_same_up_to_near_ties([list(o.outputs[0].token_ids) for o in pairs], expected)
    assert_all_blocks_free(shared)


def assert_same_up_to_near_ties(got: list[list[int]], expected, *, tolerance: float = 0.1) -> None:
    """Greedy tokens in bfloat16 equal ``expected``'s (CompletionOutputs with logprobs) up to
    near ties: where a sequence first differs, ``expected``'s run had the other token within
    ``tolerance`` of its own log-probability. Runs that batch the same prompts differently,
    or multiply them with other kernels, differ by a bfloat16 rounding here and there: over
    these prompts their chosen tokens' log-probabilities differed by up to 0.055."""
    for tokens, want in zip(got, expected, strict=True):
        differ = next((i for i, (a, b) in enumerate(zip(tokens, want.token_ids)) if a != b), None)
        if differ is None:
            assert tokens == list(want.token_ids)
            continue
        choices = want.logprobs[differ]
        assert tokens[differ] in choices, f"position {differ}: {tokens[differ]} is not among the top tokens"
        assert choices[want.token_ids[differ]].logprob - choices[tokens[differ]].logprob < tolerance


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_weights_packed_for_the_native_product_give_the_same_tokens(parity_prompts, monkeypatch, dtype):
    """Where the native product runs, the engine packs every weight it can, and the tied
    embedding gets a packed copy as the head; greedy tokens equal XLA's products' in float32.
    In bfloat16 they are the model's (float32, XLA) up to near ties (assert_same_up_to_near_ties):
    the native SwiGLU's exp is not XLA's, and a float32 rounding apart can round a product's
    input to the next bfloat16. The near ties are judged by float32, not by XLA's bfloat16
    products: those moved between JAX 0.10.2 and 0.12 on an AVX512-BF16 CPU, and at a
    position where float32 puts three tokens within 0.02 (parity prompt 15, token 14), JAX
    0.12's put two of them 0.17 apart, the native products 0.04."""
    packed = LLM(dtype=dtype, **COMMON, **CONFIGS["batched"])
    params = packed.engine.runner.params
    if not pallas_paged.is_packed(params["layers"][0]["q"]["w"]):
        pytest.skip("this CPU has no AVX512-BF16")
    assert all(pallas_paged.is_packed(layer[key]["w"]) for layer in params["layers"]
               for key in ("q", "k", "v", "o", "gate", "up", "down"))
    assert pallas_paged.is_packed(params["lm_head"]["w"]) and params["embed"].dtype == jnp.dtype(dtype)
    monkeypatch.setenv("PALLAS_PAGED_CPU_MATMUL", "xla")
    unpacked = LLM(dtype="float32", **COMMON, **CONFIGS["batched"])  # the judge in both dtypes
    assert "lm_head" not in unpacked.engine.runner.params
    expected = [o.outputs[0] for o in unpacked.generate(parity_prompts, WITH_LOGPROBS, use_tqdm=False)]
    got = [list(o.outputs[0].token_ids) for o in packed.generate(parity_prompts, GREEDY, use_tqdm=False)]
    if dtype == "float32":
        assert got == [list(want.token_ids) for want in expected]
        # Greedy steps read a bfloat16 screen of the head (pallas_paged.argmax_head) and keep
        # the tokens; steps that report log-probabilities compute every logit exactly.
        assert "screen" in params["lm_head"]
        reported = packed.generate(parity_prompts, WITH_LOGPROBS, use_tqdm=False)
        for output, want in zip(reported, expected, strict=True):
            for got_top, want_top in zip(output.outputs[0].logprobs, want.logprobs, strict=True):
                for token in got_top.keys() & want_top.keys():
                    assert abs(got_top[token].logprob - want_top[token].logprob) < LOGPROB_TOLERANCE
    else:
        assert_same_up_to_near_ties(got, expected)
