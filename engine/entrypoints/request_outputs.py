"""The engine requests behind one OpenAI response (a prompt and its ``n`` choices, or several
prompts), their outputs as they come: refusals and failures as ``RequestError``, the metrics
told of each request when it finishes, and every request aborted when the response is closed
(a client that disconnects)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from engine.core.scheduler import InvalidRequestError
from engine.entrypoints.async_engine import EngineClient
from engine.entrypoints.protocol import RequestError, response_id
from engine.outputs import RequestOutput
from engine.sampling_params import final_only

OnFinished = Callable[[RequestOutput, list[tuple[int, str | None]]], None]


async def merged(engine: EngineClient, plans, prefix: str, on_finished: OnFinished, shown=None
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of every planned request (``plans``: (token ids, params) each) as they come,
    tagged with the plan's index (:func:`outputs_of` each). Closing this iterator aborts every
    request still running. One plan, the common case, is read straight from its stream; several
    are pumped into one queue by a task each, a queue that holds one output per plan: a pump
    waits while the reader is behind, so its stream merges what comes meanwhile, as a single
    plan's does."""
    if len(plans) == 1:
        async with contextlib.aclosing(outputs_of(engine, *plans[0], prefix, on_finished, shown)) as outputs:
            async for output in outputs:
                yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(plans))

    async def pump(index, ids, params):
        try:
            async with contextlib.aclosing(outputs_of(engine, ids, params, prefix, on_finished, shown)) as outputs:
                async for output in outputs:
                    await queue.put((index, output))
        except asyncio.CancelledError:
            raise
        except Exception as error:  # hand the failure to the consumer
            await queue.put((index, error))

    tasks = [asyncio.create_task(pump(i, ids, params)) for i, (ids, params) in enumerate(plans)]
    try:
        done = 0
        while done < len(plans):
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            done += item.finished
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def outputs_of(engine: EngineClient, ids, params, prefix: str, on_finished: OnFinished, shown=None
                     ) -> AsyncIterator[RequestOutput]:
    """One request's outputs, as ``shown(output)`` presents them to the client and to
    ``on_finished`` (called with the last output and each choice's (tokens, finish reason));
    RequestError for a request the engine refused or stopped part-way (it outgrew the KV
    cache). Closing this iterator aborts the request."""
    choices: dict[int, tuple[int, str | None]] = {}  # over all outputs
    try:
        async with contextlib.aclosing(engine.generate(ids, params, response_id(prefix))) as outputs:
            async for output in outputs:
                output = shown(output) if shown is not None else output
                for c in output.outputs:  # outputs that are deltas add up; a final one is the whole
                    choices[c.index] = (choices.get(c.index, (0, None))[0] + len(c.token_ids), c.finish_reason)
                if output.finished:
                    on_finished(output, [choices[i] for i in sorted(choices)])
                if output.error is not None:
                    raise RequestError(output.error)
                yield output
    except InvalidRequestError as error:
        raise RequestError(str(error)) from None


async def finals(engine: EngineClient, plans, prefix: str, on_finished: OnFinished, shown=None
                 ) -> list[RequestOutput]:
    """The final output of every planned request (a response that is not streamed): the
    engine builds no other (``RequestOutputKind.FINAL_ONLY``)."""
    plans = [(ids, final_only(params)) for ids, params in plans]
    last: dict[int, RequestOutput] = {}
    async for index, output in merged(engine, plans, prefix, on_finished, shown):
        if output.finished:
            last[index] = output
    return [last[i] for i in range(len(plans))]
