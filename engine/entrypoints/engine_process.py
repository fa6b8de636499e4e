"""The engine in a process of its own, for the server (vLLM V1's engine core process).

With :class:`engine.entrypoints.async_engine.AsyncLLMEngine` the engine's thread and the
server's event loop share one interpreter lock: at hundreds of streams the handlers' work
(a response chunk per output) and the engine's (planning, dispatching, recording) take
turns, and a step takes the sum of both. :class:`EngineProcess` runs the same loop
(:class:`engine.entrypoints.engine_loop.EngineLoop`) in a child process: the parent sends it
requests and aborts over a pipe, and a thread of the parent hands each step's outputs to
their streams. A stream that falls behind gets what it missed merged, so the engine no
longer waits for the slowest reader.

The child is started with ``spawn`` (JAX does not survive a fork) and builds the
``LLMEngine`` from the ``EngineConfig``; the parent never touches a device. What the server
reads of the engine (its tokenizer, limits, sampling defaults, the checks a request must
pass before it streams) comes back once as an :class:`EngineView`; the scheduler's numbers
for ``/metrics`` come with the outputs, at most every :data:`STATS_SECONDS` and whenever the
engine falls idle. A request is checked here and again by the child's ``add_request``, so a
structured output's grammar compiles in both processes (in the child, on the engine's loop,
as it does with the thread when the server has not checked it first).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import multiprocessing
import pickle
import queue
import signal
import sys
import threading
import time

from engine import input_checks, structured_output
from engine.config import EngineConfig
from engine.entrypoints.async_engine import EngineClient, EngineSnapshot
from engine.entrypoints.engine_loop import IDLE_WAIT_SECONDS, STOP, Add, Delivery, EngineLoop
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

log = logging.getLogger(__name__)

STATS_SECONDS = 0.2  # the longest the scheduler's numbers for /metrics go unsent while requests run
START_SECONDS = 3600  # the longest the child may take to load and warm up before the server gives up
READ_BATCH = 64  # the most messages the parent's reader delivers in one go


@dataclasses.dataclass(frozen=True)
class EngineView:
    """What the server reads of an ``LLMEngine`` in another process (the same names), made
    once in the child; the checks run here, before a request is sent."""

    config: EngineConfig
    model_config: object
    tokenizer: object
    max_model_len: int
    default_sampling: dict
    eos_token_ids: tuple[int, ...]
    kv_capacity_tokens: int
    kv_cache_size: object
    warmup_seconds: float

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineView:
        return cls(engine.config, engine.model_config, engine.tokenizer, engine.max_model_len, engine.default_sampling,
                   engine.eos_token_ids, engine.kv_capacity_tokens, engine.kv_cache_size, engine.warmup_seconds)

    @functools.cached_property
    def grammars(self) -> structured_output.Grammars | None:
        return None if self.tokenizer is None else structured_output.Grammars(
            self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)

    def check_prompt(self, token_ids: list[int], request_id: str = "") -> None:
        """``LLMEngine.check_prompt``."""
        input_checks.check_prompt(token_ids, request_id, max_model_len=self.max_model_len,
                                  vocab_size=self.model_config.vocab_size)

    def check_params(self, params, request_id: str = "") -> None:
        """``LLMEngine.check_params``."""
        input_checks.check_params(params, request_id, max_num_seqs=self.config.max_num_seqs,
                                  vocab_size=self.model_config.vocab_size, tokenizer=self.tokenizer,
                                  grammars=self.grammars, max_logprobs=self.config.max_logprobs)


class EngineStartError(RuntimeError):
    """The engine process died or hung before its engine was ready (its log says why)."""


class EngineProcess(EngineClient):
    """``AsyncLLMEngine``'s interface (``generate``, ``abort``, ``shutdown``, ``is_healthy``,
    ``error``, ``snapshot``, and ``engine``: an :class:`EngineView`) over an engine built from
    ``config`` in a child process. Raises what ``LLMEngine(config)`` raised there (a model
    that cannot load, a bad setting), or :class:`EngineStartError`.

    Two threads of this process talk to the child: one sends what :meth:`_send` queues (so a
    large prompt never blocks the caller's event loop on a full pipe), one reads its outputs
    (:meth:`_read`); neither waits on the other."""

    def __init__(self, config: EngineConfig):
        super().__init__()
        context = multiprocessing.get_context("spawn")
        requests_out, requests_in = context.Pipe(duplex=False)  # (receiving end, sending end)
        outputs_out, outputs_in = context.Pipe(duplex=False)
        self._process = context.Process(target=serve_engine, name="engine-core", daemon=True,
                                        args=(config, requests_out, outputs_in, logging.getLogger().level))
        self._process.start()
        requests_out.close()
        outputs_in.close()
        self._requests, self._outputs, self._outbox = requests_in, outputs_out, queue.Queue()
        self._prompts: dict[str, tuple] = {}  # per running request: (prompt text, prompt token ids)
        try:
            self.engine, self.snapshot = self._started()
        except BaseException:
            self._close()
            raise
        self._threads = [threading.Thread(target=self._write, name="engine-requests", daemon=True),
                         threading.Thread(target=self._read, name="engine-outputs", daemon=True)]
        for thread in self._threads:
            thread.start()

    def _started(self) -> tuple[EngineView, EngineSnapshot]:
        """The child's view of its engine once it is ready, or what stopped it."""
        try:
            if not self._outputs.poll(START_SECONDS):
                raise EngineStartError(f"the engine process did not start within {START_SECONDS} s")
            kind, *payload = self._outputs.recv()
        except (EOFError, OSError):
            kind, payload = "died", []
        if kind == "ready":
            return payload[0], payload[1]
        self._process.join(timeout=10)
        if kind == "refused":
            raise payload[0]
        raise EngineStartError(f"the engine process exited while starting (exit code {self._process.exitcode}); "
                               "its log says why")

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self._process.is_alive()

    def shutdown(self) -> None:
        self._send(STOP)
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.terminate()
        for thread in self._threads:
            thread.join(timeout=5)
        self._close()

    def _close(self) -> None:
        if self._process.is_alive():
            self._process.terminate()
        self._requests.close()
        self._outputs.close()

    def _send(self, message) -> None:
        self._outbox.put(message)

    def _write(self) -> None:
        """Send each queued message to the child until STOP, or until the child is gone (the
        reader then fails every stream)."""
        while True:
            message = self._outbox.get()
            try:
                self._requests.send(message)
            except (OSError, ValueError):  # the child, or the pipe, is gone
                return
            if message is STOP:
                return

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self._prompts.pop(request_id, None)

    def _read(self) -> None:
        """Hand each batch of the child's outputs to their streams until it stops; then, or if
        anything here fails, every stream still open gets the error."""
        try:
            while self._read_batch():
                pass
        except BaseException as error:  # a reader that dies must not leave streams waiting
            log.exception("reading the engine process's outputs failed")
            self._failed(error)
            if self._process.is_alive():
                self._process.terminate()
            return
        self._process.join(timeout=5)
        code = self._process.exitcode
        self._failed(self.error or RuntimeError("the engine process stopped" if code in (0, None)
                                                else f"the engine process exited (exit code {code})"))

    def _read_batch(self) -> bool:
        """Deliver the messages waiting (up to :data:`READ_BATCH`: each wake-up drains the pipe,
        so the child's sends do not wait on this thread's turns at the interpreter lock);
        False once the child's end is closed (what came before it is delivered)."""
        messages, open_ = [], True
        try:
            messages.append(self._outputs.recv())
            while len(messages) < READ_BATCH and self._outputs.poll():
                messages.append(self._outputs.recv())
        except (EOFError, OSError):
            open_ = False
        deliveries = []
        for kind, *payload in messages:
            if kind == "failed":
                self._deliver_all(deliveries)
                deliveries = []
                self._failed(RuntimeError(payload[0]))
                continue
            wires, snapshot = payload
            if snapshot is not None:
                self.snapshot = snapshot
            deliveries.extend(self._delivery(*wire) for wire in wires)
        self._deliver_all(deliveries)
        return open_

    def _delivery(self, request_id: str, item, last: bool) -> Delivery:
        """A delivery as the child sent it (:func:`_wire_output`) with its ``RequestOutput`` made again."""
        if isinstance(item, tuple):
            prompt, completions, finished, prompt_logprobs, error, metrics, cached = item
            if prompt is not None and request_id in self._streams:
                self._prompts[request_id] = prompt
                if request_id not in self._streams:  # aborted meanwhile (abort pops the stream first)
                    self._prompts.pop(request_id, None)
            text, ids = prompt if prompt is not None else self._prompts.get(request_id, (None, ()))
            item = RequestOutput(request_id, text, ids, tuple(CompletionOutput(*c) for c in completions), finished,
                                 prompt_logprobs, error, None if metrics is None else RequestMetrics(*metrics), cached)
        if last:
            self._prompts.pop(request_id, None)
        return request_id, item, last


def _wire_output(output: RequestOutput, with_prompt: bool) -> tuple:
    """``output`` as plain tuples (a tenth of its pickle's bytes and time), the prompt only
    with a request's first (:meth:`EngineProcess._delivery` makes it again)."""
    metrics = output.metrics
    return ((output.prompt, output.prompt_token_ids) if with_prompt else None,
            tuple((c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason)
                  for c in output.outputs),
            output.finished, output.prompt_logprobs, output.error,
            None if metrics is None else (metrics.arrival_time, metrics.first_token_time, metrics.finished_time),
            output.num_cached_tokens)


def _wire_error(error: BaseException) -> BaseException:
    """``error`` if it survives pickling (the usual case: the engine's own errors); otherwise a
    RuntimeError saying what it was, so that one odd error cannot stop the child's sends."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def serve_engine(config: EngineConfig, requests, outputs, log_level: int = logging.INFO) -> None:
    """The child's main: build the engine, say it is ready (or why it is not), then run its
    loop (:class:`_Child`), logging at the parent's ``log_level``. Ctrl-C is the parent's to
    handle: it stops the child (``STOP``); a parent that dies closes the pipe, which stops it too."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = LLMEngine(config)
    except Exception as error:  # the parent raises it: a model that cannot load, a bad setting
        outputs.send(("refused", _wire_error(error)))
        return
    outputs.send(("ready", EngineView.of(engine), EngineSnapshot.of(engine).detached()))
    if not _Child(engine, requests, outputs).run():
        sys.exit(1)


class _Child:
    """The engine's loop in the child: messages from ``requests``, each round's deliveries
    (outputs as :func:`_wire_output` tuples) and, now and then, the scheduler's numbers sent to
    ``outputs`` in one message."""

    def __init__(self, engine: LLMEngine, requests, outputs):
        self.engine, self.requests, self.outputs = engine, requests, outputs
        self.loop = EngineLoop(engine, self.deliver)
        self.pending: list[Delivery] = []
        self.prompt_sent: set[str] = set()  # requests whose prompt went with an output
        self.stats_sent = time.monotonic()

    def run(self) -> bool:
        """Until STOP; False if the loop failed (the parent is told, and every live request)."""
        try:
            self.loop.run(self.receive, changed=self.flush)
            return True
        except BaseException as error:
            log.exception("engine loop failed")
            with contextlib.suppress(Exception):
                self.loop.fail_all(error)
                self.flush()
                self.outputs.send(("failed", f"{type(error).__name__}: {error}"))
            return False

    def deliver(self, deliveries: list[Delivery]) -> None:
        for request_id, item, last in deliveries:
            if isinstance(item, RequestOutput):
                item = _wire_output(item, request_id not in self.prompt_sent)
                self.prompt_sent.add(request_id)
            elif isinstance(item, BaseException):
                item = _wire_error(item)
            if last:
                self.prompt_sent.discard(request_id)
            self.pending.append((request_id, item, last))

    def receive(self, block: bool) -> list:
        messages = []
        try:
            if self.requests.poll(IDLE_WAIT_SECONDS if block else 0):
                messages.append(self.requests.recv())
                while messages[-1] is not STOP and self.requests.poll():
                    messages.append(self.requests.recv())
        except (EOFError, OSError):  # the parent is gone
            messages.append(STOP)
        for message in messages:
            if isinstance(message, Add):  # (an id used again after an abort gets its prompt sent again)
                self.prompt_sent.discard(message.request_id)
        return messages

    def flush(self) -> None:
        stats, now = None, time.monotonic()
        if not self.engine.has_unfinished_requests() or now - self.stats_sent >= STATS_SECONDS:
            stats, self.stats_sent = EngineSnapshot.of(self.engine).detached(), now
        if self.pending or stats is not None:
            self.outputs.send(("outputs", list(self.pending), stats))
            self.pending.clear()
        if len(self.prompt_sent) > 2 * len(self.loop.live) + 64:  # forget aborted requests
            self.prompt_sent.intersection_update(self.loop.live)
