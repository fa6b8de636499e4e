"""Unread delta outputs merged into one (``engine.outputs.joined_deltas``, what a stream whose
reader fell behind reads): what they say together, choice by choice."""

from __future__ import annotations

from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, joined_deltas


def _delta(*choices, prompt_logprobs=None, error=None, finished=False, cached=None, at=1.0):
    return RequestOutput("r", "hi", (1, 2), tuple(choices), finished, prompt_logprobs, error,
                         RequestMetrics(0.0, at, None), cached)


def _choice(index, text, tokens, logprob, finish=None, stop=None):
    entries = tuple({t: Logprob(-0.5, 1)} for t in tokens)
    return CompletionOutput(index, text, tuple(tokens), logprob, entries, finish, stop)


def test_choices_join_by_index_and_keep_the_last_word():
    """n=2: choice 1 finishes in the second delta, choice 0 goes on; a choice missing from a
    delta (nothing new) keeps what it had; the prompt's log-probabilities come from the first."""
    first = _delta(_choice(0, "a", [5], -1.0), _choice(1, "x", [9], -2.0), prompt_logprobs=(None, {2: Logprob(-1)}),
                   cached=0)
    second = _delta(_choice(1, "y", [10], -2.5, "stop", 10), at=2.0)
    third = _delta(_choice(0, "bc", [6, 7], -3.0), at=3.0)
    joined = joined_deltas([first, second, third])
    assert [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.finish_reason, c.stop_reason)
            for c in joined.outputs] == [(0, "abc", (5, 6, 7), -3.0, None, None), (1, "xy", (9, 10), -2.5, "stop", 10)]
    assert [list(e) for e in joined.outputs[0].logprobs] == [[5], [6], [7]]
    assert joined.prompt_logprobs == first.prompt_logprobs and joined.num_cached_tokens == 0
    assert joined.metrics == third.metrics and not joined.finished


def test_the_last_says_whether_it_finished_and_the_error_stays():
    error = _delta(_choice(0, "!", [4], -1.0, "abort"), error="outgrew the KV cache", finished=True)
    joined = joined_deltas([_delta(_choice(0, "so", [3], -0.5)), error])
    assert joined.finished and joined.error == "outgrew the KV cache"
    assert joined.outputs[0].text == "so!" and joined.outputs[0].finish_reason == "abort"


def test_one_output_is_itself_and_the_join_is_the_pairwise_join():
    deltas = [_delta(_choice(0, str(i), [i], -float(i))) for i in range(5)]
    assert joined_deltas(deltas[:1]) is deltas[0]
    pairwise = deltas[0]
    for delta in deltas[1:]:
        pairwise = joined_deltas([pairwise, delta])
    assert joined_deltas(deltas) == pairwise and pairwise.outputs[0].text == "01234"


def test_choices_without_logprobs_stay_without():
    plain = [_delta(CompletionOutput(0, t, (i,), None, None)) for i, t in enumerate("ab")]
    assert joined_deltas(plain).outputs[0].logprobs is None
