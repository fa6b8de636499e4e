"""Text in and text out on the real SmolLM2: chat template, stop strings, incremental detokenisation."""

from __future__ import annotations

import dataclasses

import pytest

from engine import LLM, BeamSearchParams, SamplingParams, plain_rows
from engine.request_state import RequestState
from engine.seq_progress import SeqProgress
from tests.engine.test_llm_parity import COMMON, CONFIGS
from tests.hf_torch import require_torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return LLM(**COMMON, **CONFIGS["batched"])


def test_chat_answers_through_the_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert "<|im_end|>" not in out.outputs[0].text
    assert out.prompt.startswith("<|im_start|>") and "What is the capital of France?<|im_end|>" in out.prompt
    assert out.outputs[0].finished()  # a method, as in vLLM


def test_chat_reads_openai_text_parts_joined_by_newlines(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    joined = [{"role": "user", "content": "What is the capital\nof France?"}]
    assert llm.chat_prompt(parts) == llm.chat_prompt(joined)
    with pytest.raises(ValueError, match="content parts of type 'image_url' are not supported"):
        llm.chat_prompt([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_chat_can_continue_the_final_message(llm):
    conversation = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One, two,"}]
    closed = llm.chat_prompt(conversation, add_generation_prompt=False)
    open_turn = llm.chat_prompt(conversation, add_generation_prompt=False, continue_final_message=True)
    assert open_turn == closed[:-2]  # without the end-of-turn token and newline
    out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                   add_generation_prompt=False, continue_final_message=True)[0]
    assert "three" in out.outputs[0].text.lower()
    with pytest.raises(ValueError, match="the chat template cannot render this conversation"):
        llm.chat_prompt([{"content": "no role"}])


def test_params_of_the_wrong_kind_are_refused_with_where_they_go(llm):
    with pytest.raises(TypeError, match="expected SamplingParams, got BeamSearchParams; pass it to LLM.beam_search"):
        llm.generate(["Hi"], BeamSearchParams(beam_width=2, max_tokens=3), use_tqdm=False)
    with pytest.raises(TypeError, match="expected BeamSearchParams, got SamplingParams; pass it to LLM.generate"):
        llm.beam_search(["Hi"], SamplingParams(max_tokens=3))
    with pytest.raises(TypeError, match="expected SamplingParams, got dict"):
        llm.generate(["Hi"], {"max_tokens": 3}, use_tqdm=False)


def test_logprobs_name_their_tokens(llm):
    tokenizer = llm.get_tokenizer()
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4, logprobs=2),
                       use_tqdm=False)[0].outputs[0]
    for token, step in zip(out.token_ids, out.logprobs):
        assert step[token].rank == 1  # greedy
        assert all(v.decoded_token == tokenizer.decode([t]) for t, v in step.items())


def test_text_equals_decoding_the_tokens(llm):
    tokenizer = llm.get_tokenizer()
    outs = llm.generate(["Write a haiku about the sea.", "日本の首都は"], SamplingParams(temperature=0, max_tokens=30),
                        use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)


# A stop string no output here says: the request's text is made as each token comes.
NEVER_SAID = "<never said>"


def test_text_made_at_the_end_is_the_text_made_token_by_token(llm, monkeypatch):
    """``LLM.generate`` without stop strings records its rows at once and decodes each text once,
    at the end; with a stop string (never said) each token's text is made as it comes. Same
    texts: characters split over tokens, special tokens kept, stop tokens' text left out or kept."""
    prompts = ["Write a haiku about the sea.", "日本の首都は", "Count: one, two, three,"]
    free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    stop_token = free[2].outputs[0].token_ids[2]
    recorded = []
    record = plain_rows.record
    monkeypatch.setattr(plain_rows, "record", lambda *args: recorded.append(1) or record(*args))
    for extra in (dict(skip_special_tokens=False), dict(stop_token_ids=[stop_token]),
                  dict(stop_token_ids=[stop_token], include_stop_str_in_output=True)):
        params = SamplingParams(temperature=0, max_tokens=24, **extra)
        at_end = llm.generate(prompts, params, use_tqdm=False)
        assert recorded, "no step was recorded at once"
        recorded.clear()
        as_they_come = llm.generate(prompts, dataclasses.replace(params, stop=(NEVER_SAID,)), use_tqdm=False)
        assert recorded, "rows with stop strings were not recorded at once"
        recorded.clear()
        assert [o.outputs[0].text for o in at_end] == [o.outputs[0].text for o in as_they_come]
        assert [o.outputs[0].token_ids for o in at_end] == [o.outputs[0].token_ids for o in as_they_come]


