"""The engine's side of the server's loop: requests and aborts in, outputs out. It runs on a
thread of the server's process (:class:`engine.entrypoints.async_engine.AsyncLLMEngine`) or in a
process of its own (:mod:`engine.entrypoints.engine_process`); either way only it touches the
``LLMEngine``, and what it hands out is a batch of deliveries per step."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

from engine import gc_freeze
from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

IDLE_WAIT_SECONDS = 0.5  # how long an idle loop waits for a message before it looks again


@dataclasses.dataclass(frozen=True)
class Add:
    """Queue a request (``LLMEngine.add_request``'s arguments)."""

    request_id: str
    prompt: object
    params: object


@dataclasses.dataclass(frozen=True)
class Abort:
    request_id: str


STOP = None  # the message that ends the loop

# (request id, its output or the error that ends it, whether it is the request's last)
Delivery = tuple[str, object, bool]


class EngineLoop:
    """Steps ``engine`` while it has requests, taking messages (:class:`Add`, :class:`Abort`,
    :data:`STOP`) between steps; each step's outputs, and each error that ends a request, go
    to ``deliver`` in one list. A request is *live* from its :class:`Add` until its last
    delivery or its :class:`Abort`."""

    def __init__(self, engine: LLMEngine, deliver: Callable[[list[Delivery]], None]):
        self.engine = engine
        self.deliver = deliver
        self.live: set[str] = set()

    def run(self, receive: Callable[[bool], Sequence[object]], step: Callable[[], None] | None = None,
            changed: Callable[[], None] = lambda: None) -> None:
        """Until :data:`STOP` comes: ``receive(block)`` gives the messages waiting (waiting up
        to :data:`IDLE_WAIT_SECONDS` for one when ``block``: the engine is idle and has nothing
        left to warm up); ``step()`` (:meth:`step`, unless given) follows whenever a request
        runs; ``changed()`` after each round that handled a message or stepped."""
        step = step or self.step
        with gc_freeze.older_objects_frozen():  # the collector skips the loaded engine
            while True:
                idle = not self.engine.has_unfinished_requests()
                # Idle time compiles what the start-up left out, one short program at a time.
                messages = receive(idle and not self.engine.warm_up_when_idle())
                for message in messages:
                    if message is STOP:
                        return
                    self.handle(message)
                if self.engine.has_unfinished_requests():
                    step()
                elif not messages:
                    continue
                changed()

    def handle(self, message: Add | Abort) -> None:
        """Queue or abort a request; a request ``add_request`` refuses gets its error."""
        if isinstance(message, Abort):
            if message.request_id in self.live:
                self.live.discard(message.request_id)
                self.engine.abort_request(message.request_id)
            return
        was_live = message.request_id in self.live
        self.live.add(message.request_id)
        try:
            self.engine.add_request(message.request_id, message.prompt, message.params)
        except Exception as error:  # a bad request: tell its caller, keep serving
            if not was_live:  # (a request under the same id, still running, stays live)
                self.live.discard(message.request_id)
            self.deliver([(message.request_id, error, True)])

    def step(self) -> None:
        """One engine step. A step that fails has aborted the requests it ran (see
        ``LLMEngine.step``): they get the error, and the others keep going."""
        try:
            outputs = self.engine.step()
        except Exception as error:
            log.exception("engine step failed")
            failed = [r for r in self.live if r not in self.engine.requests]
            self.live.difference_update(failed)
            self.deliver([(r, RuntimeError(f"engine step failed: {error}"), True) for r in failed])
            return
        for output in outputs:
            if output.finished:
                self.live.discard(output.request_id)
        self.deliver([(output.request_id, output, output.finished) for output in outputs])

    def fail_all(self, error: BaseException) -> None:
        """The loop died of ``error``: every live request gets it."""
        failed, self.live = list(self.live), set()
        self.deliver([(r, RuntimeError(f"engine failed: {error}"), True) for r in failed])
