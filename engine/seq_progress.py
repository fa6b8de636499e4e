"""One sequence's progress as the user sees it (tokens, text, log-probabilities, finish
reason), kept per sequence by :class:`engine.request_state.RequestState`."""

from __future__ import annotations

import dataclasses

from engine.detokenizer import DecodeState
from engine.outputs import CompletionOutput, TokenLogprobs


@dataclasses.dataclass
class SeqProgress:
    """What one sequence has produced: tokens, text, log-probabilities, and why it ended."""

    index: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    cumulative_logprob: float | None = 0.0  # None: not tracked (RequestState.tracks_logprob)
    logprobs: list[TokenLogprobs] | None = None
    decoded: DecodeState = DecodeState()
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    matcher: object | None = None  # the constraint's state (structured_output), if the request has one
    stream: object | None = None  # the text's DecodeStream (detokenizer.open_stream); False: decode_next
    num_decoded: int = 0  # tokens whose text is in ``decoded`` (RequestState.defers_text: fewer until an output)

    def completion(self, held_back: int = 0) -> CompletionOutput:
        """A snapshot; while running, the last ``held_back`` characters (which might still turn
        out to start a stop string) are withheld, so streamed text never has to be taken back."""
        text = self.decoded.text
        if self.finish_reason is None and held_back:
            text = text[: max(0, len(text) - held_back)]
        logprobs = None if self.logprobs is None else tuple(self.logprobs)
        return CompletionOutput(self.index, text, tuple(self.token_ids), self.cumulative_logprob, logprobs,
                                self.finish_reason, self.stop_reason)
