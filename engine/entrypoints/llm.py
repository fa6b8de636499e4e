"""The offline API: ``LLM(...).generate(prompts, SamplingParams(...))``, as in vLLM."""

from __future__ import annotations

import dataclasses
import itertools
import numbers
from collections.abc import Mapping, Sequence

import jinja2
from tqdm import tqdm

from engine import gc_freeze
from engine.config import EngineConfig
from engine.core.scheduler import InvalidRequestError
from engine.entrypoints.async_engine import EngineSnapshot
from engine.entrypoints.metrics import Metric, Metrics
from engine.entrypoints.protocol import text_content
from engine.inputs import PromptType, prompt_input
from engine.llm_engine import LLMEngine
from engine.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
from engine.sampling_params import BeamSearchParams, SamplingParams, final_only
from models.loader import DEFAULT_MODEL

# The paper's Orca baselines that size each reservation by the request's true output length.
_ORACLE_RESERVATIONS = ("orca-pow2", "orca-oracle")

Prompt = PromptType  # text, token ids, or vLLM's TextPrompt / TokensPrompt dicts


@dataclasses.dataclass(frozen=True)
class CacheStats:
    """What the KV cache holds right now, and totals since start."""

    device_blocks_total: int
    device_blocks_free: int
    host_blocks_total: int
    host_blocks_free: int
    num_preemptions: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    blocks_saved_by_sharing: int


