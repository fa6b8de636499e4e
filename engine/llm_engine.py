"""The engine loop: one iteration of continuous batching per ``step()``.

    scheduler decides → cache engine moves blocks → runner computes logits → sampler picks
    → requests record text and stop → scheduler records

``LLMEngine`` is the one place with side effects: it owns the device caches, the compiled
programs, the scheduler's (immutable) state and each request's progress.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time

import jax
import numpy as np

import models
from engine import async_scheduling, input_checks, multi_step, stats_logger, structured_output
from engine.config import EngineConfig
from engine.core import scheduled_rows, scheduler
from engine.core.scheduler import InvalidRequestError
from engine.inputs import PromptType, prompt_input
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.request_state import RequestState
from engine.sampling_params import BeamSearchParams, SamplingParams
from engine.worker import huge_pages, kv_cache_size, model_loader, sampling_rows, tensor_parallel
from engine.worker.cache_engine import CacheEngine, kv_cache_spec
from engine.worker.model_runner import ModelRunner

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineCounters:
    """Totals since start, for metrics."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    lookahead_steps: int = 0  # steps whose work an earlier lookahead had computed
    multi_steps: int = 0  # steps run as a multi-step decode (num_scheduler_steps)


class LLMEngine:
    """Requests in, ``RequestOutput``s out, one batched model step at a time."""

    def __init__(self, config: EngineConfig):
        start = time.monotonic()
        model_loader.use_compilation_cache()
        config.check_platform(jax.default_backend())
        self.config = config
        _seed_global_generators(config.seed)
        self._model = model_loader.load_shared(config.model, config.param_dtype,
                                               tensor_parallel_size=config.tensor_parallel_size)
        self.model_config, params, self.tokenizer = self._model.loaded
        if config.tokenizer is not None:
            self.tokenizer = models.load_tokenizer(config.tokenizer)
        tensor_parallel.check_divisible(self.model_config, config.tensor_parallel_size)
        mesh = tensor_parallel.make_mesh(config.tensor_parallel_size)
        params = tensor_parallel.place_params(params, mesh)
        self.kv_cache_size = self._kv_cache_size(config, params, mesh)
        spec = kv_cache_spec(self.model_config, config.block_size, config.cache_dtype, self.kv_cache_size.num_blocks)
        self.scheduler_config = config.scheduler_config(self.model_config, spec.num_blocks, spec.bytes_per_block)
        self.max_model_len = self.scheduler_config.max_model_len
        if self.max_model_len < config.model_len(self.model_config):
            log.warning("the KV cache holds %d tokens for one sequence, fewer than max_model_len %d: max_model_len "
                        "is lowered to that (give the cache more blocks to keep it)", self.max_model_len,
                        config.model_len(self.model_config))
        self.cache = CacheEngine(spec, self.scheduler_config.block_manager.num_host_blocks,
                                 tensor_parallel.cache_sharding(mesh))
        self.runner = ModelRunner(self.model_config, params, block_size=config.block_size,
                                  max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
                                  max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens, mesh=mesh)
        self._huge_pages = huge_pages.start(self.runner.params)  # meanwhile, the warm-up compiles
        loaded = time.monotonic()
        self._sampler_sizes = frozenset(self.runner.logits_sizes())
        # Sampler programs left for idle time (:meth:`warm_up_when_idle`), smallest batch first.
        self._idle_warm_ups: list[int] = []
        if config.compiles_at_start:
            self.runner.warm_up(self.cache.kv_caches, config.num_scheduler_steps if mesh is None else 1)
            if mesh is None:  # under a mesh the logits carry its sharding: compiled on first use
                sampling_rows.warm_up(self.model_config.vocab_size, self._sampler_sizes)
                self._idle_warm_ups = sorted(self._sampler_sizes)
        self.warmup_seconds = time.monotonic() - loaded
        self.startup_seconds = time.monotonic() - start
        self.state = scheduler.initial_state(self.scheduler_config)
        self.requests: dict[str, RequestState] = {}
        self.counters = EngineCounters()
        self._output_processor = OutputProcessor(self.tokenizer, self.counters, config.stream_interval)
        self._stats_logger = None if config.disable_log_stats else stats_logger.StatsLogger(config.log_stats_interval)
        self._lookahead: async_scheduling.Lookahead | None = None
        # Neither under a mesh (untested there).
        self._num_steps = config.num_scheduler_steps if mesh is None else 1
        self._async = config.async_scheduling and mesh is None
        self._seeds = np.random.default_rng(config.seed)
        # Any end of sequence the checkpoint names: config, generation config and tokenizer (as vLLM).
        tokenizer_eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_ids = tuple(dict.fromkeys(
            self.model_config.eos_token_ids + (() if tokenizer_eos is None else (tokenizer_eos,))))
        self.default_sampling = models.sampling_defaults(config.model) if config.generation_config == "auto" else {}
        self.grammars = None if self.tokenizer is None else structured_output.Grammars(
            self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        log.info("engine ready in %.1f s (warm-up %.1f s): %d KV tokens in %d blocks, sized by %s",
                 self.startup_seconds, self.warmup_seconds, spec.num_slots, spec.num_blocks, self.kv_cache_size.reason)

    def _kv_cache_size(self, config: EngineConfig, params, mesh) -> kv_cache_size.KVCacheSize:
        """How many device blocks (:mod:`engine.worker.kv_cache_size`), with the weights ``params`` in place."""
        one_block = kv_cache_spec(self.model_config, config.block_size, config.cache_dtype)
        devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()[:1]

        def activation_bytes() -> int:
            largest = ModelRunner(self.model_config, params, block_size=config.block_size,
                                  max_model_len=config.model_len(self.model_config), max_num_seqs=config.max_num_seqs,
                                  max_num_batched_tokens=config.batched_tokens, mesh=mesh)
            layer = jax.ShapeDtypeStruct(one_block.layer_shape, one_block.dtype,
                                         sharding=tensor_parallel.cache_sharding(mesh))
            model = largest.activation_bytes([(layer, layer)] * one_block.num_layers)
            return model + sampling_rows.activation_bytes(self.model_config.vocab_size, max(largest.logits_sizes()))

        return kv_cache_size.choose(num_blocks=config.num_blocks, kv_cache_memory=config.kv_cache_memory,
                                    utilization=config.gpu_memory_utilization,
                                    bytes_per_block=one_block.bytes_per_block,
                                    devices=[kv_cache_size.DeviceMemory.of(d) for d in devices],
                                    activation_bytes=activation_bytes)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.cache.spec.num_slots

    # -- requests ---------------------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer; pass prompt token ids instead of text")
        return self.tokenizer.encode(prompt)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | BeamSearchParams,
                    *, expected_output_len: int | None = None) -> None:
        """Queue a request (``prompt``: text, token ids, or a :mod:`engine.inputs` dict). Raises
        ``InvalidRequestError`` (nothing queued) for a prompt that is empty, too long for
        ``max_model_len``, or holds unknown token ids, or a logit bias on an unknown token."""
        prompt = prompt_input(prompt)
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else prompt
        if isinstance(params, SamplingParams):
            params = params.snapshot()  # the caller may change theirs later (vLLM's are mutable)
            token_ids = params.truncate(token_ids)
        self.check_prompt(token_ids, request_id)
        self.check_params(params, request_id)
        bad_word_ids = params.bad_word_ids(self.tokenizer) if getattr(params, "bad_words", ()) else ()
        width = params.beam_width if isinstance(params, BeamSearchParams) else params.num_candidates
        room = self.max_model_len - len(token_ids)
        max_tokens = min(params.max_tokens or room, room)
        # Prompt log-probabilities need every prompt token's logits, so no prefix-cache hits (as vLLM).
        wants_prompt_logprobs = isinstance(params, SamplingParams) and params.prompt_logprobs is not None
        self.state = scheduler.add_request(self.state, request_id, token_ids, max_tokens=max_tokens, num_seqs=width,
                                     expected_output_len=expected_output_len,
                                     use_prefix_cache=not wants_prompt_logprobs,
                                     may_fork=isinstance(params, BeamSearchParams))
        group = self.state.waiting[-1]  # the request's, just queued
        seed = params.seed % 2**32 if isinstance(params, SamplingParams) and params.seed is not None else int(
            self._seeds.integers(2**31))
        request = RequestState.admitted(request_id, prompt, tuple(token_ids), params, seed=seed,
                                        max_tokens=max_tokens, eos_token_ids=tuple(self.eos_token_ids),
                                        bad_word_ids=bad_word_ids, seq_ids=[seq.seq_id for seq in group.seqs],
                                        grammars=self.grammars)
        self.requests[request_id] = request

    def check_prompt(self, token_ids: list[int], request_id: str = "") -> None:
        """Raise ``InvalidRequestError`` for a prompt ``add_request`` would refuse (safe from any thread)."""
        input_checks.check_prompt(token_ids, request_id, max_model_len=self.max_model_len,
                                  vocab_size=self.model_config.vocab_size)

    def check_params(self, params: SamplingParams | BeamSearchParams, request_id: str = "") -> None:
        """Raise ``InvalidRequestError`` for parameters this engine cannot run: more sequences
        than ``max_num_seqs``, ``bad_words`` or a constraint without a tokenizer or invalid,
        tokens the model does not have."""
        input_checks.check_params(params, request_id, max_num_seqs=self.config.max_num_seqs,
                                  vocab_size=self.model_config.vocab_size, tokenizer=self.tokenizer,
                                  grammars=self.grammars, max_logprobs=self.config.max_logprobs)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free every block it holds."""
        self.state = scheduler.abort(self.state, request_id)
        request = self.requests.pop(request_id, None)
        if request is not None:
            request.aborted = True

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (as vLLM's): later prompts compute every block again. False,
        changing nothing, while requests are running or swapped out."""
        state = scheduler.reset_prefix_cache(self.state)
        if state is None:
            log.warning("the prefix cache was not reset: requests hold blocks")
            return False
        self.state = state
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def warm_ups_left(self) -> int:
        """Programs :meth:`warm_up_when_idle` has still to compile."""
        return len(self._idle_warm_ups)

    def warm_up_when_idle(self) -> bool:
        """Compile one program the start-up left out, if any is: sampling with a temperature,
        for one number of rows (about 0.6 s; 0.1 s from the persistent cache). Returns whether
        it compiled one. For callers with nothing else to do, such as the server between
        requests, so that later steps do not stall on the compiler."""
        if not self._idle_warm_ups:
            return False
        try:
            sampling_rows.warm_up(self.model_config.vocab_size, [self._idle_warm_ups.pop(0)], greedy=False)
        except Exception:  # an optimisation only: steps still compile what they need
            log.exception("warming up the sampler failed; the rest compiles on first use")
            self._idle_warm_ups.clear()
        return True

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the outputs of the requests that changed (of a streamed
        request, only those ``stream_interval`` lets out; of a ``FINAL_ONLY`` one, its last).

        If the step fails part-way (an error, or Ctrl-C), the requests it was running are
        aborted with the error recorded (every request, if the KV cache's contents were
        lost), their blocks are freed, and the exception propagates; the engine stays usable.

        With ``async_scheduling``, a decode step may already have run as the previous step's
        lookahead (:mod:`engine.async_scheduling`): then its tokens are taken instead of running it.
        With ``num_scheduler_steps`` k > 1, a step that only decodes runs up to k decode steps
        (:mod:`engine.multi_step`), and its lookahead is the loop after it.
        """
        ahead, self._lookahead = self._lookahead, None
        num_steps = self._num_steps if self._num_steps > 1 and multi_step.allowed(
            self.state.running_request_ids, self.requests) else 1
        self.state, plan = self._plan(ahead, num_steps)
        touched: dict[str, RequestState] = {}
        for request_id, reason in plan.ignored:
            request = self.requests.get(request_id)
            if request is not None:
                request.error = reason
                touched[request_id] = request
                if any(seq.token_ids for seq in request.seqs.values()) or request.first_token_time is not None:
                    log.warning("request %s stopped before its end: %s", request_id, reason)
        blocks_moved = False
        try:
            if ahead is not None and async_scheduling.computed(ahead, plan):
                blocks_moved = True
                in_flight = ahead.in_flight
                self.counters.lookahead_steps += 1
            else:
                self.cache.apply(plan.blocks_to_swap_out, plan.blocks_to_swap_in, plan.blocks_to_copy)
                blocks_moved = True
                in_flight = self._dispatch(plan.scheduled, plan.num_steps) if plan.scheduled else None
            self.counters.multi_steps += int(plan.num_steps > 1)
            if in_flight is not None and self._async:
                self._lookahead = self._dispatch_lookahead(plan, in_flight)
            actions = self._record(in_flight, touched) if in_flight is not None else []
            self.state = scheduler.update(self.state, actions)
        except BaseException as error:
            self._lookahead = None
            self._recover(plan, error, every_request=not blocks_moved)
            raise
        self.counters.steps += 1
        if self._stats_logger is not None:
            self._stats_logger.maybe_log(self.counters, self.stats)
        return self._collect(touched)

    def _plan(self, ahead: async_scheduling.Lookahead | None, num_steps: int
              ) -> tuple[scheduler.SchedulerState, scheduler.SchedulerOutput]:
        """The scheduler's plan for this step (a multi-step decode of up to ``num_steps`` if it
        only decodes). If it would drop the lookahead ``ahead`` only to
        admit requests that arrived while it ran, they wait a step more instead: the device is
        running that step anyway, and dropping it would cost every running request a step, to
        start the new ones sooner only by the host's turnaround between two steps."""
        state, plan = scheduler.schedule(self.state, num_steps=num_steps)
        if ahead is not None and self.state.waiting and not async_scheduling.computed(ahead, plan):
            deferred, without = scheduler.schedule(self.state, admit=False, num_steps=num_steps)
            if async_scheduling.computed(ahead, without):
                return deferred, without
        return state, plan

    def _recover(self, plan: scheduler.SchedulerOutput, error: BaseException, every_request: bool) -> None:
        """Abort the requests a failed step touched and close the step, so no block stays held.
        Swaps that may not have happened, or caches a failed program consumed, leave no
        request's KV trustworthy: then every request is aborted, and lost caches start afresh."""
        lost = self.cache.lost
        victims = set(self.requests) if every_request or lost else {work.request_id for work in plan.scheduled}
        reason = f"the engine step failed: {error!r}"
        for request_id in victims:
            request = self.requests.get(request_id)
            self.abort_request(request_id)
            if request is not None:
                request.error = reason
        if self.state.pending is not None:
            self.state = scheduler.update(self.state, [])
        if lost:
            self.cache.reset()
            self.state = scheduler.initial_state(self.scheduler_config)
        log.error("step failed (%s); aborted %d requests", reason, len(victims))

    def _dispatch(self, works, num_steps: int = 1
                  ) -> async_scheduling.InFlightStep | multi_step.InFlightSteps | None:
        """Dispatch the model and the sampler for ``works`` (record prompt log-probabilities,
        which wait for the logits); None when nothing samples. ``num_steps`` > 1: the works are
        a multi-step decode."""
        if num_steps > 1:
            in_flight, self.cache.kv_caches = multi_step.dispatch(
                self.runner, self.cache.kv_caches, works, self.requests, self._num_steps, self.model_config.vocab_size)
            return in_flight
        logits_tokens, rows, prompt_rows = sampling_rows.logits_plan(works, self.requests)
        argmax_only = not prompt_rows and sampling_rows.argmax_suffices(rows)
        inputs = self.runner.prepare(works, logits_tokens, argmax_only=argmax_only)
        prefills = [work for work in scheduled_rows.rows_of(works)[1] if work.is_prefill]  # never the rows'
        for work in prefills:
            self.requests[work.request_id].note_computed_prefix(work.start)
        out, self.cache.kv_caches = self.runner.run(inputs, self.cache.kv_caches)
        self.counters.prompt_tokens += sum(len(w.token_ids) for w in prefills)
        if prompt_rows:
            self._output_processor.record_prompt_logprobs(out.logits, prompt_rows)
        if not rows:
            return None
        tables = async_scheduling.block_tables(works)
        if argmax_only and out.argmax is not None and [row.logits_row for row in rows] == list(range(len(rows))):
            # The decode program took each row's arg-max already: no sampler program to wait on.
            return async_scheduling.InFlightStep(tuple(rows), sampling_rows.model_argmax(out.argmax), inputs, None,
                                                 out.next_inputs, tables)
        # Padded to the logits' rows when the warm-up compiled that size; otherwise (the token
        # buckets of prompt logprobs, thousands of rows) to no fewer than the smallest it did.
        logits = out.logits
        pad_to = logits.shape[0] if logits.shape[0] in self._sampler_sizes else min(self._sampler_sizes)
        sampled, batch = sampling_rows.dispatch(logits, rows, pad_to=pad_to)
        return async_scheduling.InFlightStep(tuple(rows), sampled, inputs, batch, out.next_inputs, tables)

    def _dispatch_lookahead(self, plan: scheduler.SchedulerOutput, in_flight) -> async_scheduling.Lookahead | None:
        """Dispatch the step after ``plan``'s, whose sampling ``in_flight`` is, when it can be
        (:func:`engine.async_scheduling.eligible`; after a multi-step decode, the next loop:
        :func:`engine.multi_step.next_works`); None otherwise. With multi-step decode, no
        single-step lookahead: the step after would be a loop."""
        works = plan.scheduled
        if plan.num_steps > 1:
            ahead, self.cache.kv_caches = multi_step.dispatch_lookahead(
                self.runner, self.cache.kv_caches, works, self.requests, self.state, in_flight, self._num_steps)
            return ahead
        if self._num_steps == 1 and async_scheduling.eligible(works, self.requests, self.state, self.config.block_size):
            ahead, self.cache.kv_caches = async_scheduling.dispatch_next(self.runner, self.cache.kv_caches, works,
                                                                         in_flight)
            return ahead
        return None

    def _record(self, in_flight: async_scheduling.InFlightStep | multi_step.InFlightSteps, touched) -> list:
        """Wait for ``in_flight``'s tokens and record them; the scheduler's actions that follow."""
        rows = in_flight.rows
        if isinstance(in_flight, multi_step.InFlightSteps):
            return self._output_processor.record_steps(rows, *multi_step.fetch(in_flight), self.requests, touched)
        sampled = sampling_rows.fetch(in_flight.sampled, len(rows))
        return self._output_processor.record(rows, sampled, self.requests, self.state.next_seq_id, touched)

    def _collect(self, touched: dict[str, RequestState]) -> list[RequestOutput]:
        """Outputs of the changed requests; finished ones leave the engine."""
        finished, self.state = self.state.finished, dataclasses.replace(self.state, finished=())
        return self._output_processor.collect(finished, self.requests, touched)

    def stats(self) -> scheduler.SchedulerStats:
        return scheduler.stats(self.state)


def _seed_global_generators(seed: int | None) -> None:
    """Seed Python's and NumPy's global generators with the engine's ``seed``, as vLLM does at
    start, so a script's own draws repeat too (each request has its own generator regardless)."""
    if seed is not None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
