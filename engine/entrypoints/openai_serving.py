"""OpenAI's completions and chat endpoints on top of an engine loop (``AsyncLLMEngine``, or
``EngineProcess``): requests in, JSON or server-sent-event chunks out. Protocol only; the HTTP
plumbing lives in ``engine.serve``."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import AsyncIterator

import jinja2

from engine.core.scheduler import InvalidRequestError
from engine.entrypoints import request_outputs
from engine.entrypoints.async_engine import EngineClient
from engine.entrypoints.protocol import ChatRequest, CompletionRequest, RequestError, response_id
from engine.entrypoints.streaming import ChoiceProgress, chunk_writer, ending_with_errors, includes_usage
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import BeamSearchParams, SamplingParams, as_deltas


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, engine: EngineClient, model_names: list[str], on_finished=None,
                 defaults: dict | None = None):
        self.engine = engine
        # Sampling defaults for fields a request leaves out (the model's generation config);
        # their max_tokens caps every request's, as vLLM's max_new_tokens does.
        self.defaults = dict(engine.engine.default_sampling if defaults is None else defaults)
        self.max_new_tokens = self.defaults.pop("max_tokens", None)
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.model_names = model_names
        self.on_finished = on_finished or (lambda output, choices: None)

    def check_model(self, name: str | None) -> str:
        """The model a generation request names (the default if none), with the engine running."""
        if not self.engine.is_healthy:
            raise RequestError("the engine has stopped after an error; restart the server", 503,
                               "service_unavailable")
        if name is not None and name not in self.model_names:
            raise RequestError(f"The model `{name}` does not exist; this server has {self.model_names}.", 404,
                               "NotFoundError")
        return name or self.model_names[0]

    def _token_ids(self, prompt, keep: int | None = None, add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids, only the last ``keep`` if given (``truncate_prompt_tokens``)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer; send token ids")
            return _last(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens), keep)
        try:
            self.engine.engine.check_prompt(_last(list(prompt), keep))
        except InvalidRequestError as error:
            raise RequestError(str(error)) from None
        return _last(list(prompt), keep)

    def _params(self, request, **kwargs) -> SamplingParams | BeamSearchParams:
        """The request's ``SamplingParams`` (``BeamSearchParams`` with ``use_beam_search``); a 400
        naming the field for a bad value."""
        try:
            params = request.engine_params(**kwargs, defaults=self.defaults)
            self.engine.engine.check_params(params)
        except (ValueError, InvalidRequestError) as error:
            raise RequestError(str(error)) from None
        return params

    def _max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """The completion budget: what was requested, else up to the context, at most the
        server's ``max_new_tokens`` (vLLM's rule); refuses prompts (plus requested tokens) over
        the context."""
        room = self.max_model_len - prompt_len
        if room <= 0 or (requested is not None and requested > room):
            wanted = prompt_len + (requested or 0)
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{wanted} tokens ({prompt_len} in the prompt, {requested or 0} in the completion). Please reduce "
                f"the length of the prompt or of max_tokens.")
        budget = requested if requested is not None else room
        return budget if self.max_new_tokens is None else min(budget, self.max_new_tokens)

    # -- completions ------------------------------------------------------------------------

    def plan_completion(self, request: CompletionRequest):
        """(model name, [(token ids, SamplingParams)]) for every prompt of ``request``."""
        model = self.check_model(request.model)
        prompts = [self._token_ids(p, request.truncate_prompt_tokens, request.add_special_tokens)
                   for p in request.prompts()]
        if not prompts or not all(prompts):
            raise RequestError("prompt must not be empty")
        if request.stream and (request.best_of or request.n) > request.n:
            raise RequestError("best_of cannot be larger than n when streaming")
        plans = []
        for ids in prompts:
            if request.max_tokens == 0 and (request.use_beam_search or not request.echo):
                raise RequestError("max_tokens must be at least 1 (0 is allowed only with echo, to score the prompt, "
                                   "and without use_beam_search)")
            max_tokens = 1 if request.echo_only else request.max_tokens  # the one token is not shown
            params = self._params(request, max_tokens=self._max_tokens(len(ids), max_tokens),
                                  logprobs=request.logprobs, best_of=request.best_of)
            if request.echo and request.logprobs is not None:
                if request.use_beam_search:
                    raise RequestError("echo with logprobs cannot be used with use_beam_search")
                params = dataclasses.replace(params, prompt_logprobs=max(request.logprobs, params.prompt_logprobs or 0))
            plans.append((ids, params))
        return model, plans

    async def completion(self, request: CompletionRequest) -> dict:
        model, plans = self.plan_completion(request)
        finals = await request_outputs.finals(self.engine, plans, "cmpl", self.on_finished,
                                              functools.partial(_shown, request=request))
        choices = []
        for prompt_index, (ids, _), output in zip(range(len(plans)), plans, finals):
            for c in output.outputs:
                text = (self._echoed(request, prompt_index, ids) if request.echo else "") + c.text
                shown = c
                if request.echo and request.logprobs is not None:  # the prompt's tokens come first
                    shown = self._with_prompt(c, ids, output)
                logprobs = None if request.logprobs is None else self._completion_logprobs(shown, request.logprobs)
                choices.append({"index": prompt_index * request.n + c.index, "text": text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                                **_prompt_logprobs(output, request.prompt_logprobs)})
        return {"id": response_id("cmpl", request.request_id), "object": "text_completion",
                "created": int(time.time()), "model": model,
                "choices": choices, "usage": _usage(plans, _generated(finals))}

    def completion_stream(self, request: CompletionRequest) -> AsyncIterator[str]:
        """Server-sent events for ``request``; a request that cannot run raises here, before streaming."""
        model, plans = self.plan_completion(request)
        return ending_with_errors(self._completion_chunks(request, model, plans))

    async def _completion_chunks(self, request: CompletionRequest, model: str, plans) -> AsyncIterator[str]:
        chunk = chunk_writer(response_id("cmpl", request.request_id), "text_completion", model,
                             includes_usage(request))
        sent: dict[tuple[int, int], ChoiceProgress] = {}
        first_outputs = {}  # per prompt: the one with the prompt's logprobs (later deltas have none)
        streamed = [(ids, as_deltas(params)) for ids, params in plans]
        async for prompt_index, output in request_outputs.merged(self.engine, streamed, "cmpl", self.on_finished,
                                                                   functools.partial(_shown, request=request)):
            first_outputs.setdefault(prompt_index, output)
            for c in output.outputs:
                key = (prompt_index, c.index)
                first = key not in sent
                progress = sent.setdefault(key, ChoiceProgress())
                prefix = self._echoed(request, prompt_index, plans[prompt_index][0]) if request.echo and first else ""
                delta = progress.take(c)
                if progress.done or not (prefix or delta.text or c.finish_reason):
                    progress.hold(delta)
                    continue
                if prefix and request.logprobs is not None:  # the prompt's tokens come first, as unstreamed
                    delta = self._with_prompt(delta, plans[prompt_index][0], first_outputs[prompt_index])
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._completion_logprobs(delta, request.logprobs, progress.text_offset)
                    progress.text_offset += sum(len(token) for token in logprobs["tokens"])
                progress.sent(c)
                yield chunk([{"index": prompt_index * request.n + c.index, "text": prefix + delta.text,
                              "logprobs": logprobs, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}])
        if includes_usage(request):
            yield chunk([], _usage(plans, sum(progress.tokens for progress in sent.values())))
        yield "data: [DONE]\n\n"

    # -- chat -------------------------------------------------------------------------------

    def chat_ids(self, request) -> list[int]:
        """Token ids of ``request``'s messages (a chat or /tokenize request) through the chat
        template: the model's, or the request's ``chat_template``, with its ``chat_template_kwargs``."""
        template, extra = request.chat_template, request.chat_template_kwargs or {}
        if self.tokenizer is None or (self.tokenizer.chat_template is None and template is None):
            raise RequestError("this model has no chat template; send chat_template or use /v1/completions")
        if request.continue_final_message and request.add_generation_prompt:
            raise RequestError("continue_final_message needs add_generation_prompt set to false")
        reserved = sorted(set(extra) & _TEMPLATE_ARGUMENTS)
        if reserved:
            raise RequestError(f"chat_template_kwargs cannot set {reserved}; send them as request fields")
        special = bool(request.add_special_tokens)  # on top of the template's (None in /tokenize: no)
        try:
            rendered = self.tokenizer.apply_chat_template(
                [m.as_template_input() for m in request.messages], chat_template=template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message, tokenize=not special, return_dict=False,
                **extra)
            return self.tokenizer.encode(rendered, add_special_tokens=True) if special else list(rendered)
        except (ValueError, jinja2.TemplateError) as error:  # the template refuses these messages
            raise RequestError(f"the chat template cannot render these messages: {error}") from None

    def plan_chat(self, request: ChatRequest):
        model = self.check_model(request.model)
        ids = _last(self.chat_ids(request), request.truncate_prompt_tokens)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        if request.stream and (request.best_of or request.n) > request.n:
            raise RequestError("best_of cannot be larger than n when streaming")
        params = self._params(request, max_tokens=self._max_tokens(len(ids), request.requested_max_tokens()),
                              logprobs=logprobs, best_of=request.best_of)
        return model, [(list(ids), params)]

    async def chat(self, request: ChatRequest) -> dict:
        model, plans = self.plan_chat(request)
        (output,) = await request_outputs.finals(self.engine, plans, "chatcmpl", self.on_finished)
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._chat_logprobs(c, request.top_logprobs) if request.logprobs else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in output.outputs]
        return {"id": response_id("chatcmpl", request.request_id), "object": "chat.completion",
                "created": int(time.time()), "model": model,
                "choices": choices, "usage": _usage(plans, _generated([output])),
                **_prompt_logprobs(output, request.prompt_logprobs)}

    def chat_stream(self, request: ChatRequest) -> AsyncIterator[str]:
        """Server-sent events for ``request``; a request that cannot run raises here, before streaming."""
        model, plans = self.plan_chat(request)
        return ending_with_errors(self._chat_chunks(request, model, plans))

    async def _chat_chunks(self, request: ChatRequest, model: str, plans) -> AsyncIterator[str]:
        chunk = chunk_writer(response_id("chatcmpl", request.request_id), "chat.completion.chunk", model,
                             includes_usage(request))
        sent: dict[int, ChoiceProgress] = {}
        async for _, output in request_outputs.merged(self.engine, [(ids, as_deltas(params)) for ids, params in plans],
                                                      "chatcmpl", self.on_finished):
            for c in output.outputs:
                if c.index not in sent:
                    sent[c.index] = ChoiceProgress()
                    yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
                progress = sent[c.index]
                delta = progress.take(c)
                if progress.done or not (delta.text or c.finish_reason):
                    progress.hold(delta)
                    continue
                progress.sent(c)
                logprobs = self._chat_logprobs(delta, request.top_logprobs) if request.logprobs else None
                yield chunk([{"index": c.index, "delta": {"content": delta.text} if delta.text else {},
                              "logprobs": logprobs,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}])
        if includes_usage(request):
            yield chunk([], _usage(plans, sum(progress.tokens for progress in sent.values())))
        yield "data: [DONE]\n\n"

    # -- formatting -------------------------------------------------------------------------

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer is not None else ""

    def _echoed(self, request: CompletionRequest, prompt_index: int, ids) -> str:
        """The prompt as ``echo`` shows it: as sent when it was text (as vLLM; no BOS the
        tokenizer added), else its tokens' text."""
        prompt = request.prompts()[prompt_index]
        return prompt if isinstance(prompt, str) and not request.truncate_prompt_tokens else self._decode(ids)

    def _token_text(self, token: int) -> str:
        return self._decode([token])

    def _with_prompt(self, c: CompletionOutput, prompt_ids, output: RequestOutput) -> CompletionOutput:
        """``c`` with the prompt's tokens and their log-probabilities first (echo with logprobs)."""
        return dataclasses.replace(c, token_ids=tuple(prompt_ids) + c.token_ids,
                                   logprobs=tuple(output.prompt_logprobs) + (c.logprobs or ()))

    def _completion_logprobs(self, c: CompletionOutput, num_top: int, first_offset: int = 0) -> dict:
        """The legacy ``logprobs`` object: each token's and its ``num_top`` most likely
        alternatives' (a beam's entries hold all its beam proposed); ``text_offset`` counts from
        ``first_offset`` (the text already sent, when streaming). A step without
        log-probabilities (the first prompt token, which has no context) gets null ones, as in
        OpenAI's and vLLM's answers."""
        tokens = [self._token_text(t) for t in c.token_ids]
        offsets, position = [], first_offset
        for text in tokens:
            offsets.append(position)
            position += len(text)
        steps = c.logprobs or [{} for _ in c.token_ids]
        return {"tokens": tokens,
                "token_logprobs": [None if step is None else step.get(t) for step, t in zip(steps, c.token_ids)],
                "top_logprobs": [None if step is None
                                 else {self._token_text(k): v for k, v in as_legacy_top(step, t, num_top)}
                                 for step, t in zip(steps, c.token_ids)],
                "text_offset": offsets}

    def _chat_logprobs(self, c: CompletionOutput, num_top: int | None) -> dict:
        """The chat ``logprobs`` object: each token with its ``num_top`` most likely alternatives."""
        def entry(token, logprob):
            text = self._token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        steps = c.logprobs or [{} for _ in c.token_ids]
        content = []
        for token, step in zip(c.token_ids, steps):
            tops = most_likely(step, num_top or 0)
            content.append({**entry(token, step.get(token)), "top_logprobs": [entry(k, v) for k, v in tops]})
        return {"content": content}


