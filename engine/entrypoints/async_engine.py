"""The engine loop on a background thread, with each request's outputs as an async stream.

Only the loop thread touches the ``LLMEngine``; the asyncio side sends it requests and aborts
through a queue and receives outputs through ``call_soon_threadsafe``. A consumer that stops
listening (a client that disconnects) aborts its request, which frees its blocks. A consumer
that falls behind gets the outputs it missed as one (:class:`_Stream`), as vLLM's does.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import operator
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

from engine.core.scheduler import InvalidRequestError, SchedulerState, SchedulerStats
from engine.core.scheduler import stats as scheduler_stats
from engine.entrypoints.engine_loop import IDLE_WAIT_SECONDS, STOP, Abort, Add, Delivery, EngineLoop
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput, joined_deltas
from engine.sampling_params import RequestOutputKind

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state after its latest step, for metrics and health. Taken after every step
    at no cost: it keeps the scheduler's state (immutable, so safe to read from the server's
    thread) and the counters; ``scheduler``, which walks every block table, is computed when
    read (a metrics scrape), not per step."""

    state: SchedulerState | None  # None once detached
    prompt_tokens: int
    generation_tokens: int
    steps: int
    time: float

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineSnapshot:
        counters = engine.counters
        return cls(engine.state, counters.prompt_tokens, counters.generation_tokens, counters.steps, time.time())

    @functools.cached_property
    def scheduler(self) -> SchedulerStats:
        """Queues, preemptions, KV use and block accounting (``LLMEngine.stats()``) at the snapshot."""
        return scheduler_stats(self.state)

    def detached(self) -> EngineSnapshot:
        """This snapshot without the scheduler's state, its numbers computed now: what the
        server of an engine in another process receives (a few hundred bytes to send)."""
        stats = self.scheduler
        detached = dataclasses.replace(self, state=None)
        detached.__dict__["scheduler"] = stats  # the cached property, filled
        return detached


