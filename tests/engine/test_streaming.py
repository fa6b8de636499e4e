"""A stream's choices as the server sends them: deltas, with what has no text yet held for the next chunk."""

from __future__ import annotations

from engine.entrypoints.streaming import ChoiceProgress
from engine.outputs import CompletionOutput


def _delta(text: str, tokens: tuple[int, ...], finish_reason: str | None = None) -> CompletionOutput:
    return CompletionOutput(0, text, tokens, None, tuple({t: -1.0} for t in tokens), finish_reason)


def test_a_delta_without_text_goes_out_with_the_next_one():
    progress = ChoiceProgress()
    first = progress.take(_delta("", (7,)))  # half of a character: nothing to send yet
    progress.hold(first)
    second = progress.take(_delta("é", (8,)))
    assert (second.text, second.token_ids, second.logprobs) == ("é", (7, 8), ({7: -1.0}, {8: -1.0}))
    progress.sent(second)
    last = progress.take(_delta("!", (9,), "length"))
    assert (last.text, last.token_ids) == ("!", (9,))
    progress.sent(last)
    assert progress.done and progress.tokens == 3