def most_likely(step: dict, count: int) -> list[tuple[int, float]]:
    """The ``count`` most likely (token, logprob) pairs of a step's entry, best first."""
    return sorted(step.items(), key=lambda kv: -kv[1])[:count]


def as_legacy_top(step: dict, token: int, count: int) -> list[tuple[int, float]]:
    """A step's entry as the legacy ``top_logprobs`` shows it: the chosen token, then the
    ``count`` most likely."""
    chosen = [(token, step[token])] if token in step else []
    return chosen + [kv for kv in most_likely(step, count) if kv[0] != token]


def _last(ids: list[int], keep: int | None) -> list[int]:
    """``ids``, or only the last ``keep`` of them (a positive ``keep``)."""
    return ids[-keep:] if keep and keep > 0 else ids


def _shown(output: RequestOutput, request: CompletionRequest) -> RequestOutput:
    """What a completion shows of ``output``: all of it, or for ``echo_only`` nothing generated
    (the engine still generates one token, which the client neither sees nor is billed for,
    and which the per-request metrics leave out)."""
    if not request.echo_only:
        return output
    empty = [dataclasses.replace(c, text="", token_ids=(), cumulative_logprob=0.0, stop_reason=None,
                                 logprobs=None if c.logprobs is None else (),
                                 finish_reason=c.finish_reason and "length") for c in output.outputs]
    return dataclasses.replace(output, outputs=tuple(empty))