class EngineClient:
    """What the server's side of an engine loop does wherever the engine runs: each request's
    outputs as an async stream (:meth:`generate`), aborts, and the outputs of each step handed
    to their streams in one wake-up of each event loop (:meth:`_deliver_all`). Subclasses say
    how a message reaches the engine (:meth:`_send`) and whether it is running."""

    engine: object  # the LLMEngine, or what the server may read of it (EngineView)
    snapshot: object  # the engine's state after its latest step, for metrics

    def __init__(self):
        self._streams: dict[str, tuple[_Stream, asyncio.AbstractEventLoop]] = {}
        self.error: BaseException | None = None

    async def generate(self, prompt, sampling_params, request_id: str) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its output each time the engine returns one (each step it
        changes, or as ``stream_interval`` spaces them), the last one finished. Outputs that
        came while the caller was busy come as one: deltas joined, of cumulative outputs the
        latest.
        ``prompt``: text, token ids, or vLLM's ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``
        (:mod:`engine.inputs`); ``sampling_params``: ``SamplingParams`` (its ``output_kind``
        chooses cumulative outputs, deltas or the final one only) or ``BeamSearchParams``.

        Raises what ``LLMEngine.add_request`` raises for a bad request (nothing is queued),
        and RuntimeError when the engine has stopped. Stopping the iteration early aborts the
        request.
        """
        if not self.is_healthy:
            raise RuntimeError("the engine has stopped" + (f" after an error: {self.error}" if self.error else ""))
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already running; give each request its own")
        stream = _Stream(_merge_for(sampling_params))
        self._streams[request_id] = (stream, asyncio.get_running_loop())
        if self.error is not None:  # the engine failed as the stream was made: no one would end it
            self._streams.pop(request_id, None)
            raise RuntimeError(f"the engine has stopped after an error: {self.error}")
        finished = False
        try:
            self._send(Add(request_id, prompt, sampling_params))
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (safe from any thread)."""
        self._streams.pop(request_id, None)
        self._send(Abort(request_id))

    @property
    def is_healthy(self) -> bool:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    def _send(self, message) -> None:
        """Hand ``message`` (``Add``, ``Abort`` or ``STOP``) to the engine loop (any thread)."""
        raise NotImplementedError

    def _failed(self, error: BaseException) -> None:
        """The engine is gone: every stream, whether its request ran yet or not, gets ``error``."""
        self.error = error
        self._deliver_all([(request_id, RuntimeError(f"engine failed: {error}"), True)
                           for request_id in list(self._streams)])

    def _deliver_all(self, items: list[Delivery]) -> None:
        """Each (request id, output or error, whether it is the last) to its request's stream:
        one wake-up of each event loop for all of them (a wake-up per output is a write to the
        loop's pipe, per request per step)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item, last in items:
            target = self._streams.get(request_id)
            if target is None:
                continue
            if last:
                self._streams.pop(request_id, None)
            by_loop.setdefault(target[1], []).append((request_id, target[0], item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the callers' event loop is gone
                for request_id, _, _ in items:
                    self.abort(request_id)


class AsyncLLMEngine(EngineClient):
    """``async for output in engine.generate(prompt, sampling_params, request_id)`` while other
    requests run (vLLM's ``AsyncLLMEngine``), the engine stepped on a thread of this process
    (:class:`engine.entrypoints.engine_loop.EngineLoop`). For an engine in a process of its
    own: :class:`engine.entrypoints.engine_process.EngineProcess`."""

    def __init__(self, engine: LLMEngine):
        super().__init__()
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self.snapshot = self._snapshot()
        self._engine_loop = EngineLoop(engine, self._deliver_all)
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._send(STOP)
        self._thread.join(timeout=30)

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def _send(self, message) -> None:
        self._inbox.put(message)

    def _loop(self) -> None:
        try:
            self._engine_loop.run(self._receive, self._step, self._changed)
        except BaseException as error:  # the loop must not die silently: fail every waiting request
            log.exception("engine loop failed")
            self._failed(error)

    def _step(self) -> None:
        self._engine_loop.step()
        self.snapshot = self._snapshot()

    def _changed(self) -> None:
        self.snapshot = self._snapshot()

    def _receive(self, block: bool) -> list:
        """The messages in the inbox; with ``block``, waiting a while for the first."""
        try:
            messages = [self._inbox.get(timeout=IDLE_WAIT_SECONDS) if block else self._inbox.get_nowait()]
        except queue.Empty:
            return []
        while messages[-1] is not STOP:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        return messages

    def _snapshot(self) -> EngineSnapshot:
        return EngineSnapshot.of(self.engine)


class _Stream:
    """A request's outputs that its caller has not read yet, on the caller's event loop.
    Outputs that come while the ones before are still unread are read as one
    (:func:`_merge_for`): a caller that cannot keep up with the engine (hundreds of streams
    on one event loop, a slow client) reads what it missed in one piece, and builds one
    response chunk for it instead of one per step. An error is never merged: it comes after
    the outputs before it."""

    __slots__ = ("_items", "_merge", "_ready")

    def __init__(self, merge: Callable[[list[RequestOutput]], RequestOutput]):
        self._items: collections.deque = collections.deque()  # lists of unread outputs, and errors
        self._merge = merge
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        items = self._items
        if isinstance(item, BaseException):
            items.append(item)
        elif items and isinstance(items[-1], list):
            items[-1].append(item)
        else:
            items.append([item])
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        return item if isinstance(item, BaseException) else self._merge(item)


def _merge_for(params) -> Callable[[list[RequestOutput]], RequestOutput]:
    """How unread outputs of a request with ``params`` become one: deltas joined
    (:func:`engine.outputs.joined_deltas`); otherwise (cumulative, final only, beam search)
    the last, which holds everything the ones before do."""
    if getattr(params, "output_kind", None) is RequestOutputKind.DELTA:
        return joined_deltas
    return operator.itemgetter(-1)


def _put_all(items: list[tuple[str, _Stream, object]]) -> None:
    for _, stream, item in items:
        stream.put(item)