def test_rows_with_and_without_stop_strings_in_one_batch_end_as_each_alone(llm):
    """A batch mixing requests whose stop strings are found, never found or absent, and one
    without text: each ends, and reads, as it does alone."""
    prompt = "Count: one, two, three,"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0].text
    stop = free.strip().split()[1]
    params = [SamplingParams(temperature=0, max_tokens=20, stop=[stop]),
              SamplingParams(temperature=0, max_tokens=20, stop=[NEVER_SAID], include_stop_str_in_output=True),
              SamplingParams(temperature=0, max_tokens=20),
              SamplingParams(temperature=0, max_tokens=20, detokenize=False),
              SamplingParams(temperature=0.8, seed=4, max_tokens=20, stop=[" "])]
    together = llm.generate([prompt] * len(params), params, use_tqdm=False)
    for each, output in zip(params, together):
        alone = llm.generate([prompt], each, use_tqdm=False)[0].outputs[0]
        assert output.outputs[0] == alone
    assert together[0].outputs[0].stop_reason == stop and together[0].outputs[0].text == free[: free.index(stop)]
    assert together[3].outputs[0].text == ""


def test_stop_string_ends_generation_and_is_cut(llm):
    free = llm.generate(["Count: one, two, three,"], SamplingParams(temperature=0, max_tokens=20),
                        use_tqdm=False)[0].outputs[0].text
    stop = free.strip().split()[1]  # a word the model is about to write
    out = llm.generate(["Count: one, two, three,"], SamplingParams(temperature=0, max_tokens=20, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free[: free.index(stop)]


def tokenizer_text(llm, token_ids) -> str:
    return llm.get_tokenizer().decode(token_ids, skip_special_tokens=True)


def test_stop_rules_wait_for_min_tokens_and_can_keep_the_stop_text(llm):
    prompt = "Count: one, two, three,"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    greedy = dict(temperature=0, max_tokens=20)
    early = llm.generate([prompt], SamplingParams(**greedy, stop=[","], min_tokens=6), use_tqdm=False)[0].outputs[0]
    # the commas of tokens 2 and 4 do not stop it; the first one at or past token 6 does
    assert early.token_ids == free.token_ids[:6] and free.token_ids[1] == free.token_ids[5]
    assert early.text == tokenizer_text(llm, free.token_ids[:5])
    kept = llm.generate([prompt], SamplingParams(**greedy, stop=[","], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == free.text[: free.text.index(",") + 1]
    tokenizer = llm.get_tokenizer()
    stop_token = free.token_ids[2]  # its first occurrence (a word, then a comma, then this word)
    assert stop_token not in free.token_ids[:2]
    by_token = llm.generate([prompt], SamplingParams(**greedy, stop_token_ids=[stop_token]), use_tqdm=False)[0]
    by_token = by_token.outputs[0]
    assert by_token.stop_reason == stop_token and by_token.token_ids == free.token_ids[:3]
    assert by_token.text == tokenizer.decode(free.token_ids[:2])
    keep = SamplingParams(**greedy, stop_token_ids=[stop_token], include_stop_str_in_output=True)
    kept = llm.generate([prompt], keep, use_tqdm=False)[0].outputs[0]
    assert kept.text == tokenizer.decode(free.token_ids[:3])


def test_eos_text_is_left_out_even_when_special_tokens_are_kept(llm):
    question = [{"role": "user", "content": "Say hi."}]
    out = llm.chat(question, SamplingParams(temperature=0, max_tokens=40, skip_special_tokens=False),
                   use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert "<|im_end|>" not in out.text
    kept = llm.chat(question, SamplingParams(temperature=0, max_tokens=40, skip_special_tokens=False,
                                             include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == out.text + "<|im_end|>"


def test_beam_search_returns_vllm_beam_search_outputs(llm):
    prompt = "The capital of France is"
    (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6))
    tokenizer = llm.get_tokenizer()
    prompt_ids = tokenizer(prompt)["input_ids"]
    assert len(out.sequences) == 3 and out.error is None
    scores = [s.cum_logprob / (len(s.tokens) - len(prompt_ids)) for s in out.sequences]
    assert scores == sorted(scores, reverse=True)  # best first (length_penalty 1)
    for beam in out.sequences:
        generated = beam.tokens[len(prompt_ids):]
        assert beam.tokens[: len(prompt_ids)] == prompt_ids  # the tokens include the prompt, as in vLLM
        assert beam.text == tokenizer.decode(beam.tokens) and beam.text.startswith(prompt)
        # Per generated token, what its beam proposed (2 x width), the chosen token among them
        assert [len(entry) for entry in beam.logprobs] == [6] * len(generated)
        chosen = [entry[token] for token, entry in zip(generated, beam.logprobs)]
        assert beam.cum_logprob == pytest.approx(sum(chosen), abs=1e-4)
        assert all(min(lp.rank for lp in entry.values()) == 1 for entry in beam.logprobs)
        assert beam.finish_reason in ("stop", "length")
    assert " Paris" in out.sequences[0].text


FRANCE = "The capital of France is"
NO_PARIS = SamplingParams(temperature=0, max_tokens=12, bad_words=["Paris"])


def test_bad_words_are_never_generated(llm):
    """vLLM's ``bad_words``: "Paris" is banned alone and mid-text (one token each here), so the
    greedy answer that names it without the ban leaves it out."""
    tokenizer = llm.get_tokenizer()
    assert NO_PARIS.bad_word_ids(tokenizer) == (tuple(tokenizer.encode("Paris")), tuple(tokenizer.encode(" Paris")))
    assert "Paris" not in llm.generate([FRANCE], NO_PARIS, use_tqdm=False)[0].outputs[0].text
    plain = llm.generate([FRANCE], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert " Paris" in plain.outputs[0].text
    with pytest.raises(ValueError, match="bad_words must be a list of words"):
        SamplingParams(bad_words=["ok", " "])


def test_bad_words_match_hugging_face_bad_words_ids(llm, hf_smollm2_torch):
    """Greedy output with "Paris" banned equals HF ``generate`` under the same ``bad_words_ids``,
    token for token. (Each word is one token here: for longer words HF matches the prefix in
    the prompt too, vLLM in the output only; the next test covers those.)"""
    torch = require_torch()
    tokenizer = llm.get_tokenizer()
    ids = tokenizer(FRANCE)["input_ids"]
    out = llm.generate([FRANCE], NO_PARIS, use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        want = hf_smollm2_torch.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                         bad_words_ids=[list(w) for w in NO_PARIS.bad_word_ids(tokenizer)],
                                         pad_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
    assert list(out.token_ids) == want[: len(out.token_ids)]


def test_a_bad_word_of_several_tokens_bans_its_last_only_after_the_others():
    request = RequestState("r", None, (1, 2), SamplingParams(min_tokens=1), seed=0, max_tokens=8,
                           eos_token_ids=(0,), bad_word_ids=((7, 8), (9,)))
    request.seqs = {0: SeqProgress(index=0)}
    assert request.banned_tokens(0) == (0, 9)  # EOS before min_tokens; a one-token word always
    request.seqs[0].token_ids += [7]
    assert request.banned_tokens(0) == (8, 9)
    request.seqs[0].token_ids += [5]
    assert request.banned_tokens(0) == (9,)


def test_detokenize_false_gives_the_same_tokens_and_no_text(llm):
    plain = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    ids_only = SamplingParams(temperature=0, max_tokens=8, logprobs=2, detokenize=False)
    with_text, without = (o.outputs[0] for o in llm.generate(["The capital of France is"] * 2, [plain, ids_only],
                                                               use_tqdm=False))
    assert without.token_ids == with_text.token_ids and with_text.text and without.text == ""
    assert all(lp.decoded_token is None for step in without.logprobs for lp in step.values())
    with pytest.raises(ValueError, match="stop must be empty when detokenize is False"):
        SamplingParams(stop=["."], detokenize=False)


def test_multi_step_decode_stops_where_single_steps_do(llm, monkeypatch):
    """Stop strings, stop tokens and EOS that end a sequence in the middle of a loop of 8 steps:
    the same text, tokens and reasons as one step at a time, and every block freed; each loop's
    tokens recorded at once where no row has log-probabilities, with text made as tokens come
    (stop strings) or at the end."""
    multi = LLM(**COMMON, **CONFIGS["batched"], num_scheduler_steps=8)
    at_once = []
    record_steps = plain_rows.record_steps
    monkeypatch.setattr(plain_rows, "record_steps", lambda *args: at_once.append(1) or record_steps(*args))

    def same_as_single_steps(params):
        outputs = multi.generate(prompts, params, use_tqdm=False)
        seen = [[(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs]
                for o in llm.generate(prompts, params, use_tqdm=False)]
        assert [[(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs] == seen
        stats = multi.cache_stats()
        assert stats.device_blocks_free == stats.device_blocks_total

    prompts = ["Count: one, two, three,", "The capital of France is", "List three colours:", "Say hi."]
    params = [SamplingParams(temperature=0, max_tokens=40, stop=[" five", "Paris"]),
              SamplingParams(temperature=0.8, seed=3, max_tokens=37, stop=["."], include_stop_str_in_output=True),
              SamplingParams(temperature=0, max_tokens=29, logprobs=2, stop_token_ids=[28]),
              SamplingParams(temperature=0.7, seed=5, max_tokens=60)]
    same_as_single_steps(params)
    assert multi.engine.counters.multi_steps > 0
    # Without the log-probabilities, every row is plain; those with stop strings make their text
    # as each token comes, and a stop string found mid-loop drops the loop's tokens after it.
    at_once.clear()
    same_as_single_steps([*params[:2], dataclasses.replace(params[2], logprobs=None), params[3]])
    assert at_once, "no loop with stop strings was recorded at once"
    # Without stop strings the text is made when the output is (``RequestState.defers_text``):
    # the same text as made token by token.
    plain = [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[28]),
             SamplingParams(temperature=0.8, seed=3, max_tokens=37, include_stop_str_in_output=True),
             SamplingParams(temperature=0, max_tokens=29, skip_special_tokens=False),
             SamplingParams(temperature=0.7, seed=5, max_tokens=60)]
    token_by_token = [dataclasses.replace(p, stop=(NEVER_SAID,)) for p in plain]
    at_once.clear()
    outputs = multi.generate(prompts, plain, use_tqdm=False)
    assert [[(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs] == [
        [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs]
        for o in llm.generate(prompts, token_by_token, use_tqdm=False)]
    assert at_once, "no loop was recorded at once"
    stats = multi.cache_stats()
    assert stats.device_blocks_free == stats.device_blocks_total
