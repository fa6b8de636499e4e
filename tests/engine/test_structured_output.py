"""Structured outputs offline on the real SmolLM2: every completion follows its constraint
(JSON schema, regex, choice, grammar), with every sampling setting, and unconstrained requests
batched beside constrained ones get the tokens they get alone."""

from __future__ import annotations

import json
import re

import llguidance.numpy
import numpy as np
import pydantic
import pytest

from engine import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from engine.worker.sampler import unpack_bitmask
from tests.engine.test_llm_parity import COMMON, CONFIGS, assert_all_blocks_free

pytestmark = pytest.mark.slow


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties false: the object ends
    name: str = pydantic.Field(max_length=40)  # bounded, so a 135M model's samples end within max_tokens
    country: str = pydantic.Field(max_length=40)
    population: int = pydantic.Field(ge=0, le=10**9)


CITY = GuidedDecodingParams(json=City.model_json_schema())
ASK = [[{"role": "user", "content": f"Describe {city} as JSON."}] for city in ("Paris", "Tokyo", "Lima")]


@pytest.fixture(scope="module")
def llm():
    return LLM(**COMMON, **CONFIGS["batched"])


def texts(outputs) -> list[str]:
    return [completion.text for output in outputs for completion in output.outputs]


def test_json_schema_outputs_validate_with_n_and_seeds(llm):
    params = SamplingParams(n=3, temperature=0.8, top_p=0.95, seed=7, max_tokens=120, guided_decoding=CITY)
    outputs = llm.chat(ASK, params, use_tqdm=False)
    for output in outputs:
        assert len(output.outputs) == 3
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion.text
            City.model_validate_json(completion.text)
    again = llm.chat(ASK, params, use_tqdm=False)
    assert texts(again) == texts(outputs)  # seeded: the constraint keeps runs repeatable
    assert_all_blocks_free(llm)


