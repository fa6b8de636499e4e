"""Streaming pieces of the OpenAI server: server-sent events, chunks with a fixed id, what a stream
has sent of each choice, and errors after the stream has begun."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator

from engine.entrypoints.protocol import RequestError, error_body
from engine.outputs import CompletionOutput

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ChoiceProgress:
    """One choice of a stream whose outputs are deltas (``RequestOutputKind.DELTA``): the tokens
    it generated, the part taken but not sent yet (a stream sends nothing while the text has
    not grown, as when a character is split over tokens), the legacy logprobs' text offset, and
    whether its finishing chunk went out."""

    tokens: int = 0
    unsent: CompletionOutput | None = None
    text_offset: int = 0
    done: bool = False

    def take(self, c: CompletionOutput) -> CompletionOutput:
        """The delta ``c``, after whatever was taken and not sent: what a chunk would send now."""
        self.tokens += len(c.token_ids)
        held, self.unsent = self.unsent, None
        if held is None:
            return c
        logprobs = None if c.logprobs is None else (held.logprobs or ()) + c.logprobs
        return dataclasses.replace(c, text=held.text + c.text, token_ids=held.token_ids + c.token_ids,
                                   logprobs=logprobs)

    def hold(self, c: CompletionOutput) -> None:
        """Keep ``c`` (from :meth:`take`) for the next chunk."""
        self.unsent = c

    def sent(self, c: CompletionOutput) -> None:
        """Record ``c`` (from :meth:`take`) as sent."""
        self.done = c.finish_reason is not None


def includes_usage(request) -> bool:
    """Whether the client asked for a ``usage`` chunk (``stream_options.include_usage``)."""
    return bool(request.stream_options and request.stream_options.include_usage)


async def ending_with_errors(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """``chunks``; if producing them fails once streaming has begun (the status line is sent),
    an error event and ``[DONE]`` end the stream instead of a cut connection, as vLLM does.
    Closing it (a client gone) closes ``chunks`` at once."""
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk
    except RequestError as error:
        yield sse(error_body(str(error), error.status, error.kind))
        yield "data: [DONE]\n\n"
    except Exception as error:  # noqa: BLE001 - the client gets it, the log gets the traceback
        log.exception("stream failed")
        yield sse(error_body(str(error), 500, "internal_server_error"))
        yield "data: [DONE]\n\n"


def sse(body: dict) -> str:
    """One server-sent event carrying ``body`` as JSON."""
    return f"data: {json.dumps(body)}\n\n"


def chunk_writer(request_id: str, kind: str, model: str, with_usage: bool = False):
    """``chunk(choices, usage=None)`` → one server-sent event of a stream with id ``request_id``
    (``protocol.response_id``'s). With ``with_usage`` (``stream_options.include_usage``) every
    chunk has a ``usage`` field, null but in the last, as OpenAI documents."""
    created = int(time.time())

    def chunk(choices, usage=None):
        body = {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices}
        if with_usage or usage is not None:
            body["usage"] = usage
        return sse(body)

    return chunk
