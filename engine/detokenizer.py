"""Incremental detokenisation and stop strings.

Decoding token by token is wrong for byte-level BPE (a character may span tokens, and
spaces depend on neighbours), and decoding everything every step is quadratic. Instead each
sequence keeps two offsets into its tokens: text is decoded from ``prefix_offset`` (the
tokens of the previous piece, as context) and only what lies past ``read_offset`` is new. A piece that ends in an
incomplete UTF-8 character (decoded as U+FFFD) is held back until the next token completes it.
The first pieces take the prompt's last few tokens as context (as vLLM does): SentencePiece
decoders drop the space of a text's first token, which is not the first of the whole text.

Tokenizers with a Rust backend (the fast ones, which is nearly all) do the same in Rust:
``tokenizers``' ``DecodeStream`` (:func:`open_stream`), nine times faster a token; the
offsets here are for the others.

The text only has to keep up with the tokens where something reads it as it grows: stop
strings. Otherwise a sequence's tokens are decoded when an output needs its text
(:func:`decode_pending`, one token at a time in the same order, so the text is the same): once
at the end for ``LLM.generate`` and whole answers, a step's token per streamed output.
"""

from __future__ import annotations

import tokenizers
import tokenizers.decoders

from engine.core.records import record

_REPLACEMENT_CHAR = "\ufffd"


@record
class DecodeState:
    """Text so far and where the next decode starts (offsets into the output token ids; a
    sequence decoded through a ``DecodeStream`` keeps them in the stream instead)."""

    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0


# Prompt tokens a sequence's first output tokens are decoded after (vLLM uses as many).
PROMPT_CONTEXT_TOKENS = 5


def decode_next(tokenizer, token_ids, state: DecodeState, *, skip_special_tokens: bool,
                prompt_context=()) -> DecodeState:
    """Extend ``state.text`` with whatever the output ``token_ids`` (all of them so far) add;
    ``prompt_context`` (the prompt's last tokens) leads the window until it moves past the
    first output token."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)  # noqa: E731
    lead = list(prompt_context) if state.prefix_offset == 0 else []
    prefix_text = decode(lead + token_ids[state.prefix_offset : state.read_offset])
    full_text = decode(lead + token_ids[state.prefix_offset :])
    if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
        return state
    return DecodeState(state.text + full_text[len(prefix_text) :], state.read_offset, len(token_ids))


def open_stream(tokenizer, prompt_context, *, skip_special_tokens: bool):
    """A ``tokenizers`` ``DecodeStream`` for one sequence's output, its window primed with
    ``prompt_context`` (the prompt's last tokens, as :func:`decode_next` leads with them), or
    None where it would not give ``tokenizer.decode``'s text: a tokenizer without a Rust
    backend (``tokenizers.Tokenizer``), or one that cleans up spaces after decoding. The
    stream does in Rust what :func:`decode_next` does with two ``decode`` calls a token:
    2 us a token against 19 for SmolLM2's tokenizer."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        return tokenizers.decoders.DecodeStream(ids=list(prompt_context), skip_special_tokens=skip_special_tokens)
    except TypeError:  # a tokenizers release too old to prime a stream with ids
        return None


def stream_next(stream, tokenizer, token_id: int, state: DecodeState) -> DecodeState:
    """``state`` with the text ``token_id`` adds, through ``stream`` (:func:`open_stream`);
    the stream holds back an incomplete UTF-8 character until a later token completes it."""
    piece = stream.step(tokenizer._tokenizer, token_id)
    return DecodeState(state.text + piece, state.prefix_offset, state.read_offset) if piece else state


def decode_pending(seq, tokenizer, prompt_context, *, skip_special_tokens: bool) -> int:
    """Extend the text of ``seq`` (a ``request_state.SeqProgress``: its ``token_ids``,
    ``decoded``, ``stream`` and ``num_decoded``) with its tokens past ``num_decoded``, one at a
    time as :func:`stream_next` or :func:`decode_next` take them; returns the characters the last
    one added. ``prompt_context``: the prompt's last tokens."""
    added = 0
    while seq.num_decoded < len(seq.token_ids):
        seq.num_decoded += 1
        before = len(seq.decoded.text)
        seq.decoded = _with_next_token(seq, tokenizer, prompt_context, skip_special_tokens)
        added = len(seq.decoded.text) - before
    return added


def _with_next_token(seq, tokenizer, prompt_context, skip_special_tokens: bool) -> DecodeState:
    """``seq``'s text with token ``num_decoded - 1``'s: through its ``DecodeStream`` where the
    tokenizer has one, else :func:`decode_next` (also from the first failure of a stream on:
    it decodes the whole output so far once, then on)."""
    if seq.stream is None:
        seq.stream = open_stream(tokenizer, prompt_context, skip_special_tokens=skip_special_tokens) or False
    if seq.stream:
        try:
            return stream_next(seq.stream, tokenizer, seq.token_ids[seq.num_decoded - 1], seq.decoded)
        except Exception:  # noqa: BLE001 (any decoder failure: decode the slow way, which has none)
            seq.stream, seq.decoded = False, DecodeState()
    ids = seq.token_ids if seq.num_decoded == len(seq.token_ids) else seq.token_ids[: seq.num_decoded]
    return decode_next(tokenizer, ids, seq.decoded, prompt_context=prompt_context,
                       skip_special_tokens=skip_special_tokens)


def decode_after(tokenizer, prompt_ids, token_ids) -> str:
    """The text ``token_ids`` add after the prompt ``prompt_ids`` (special tokens skipped), at once."""
    context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    return decode(context + list(token_ids))[len(decode(context)):]


def find_stop(text: str, stops: tuple[str, ...], new_chars: int) -> tuple[int, str] | None:
    """Where the earliest stop string starting in the last ``new_chars`` (plus overlap) characters is.

    Returns (index in text, the stop string) or None.
    """
    best = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