class LLM:
    """A model with a paged KV cache, ready to generate.

    model: a Hugging Face directory, a ``.gguf`` file, or None for SmolLM2-135M-Instruct.
    dtype: the weights', "auto" (float32), "float32" or "bfloat16"; activations are float32.
    kv_cache_dtype: "auto" (the weights'), "float32" or "bfloat16". block_size: tokens per KV block.
    num_blocks: device KV blocks, exactly (else sized from kv_cache_memory bytes; else on a GPU
    or TPU gpu_memory_utilization of the device's memory less the weights and the peak
    activations, and on a CPU 1 GiB; see ``engine.worker.kv_cache_size``). swap_space: GiB of host
    memory for swapped-out blocks. max_num_seqs /
    max_num_batched_tokens: per-step budgets (longer prompts are prefilled in chunks).
    max_model_len: prompt plus output limit (default: the model's; lowered, with a warning, to
    what the KV cache holds). enable_prefix_caching: reuse the KV blocks of identical prompt
    prefixes, computed earlier or earlier in the same step (None: on, as in vLLM, except for the
    Orca baselines). preemption_mode: "recompute", "swap", or
    None to choose per request. reservation: "paged" or a baseline of the paper ("orca-max",
    "orca-pow2", "orca-oracle"). seed: for requests without their own. policy: "fcfs"
    (continuous batching) or "static" (a batch runs until all its members finish). warmup:
    compile every step shape now (else on first use). tensor_parallel_size: split the model
    over that many devices (heads, MLP, vocabulary; see ``engine.worker.tensor_parallel``). async_scheduling:
    dispatch a decode step before the previous one's tokens reach the host, where that cannot
    change the output (see ``engine.async_scheduling``). num_scheduler_steps: decode steps per
    dispatch when a step only decodes, sampled on the device (vLLM's multi-step scheduling; the
    same outputs as 1, see ``engine.multi_step``). stream_interval: a streamed request's outputs
    (``output_kind`` cumulative or delta, as ``AsyncLLMEngine`` streams them) after its first,
    one per that many tokens (and its last); ``generate`` returns final outputs either way.
    generation_config: "auto" (vLLM's default) takes the sampling defaults of the checkpoint's
    ``generation_config.json``
    (:meth:`get_default_sampling_params`, what ``generate`` and ``chat`` use without
    parameters); "vllm" ignores them. tokenizer: another tokenizer than the model's (a
    directory, hub ID or .gguf file). trust_remote_code: accepted; no remote code runs either
    way, and a model that needs it is refused saying so. enforce_eager: skip compiling the
    step shapes at start (vLLM's switch off CUDA graphs; as warmup=False). disable_log_stats:
    False logs throughput, queues and cache use every 10 s (vLLM's; off by default in ``LLM``).
    max_logprobs: the most log-probabilities a request may ask for (20). dtype also takes
    vLLM's "half"/"float16" (where the platform computes float16: a GPU) and "float".
    ``seed`` also seeds Python's ``random`` and NumPy's global generator, as vLLM does.
    """

    def __init__(self, model: str | None = None, *, dtype: str = "auto", kv_cache_dtype: str = "auto",
                 block_size: int = 16,
                 num_blocks: int | None = None, kv_cache_memory: int | None = None,
                 gpu_memory_utilization: float = 0.9, swap_space: float = 4,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None, enable_prefix_caching: bool | None = None,
                 preemption_mode: str | None = None, reservation: str = "paged", seed: int = 0,
                 policy: str = "fcfs", warmup: bool = True, tensor_parallel_size: int = 1,
                 async_scheduling: bool = True, num_scheduler_steps: int = 1, stream_interval: int = 1,
                 generation_config: str = "auto",
                 tokenizer: str | None = None, trust_remote_code: bool = False, enforce_eager: bool = False,
                 disable_log_stats: bool = True, max_logprobs: int = 20):
        config = EngineConfig(
            model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size, num_blocks=num_blocks,
            kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization, swap_space=swap_space,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, preemption_mode=preemption_mode,
            reservation=reservation, seed=seed, policy=policy, warmup=warmup,
            tensor_parallel_size=tensor_parallel_size, async_scheduling=async_scheduling,
            num_scheduler_steps=num_scheduler_steps, stream_interval=stream_interval,
            generation_config=generation_config, tokenizer=tokenizer,
            trust_remote_code=trust_remote_code, enforce_eager=enforce_eager, disable_log_stats=disable_log_stats,
            max_logprobs=max_logprobs)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()
        self._metrics = Metrics(model or DEFAULT_MODEL, block_size=config.block_size)

    def get_tokenizer(self):
        return self.engine.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's name for it; also ``engine``)."""
        return self.engine

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams`` with the model's sampling defaults (vLLM's): temperature, top_p,
        top_k, min_p, repetition_penalty and max_new_tokens (as max_tokens) from its
        ``generation_config.json`` when ``generation_config`` is "auto"; the rest SamplingParams' own."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or a ``{"prompt": ...}`` /
        ``{"prompt_token_ids": ...}`` dict); outputs come back in input order.

        A request that cannot run (e.g. a prompt longer than max_model_len) comes back with
        ``error`` set and no outputs, one stopped part-way (its samples outgrew the KV cache)
        with ``error`` set and what it generated; the others are unaffected.
        """
        prompts = _as_list(prompts)
        params = _params_for(prompts, sampling_params or self.get_default_sampling_params(), SamplingParams,
                             "LLM.beam_search")
        return self._run_engine([(prompt, p) for prompt, p in zip(prompts, _final_only(params))], use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             tools: list | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts; content a
        string or OpenAI text parts, joined by newlines) or to a list of them, through the
        tokenizer's chat template, or ``chat_template`` with ``chat_template_kwargs`` (vLLM's).
        ``continue_final_message`` leaves the last (assistant) message open for the model to
        continue; it needs ``add_generation_prompt=False``. ``tools`` are refused: this engine
        does no tool calling."""
        if tools:
            raise ValueError("tools are not supported: this engine does no tool calling; leave tools out")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(conversation, add_generation_prompt, continue_final_message, chat_template,
                                    chat_template_kwargs) for conversation in conversations]
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        tokenizer = self.engine.tokenizer  # the rendered conversation as text, as vLLM reports it
        return [dataclasses.replace(out, prompt=tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False))
                for out in outputs]

    def chat_prompt(self, conversation, add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template: str | None = None, chat_template_kwargs: dict | None = None) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template (or ``chat_template``)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None or (tokenizer.chat_template is None and chat_template is None):
            raise InvalidRequestError("this model has no chat template; pass chat_template, or use generate() "
                                      "with a plain prompt")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        conversation = [{**message, "content": text_content(message.get("content"))} for message in conversation]
        try:
            ids = tokenizer.apply_chat_template(conversation, chat_template=chat_template,
                                                add_generation_prompt=add_generation_prompt,
                                                continue_final_message=continue_final_message, tokenize=True,
                                                **(chat_template_kwargs or {}))
        except jinja2.TemplateError as error:  # e.g. a message without a role
            raise ValueError(f"the chat template cannot render this conversation: {error}") from None
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt. As vLLM's, each output's ``sequences`` are the
        ``beam_width`` best, best first, each with the prompt's tokens then its own, and the
        text of them all."""
        prompts = _as_list(prompts)
        params = _params_for(prompts, params, BeamSearchParams, "LLM.generate")
        outputs = self._run_engine(list(zip(prompts, params)), use_tqdm)
        return [_beam_search_output(out, self.engine.tokenizer) for out in outputs]

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache, as vLLM's ``LLM.reset_prefix_cache``: the next prompts
        compute every block again (benchmarks reset it between rounds). False, changing
        nothing, while requests are running."""
        return self.engine.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics now, as vLLM's ``LLM.get_metrics()`` returns them: the same
        counters, gauges and histograms (vLLM's names) the server's ``/metrics`` serves, as
        ``Counter``, ``Gauge`` and ``Histogram`` objects with ``name``, ``labels`` and values."""
        return self._metrics.collect(EngineSnapshot.of(self.engine))

    def cache_stats(self) -> CacheStats:
        stats = self.engine.stats()
        blocks = stats.blocks
        return CacheStats(blocks.device_blocks_total, blocks.device_blocks_free, blocks.host_blocks_total,
                          blocks.host_blocks_free, stats.num_preemptions, blocks.prefix_cache_hits,
                          blocks.prefix_cache_queries, blocks.blocks_saved_by_sharing)

    def _run_engine(self, requests, use_tqdm: bool) -> list[RequestOutput]:
        """Queue ``requests`` and step until all are done. If anything raises (a bad prompt
        type, a failed step, Ctrl-C), this call's requests are aborted before it propagates,
        so none of them holds blocks or runs in a later call."""
        engine = self.engine
        if engine.config.reservation in _ORACLE_RESERVATIONS:
            raise ValueError(f"reservation {engine.config.reservation!r} reserves each request's true output "
                             "length, which LLM cannot know; give it per request with "
                             "LLM.engine.add_request(..., expected_output_len=n), or use 'paged' or 'orca-max'")
        order, results = [], {}
        try:
            for prompt, params in requests:
                request_id = f"offline-{next(self._ids)}"
                order.append(request_id)
                try:
                    engine.add_request(request_id, prompt, params)
                except InvalidRequestError as error:
                    results[request_id] = _refused(request_id, prompt, str(error))
            with (tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar,
                  gc_freeze.older_objects_frozen()):  # the collector skips the loaded engine
                bar.update(len(results))
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            results[output.request_id] = output
                            self._metrics.observe_finished(output)
                            bar.update(1)
                            elapsed = bar.format_dict["elapsed"] or 1e-9
                            bar.set_postfix_str(f"output {engine.counters.generation_tokens / elapsed:.1f} toks/s")
        except BaseException:
            for request_id in order:
                engine.abort_request(request_id)
            raise
        return [results[request_id] for request_id in order]


def _as_list(prompts) -> list[str | list[int]]:
    """One prompt or many, as a list of texts and token-id lists."""
    single = isinstance(prompts, (str, Mapping)) or (len(prompts) > 0 and isinstance(prompts[0], numbers.Integral))
    return [prompt_input(p) for p in ([prompts] if single else prompts)]


def _params_for(prompts, params, kind: type, other_method: str) -> list:
    """One ``kind`` of params per prompt, from one or a list; a TypeError says where any other
    kind goes (``SamplingParams`` to ``generate``, ``BeamSearchParams`` to ``beam_search``)."""
    params = [params] * len(prompts) if not isinstance(params, Sequence) else list(params)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} {kind.__name__} for {len(prompts)} prompts; pass one, or one per prompt")
    for p in params:
        if not isinstance(p, kind):
            hint = f"; pass it to {other_method}" if isinstance(p, (SamplingParams, BeamSearchParams)) else ""
            raise TypeError(f"expected {kind.__name__}, got {type(p).__name__}{hint}")
    return params


def _final_only(params: list[SamplingParams]) -> list[SamplingParams]:
    """``params`` with ``output_kind`` FINAL_ONLY (as vLLM's ``LLM`` sets it): ``generate``
    returns only final outputs, so the steps need not build the others. (One copy per distinct
    object: the same params are often given for every prompt.)"""
    final = {}
    for p in params:
        if id(p) not in final:
            final[id(p)] = final_only(p)
    return [final[id(p)] for p in params]


def _beam_search_output(out: RequestOutput, tokenizer) -> BeamSearchOutput:
    def sequence(completion: CompletionOutput) -> BeamSearchSequence:
        tokens = [*out.prompt_token_ids, *completion.token_ids]
        return BeamSearchSequence(tokens=tokens, logprobs=list(completion.logprobs or ()),
                                  cum_logprob=completion.cumulative_logprob,
                                  text=tokenizer.decode(tokens) if tokenizer is not None else None,
                                  finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)

    return BeamSearchOutput([sequence(completion) for completion in out.outputs], error=out.error)


def _refused(request_id: str, prompt, reason: str) -> RequestOutput:
    text = prompt if isinstance(prompt, str) else None
    ids = () if isinstance(prompt, str) else tuple(prompt)
    return RequestOutput(request_id, text, ids, (), finished=True, error=reason)


__all__ = ["LLM", "CacheStats"]