# apply_chat_template's own arguments, which a request sets through its fields, not chat_template_kwargs
_TEMPLATE_ARGUMENTS = {"conversation", "messages", "chat_template", "add_generation_prompt", "continue_final_message",
                       "tokenize", "return_dict", "tools", "documents", "padding", "truncation", "max_length",
                       "return_tensors", "return_assistant_tokens_mask"}


def _prompt_logprobs(output: RequestOutput, num_top: int | None) -> dict:
    """vLLM's ``prompt_logprobs`` field when asked for (else nothing): per prompt token, None
    for the first (it has no context), then {token id: {logprob, rank, decoded_token}} of the
    token itself and its ``num_top`` most likely alternatives."""
    if num_top is None:
        return {}
    def entry(step):
        chosen = next(iter(step))  # the prompt's own token comes first
        return {str(token): {"logprob": float(value), "rank": value.rank, "decoded_token": value.decoded_token}
                for token, value in step.items() if token == chosen or value.rank <= num_top}

    entries = [None if step is None else entry(step) for step in output.prompt_logprobs or ()]
    return {"prompt_logprobs": entries}


def _generated(finals: list[RequestOutput]) -> int:
    """Tokens the choices of whole (final) outputs hold."""
    return sum(len(c.token_ids) for output in finals for c in output.outputs)


def _usage(plans, completion: int) -> dict:
    """OpenAI's ``usage``: the plans' prompt tokens, and ``completion`` generated tokens."""
    prompt = sum(len(ids) for ids, _ in plans)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
