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
engine falls idle.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import multiprocessing
import signal
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


class EngineProcess(EngineClient):
    """``AsyncLLMEngine``'s interface (``generate``, ``abort``, ``shutdown``, ``is_healthy``,
    ``error``, ``snapshot``, and ``engine``: an :class:`EngineView`) over an engine built from
    ``config`` in a child process. Raises what ``LLMEngine(config)`` raised there (a model
    that cannot load, a bad setting), or RuntimeError if the child died before it was ready."""

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
        self._requests, self._outputs, self._send_lock = requests_in, outputs_out, threading.Lock()
        self._prompts: dict[str, tuple] = {}  # per running request: (prompt text, prompt token ids)
        try:
            self.engine, self.snapshot = self._started()
        except BaseException:
            requests_in.close()
            outputs_out.close()
            raise
        self._reader = threading.Thread(target=self._read, name="engine-outputs", daemon=True)
        self._reader.start()

    def _started(self) -> tuple[EngineView, EngineSnapshot]:
        """The child's view of its engine once it is ready, or what stopped it."""
        try:
            if not self._outputs.poll(START_SECONDS):
                raise RuntimeError(f"the engine process did not start within {START_SECONDS} s")
            kind, *payload = self._outputs.recv()
        except EOFError:
            kind, payload = "died", []
        if kind == "ready":
            return payload[0], payload[1]
        self._process.join(timeout=10)
        if kind == "refused":
            raise payload[0]
        raise RuntimeError(f"the engine process exited while starting (exit code {self._process.exitcode}); "
                           "its log says why")

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self._process.is_alive()

    def shutdown(self) -> None:
        self._send(STOP)
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.terminate()
        self._reader.join(timeout=5)

    def _send(self, message) -> None:
        try:
            with self._send_lock:
                self._requests.send(message)
        except OSError as error:  # the child is gone: nothing left to abort or stop
            if isinstance(message, Add):
                raise RuntimeError(f"the engine has stopped: {self.error or error}") from error

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self._prompts.pop(request_id, None)

    def _read(self) -> None:
        """Hand the outputs of every message waiting to their streams, until the child stops;
        if it died, every stream gets the error. Each wake-up drains the pipe, so that the
        child's sends never wait on this thread's turn at the interpreter lock for long."""
        while True:
            try:
                messages = [self._outputs.recv()]
                while self._outputs.poll():
                    messages.append(self._outputs.recv())
            except (EOFError, OSError):
                self._stopped()
                return
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

    def _stopped(self) -> None:
        """The child's end of the pipe closed: after a shutdown, or because it died."""
        self._process.join(timeout=5)
        if self.error is None:
            code = self._process.exitcode
            self._failed(RuntimeError("the engine process stopped" if code in (0, None)
                                      else f"the engine process exited (exit code {code})"))

    def _delivery(self, request_id: str, item, last: bool) -> Delivery:
        """A delivery as the child sent it (:func:`_wire_output`) with its ``RequestOutput`` made again."""
        if isinstance(item, tuple):
            prompt, completions, finished, prompt_logprobs, error, metrics, cached = item
            if prompt is not None and request_id in self._streams:
                self._prompts[request_id] = prompt
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


def serve_engine(config: EngineConfig, requests, outputs, log_level: int = logging.INFO) -> None:
    """The child's main: build the engine, say it is ready (or why it is not), then run its
    loop on the messages from ``requests``, each round's deliveries sent to ``outputs`` in one
    message, logging at the parent's ``log_level``. Ctrl-C is the parent's to handle: it stops
    the child (``STOP``), and a parent that dies closes the pipe, which stops it too."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = LLMEngine(config)
    except Exception as error:  # the parent raises it: a model that cannot load, a bad setting
        outputs.send(("refused", error))
        return
    outputs.send(("ready", EngineView.of(engine), EngineSnapshot.of(engine).detached()))
    pending: list[Delivery] = []
    sent_stats = [time.monotonic()]
    prompt_sent: set[str] = set()  # requests whose prompt went with an output

    def deliver(deliveries: list[Delivery]) -> None:
        for request_id, item, last in deliveries:
            if isinstance(item, RequestOutput):
                item = _wire_output(item, request_id not in prompt_sent)
                prompt_sent.add(request_id)
            if last:
                prompt_sent.discard(request_id)
            pending.append((request_id, item, last))

    def receive(block: bool) -> list:
        messages = []
        try:
            if requests.poll(IDLE_WAIT_SECONDS if block else 0):
                messages.append(requests.recv())
                while messages[-1] is not STOP and requests.poll():
                    messages.append(requests.recv())
        except (EOFError, OSError):  # the parent is gone
            messages.append(STOP)
        return messages

    def flush() -> None:
        now = time.monotonic()
        stats = None
        if not engine.has_unfinished_requests() or now - sent_stats[0] >= STATS_SECONDS:
            stats, sent_stats[0] = EngineSnapshot.of(engine).detached(), now
        if pending or stats is not None:
            outputs.send(("outputs", list(pending), stats))
            pending.clear()
        if len(prompt_sent) > 2 * len(loop.live) + 64:  # forget aborted requests
            prompt_sent.intersection_update(loop.live)

    loop = EngineLoop(engine, deliver)
    try:
        loop.run(receive, changed=flush)
    except BaseException as error:
        log.exception("engine loop failed")
        loop.fail_all(error)
        flush()
        outputs.send(("failed", f"engine failed: {error}"))