PROMPTS = ["The date of the first moon landing:", "My favourite colour is"]
BOUNDED = [  # (constraint, prompts, what the text must be, temperatures)
    (GuidedDecodingParams(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"), PROMPTS,
     lambda t: re.fullmatch(r"\d{4}-\d{2}-\d{2}", t), (0.0, 1.0)),
    (GuidedDecodingParams(choice=["red", "green", "blue"]), PROMPTS, lambda t: t in ("red", "green", "blue"),
     (0.0, 1.0)),
    (GuidedDecodingParams(grammar='root ::= "yes" | "no"'), PROMPTS, lambda t: t in ("yes", "no"), (0.0, 1.0)),
    (GuidedDecodingParams(grammar='start: "(" NUMBER ")"\nNUMBER: /[0-9]+/'), PROMPTS,  # Lark
     lambda t: re.fullmatch(r"\(\d+\)", t), (0.0, 1.0)),
    # Any JSON object, sampled, can outgrow max_tokens; this prompt's greedy one ends.
    (StructuredOutputsParams(json_object=True), ["A JSON object:"], lambda t: isinstance(json.loads(t), dict),
     (0.0,)),
]


@pytest.mark.parametrize("guided, prompts, ok, temperatures", BOUNDED, ids=lambda x: getattr(x, "kind", None))
def test_regex_choice_grammars_and_json_objects_bound_the_text(llm, guided, prompts, ok, temperatures):
    for temperature in temperatures:
        params = SamplingParams(temperature=temperature, seed=3, max_tokens=100, guided_decoding=guided)
        for text in texts(llm.generate(prompts, params, use_tqdm=False)):
            assert ok(text), (temperature, text)


def test_unconstrained_requests_beside_constrained_ones_get_their_own_tokens(llm):
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    plain = SamplingParams(temperature=0.0, max_tokens=24)
    alone = llm.generate(prompts, plain, use_tqdm=False)
    constrained = SamplingParams(temperature=0.0, max_tokens=24, guided_decoding=GuidedDecodingParams(
        regex="[a-z ]+"))
    mixed = llm.generate(prompts * 2, [plain] * 3 + [constrained] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    assert all(re.fullmatch("[a-z ]+", o.outputs[0].text) for o in mixed[3:])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_constrained_requests_resume_with_the_same_output(mode):
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=120, guided_decoding=CITY, logprobs=2)
    roomy = LLM(**COMMON, **CONFIGS["batched"]).chat(ASK * 4, params, use_tqdm=False)
    tight = LLM(**COMMON, **CONFIGS[f"preempt_{mode}"])
    outputs = tight.chat(ASK * 4, params, use_tqdm=False)
    assert tight.cache_stats().num_preemptions > 0, "the pool was meant to be too small"
    assert texts(outputs) == texts(roomy)
    assert all(City.model_validate_json(text) for text in texts(outputs))
    assert_all_blocks_free(tight)


def test_best_of_stop_strings_and_logprobs_work_with_a_constraint(llm):
    """The ``n`` best of ``best_of`` constrained samples, cut by a stop string kept in the text
    (the first closing brace, perhaps inside a string), each token with its log-probabilities;
    every token one the constraint allows there."""
    params = SamplingParams(n=2, best_of=4, temperature=1.0, seed=5, max_tokens=120, stop=["}"],
                            include_stop_str_in_output=True, logprobs=3, guided_decoding=CITY)
    for output in llm.chat(ASK[:2], params, use_tqdm=False):
        assert len(output.outputs) == 2
        for completion in output.outputs:
            assert completion.text.endswith("}") and completion.stop_reason == "}"
            assert llm.engine.grammars.matcher(CITY).consume_tokens(list(completion.token_ids))
            assert len(completion.logprobs) == len(completion.token_ids)
    assert_all_blocks_free(llm)


def test_an_invalid_constraint_is_refused_naming_what_is_wrong(llm):
    outputs = llm.generate(["a", "b", "c"], [
        SamplingParams(guided_decoding=GuidedDecodingParams(regex="[a-")),
        SamplingParams(guided_decoding=GuidedDecodingParams(json={"type": "colour"})),
        SamplingParams(max_tokens=4)], use_tqdm=False)
    assert "invalid regex constraint" in outputs[0].error and "unclosed character class" in outputs[0].error
    assert "invalid json constraint" in outputs[1].error and "colour" in outputs[1].error
    assert outputs[2].error is None and outputs[2].outputs[0].token_ids
    with pytest.raises(ValueError, match="invalid grammar constraint"):  # the engine's own add_request
        llm.engine.add_request("bad", "a", SamplingParams(guided_decoding=GuidedDecodingParams(grammar="start: ((")))
    assert_all_blocks_free(llm)


def test_a_constraint_no_allowed_token_can_meet_ends_the_request_with_the_reason(llm):
    """allowed_token_ids leaves only tokens the choice rules out: the request ends at once with
    an error saying so, and frees its blocks (no hang, no garbage)."""
    digit = llm.get_tokenizer().encode("7", add_special_tokens=False)
    params = SamplingParams(allowed_token_ids=digit, guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    output = llm.generate(["Answer:"], params, use_tqdm=False)[0]
    assert output.finished and "cannot follow its choice constraint" in output.error
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(), "exactly one of them"),
    (dict(regex="a", choice=["a"]), "exactly one of them"),
    (dict(json="{not json"), "not JSON"),
    (dict(choice=[]), "non-empty list"),
])
def test_malformed_guided_decoding_params_are_refused(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        GuidedDecodingParams(**kwargs)


def test_the_samplers_mask_is_llguidances():
    """The sampler reads llguidance's bitmask as llguidance's own NumPy helper does."""
    rng = np.random.default_rng(0)
    vocab = 77
    bitmask = rng.integers(-2**31, 2**31, size=(3, 3), dtype=np.int64).astype(np.int32)
    logits = np.zeros((3, vocab), np.float32)
    llguidance.numpy.apply_token_bitmask_inplace(logits, bitmask)
    assert (np.asarray(unpack_bitmask(bitmask, vocab)) == np.isfinite(logits)).all()
