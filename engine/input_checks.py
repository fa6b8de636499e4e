"""A request's checks before it is queued: ``InvalidRequestError`` for a prompt or parameters
the engine would refuse, with what to change. Pure functions of the request and the engine's
limits, so callers on other threads (the server) can check before queueing."""

from __future__ import annotations

from engine import structured_output
from engine.core.scheduler import InvalidRequestError
from engine.sampling_params import BeamSearchParams, SamplingParams


def check_prompt(token_ids: list[int], request_id: str = "", *, max_model_len: int, vocab_size: int) -> None:
    """Raise ``InvalidRequestError`` for a prompt ``add_request`` would refuse (safe from any thread)."""
    if not token_ids:
        raise InvalidRequestError(f"{_who(request_id)}the prompt is empty")
    if len(token_ids) >= max_model_len:
        raise InvalidRequestError(
            f"{_who(request_id)}the prompt has {len(token_ids)} tokens but max_model_len is "
            f"{max_model_len}; shorten the prompt or raise max_model_len")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"{_who(request_id)}token ids {bad[:5]} are outside the vocabulary "
                                  f"[0, {vocab_size})")


def check_params(params: SamplingParams | BeamSearchParams, request_id: str = "", *, max_num_seqs: int,
                 vocab_size: int, tokenizer, grammars: structured_output.Grammars | None = None,
                 max_logprobs: int = 20) -> None:
    """Raise ``InvalidRequestError`` for parameters this engine cannot run: more sequences
    than ``max_num_seqs``, more log-probabilities than ``max_logprobs``, ``bad_words`` or a
    constraint without a tokenizer (``grammars``, the engine's compiler of constraints), a
    constraint that does not compile, tokens the model does not have."""
    for field in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, field, None)
        if asked is not None and asked > max_logprobs:
            raise InvalidRequestError(f"{_who(request_id)}{field}={asked} is more than max_logprobs={max_logprobs}; "
                                      f"ask for fewer, or start the engine with a larger max_logprobs")
    width = params.beam_width if isinstance(params, BeamSearchParams) else params.num_candidates
    if width > max_num_seqs:
        field = ("beam_width (n with use_beam_search)" if isinstance(params, BeamSearchParams)
                 else "best_of" if width > params.n else "n")
        raise InvalidRequestError(f"{_who(request_id)}{field}={width} needs {width} sequences at once, more "
                                  f"than max_num_seqs={max_num_seqs}; lower it or raise max_num_seqs")
    if getattr(params, "bad_words", ()) and tokenizer is None:
        raise InvalidRequestError(f"{_who(request_id)}bad_words needs a tokenizer, and this model has none")
    guided = getattr(params, "guided_decoding", None)
    if guided is not None:
        if grammars is None:
            raise InvalidRequestError(f"{_who(request_id)}structured outputs need a tokenizer, and this "
                                      "model has none")
        try:
            grammars.matcher(guided)  # compiled once, and cached for the request
        except ValueError as error:
            raise InvalidRequestError(f"{_who(request_id)}{error}") from None
    for field, ids in [("logit_bias", [t for t, _ in getattr(params, "logit_bias", ())]),
                       ("allowed_token_ids", getattr(params, "allowed_token_ids", None) or ())]:
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError(f"{_who(request_id)}{field} token ids {bad[:5]} are outside the "
                                      f"vocabulary [0, {vocab_size})")


def _who(request_id: str) -> str:
    """The message's prefix naming the request; none for a request checked before it has an
    id (the server checks a request before queueing it, and its client knows which it sent)."""
    return f"request {request_id!r}: " if request_id else ""
