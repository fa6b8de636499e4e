"""Bad requests to the OpenAI server, and what its error must say: the cases of
``test_serve.test_errors_are_openai_shaped_and_the_server_keeps_serving``."""

from __future__ import annotations

CHAT = "/v1/chat/completions"

# (case, HTTP status, a fragment of the error message)
ERRORS = [
    ("bad_param", 400, "temperature"),
    ("malformed_json", 400, "not valid JSON"),
    ("too_long", 400, "maximum context length is 512 tokens"),
    ("no_key", 401, "API key"),
    ("wrong_key", 401, "API key"),
    ("unknown_model", 404, "does not exist"),
    ("too_big", 413, "larger than"),
    ("too_big_chunked", 413, "larger than"),
    ("bad_token_id", 400, "outside the vocabulary"),
    ("bad_token_id_streamed", 400, "outside the vocabulary"),
    ("bad_logit_bias_token", 400, "logit_bias token ids [999999] are outside the vocabulary"),
    ("logit_bias_key_not_a_token", 400, "logit_bias keys must be token ids"),
    ("bad_allowed_token", 400, "allowed_token_ids token ids [999999] are outside the vocabulary"),
    ("suffix", 400, "suffix is not supported"),
    ("stream_options_without_stream", 400, "stream_options can only be set when stream is true"),
    ("image_part", 400, "content parts of type 'image_url' are not supported"),
    ("text_part_without_text", 400, "a 'text' content part needs a string 'text', got None"),
    ("forced_tool_call", 400, "tool calling is not supported"),
    ("echo_only_with_min_tokens", 400, "min_tokens must be 0 when echo asks for max_tokens 0"),
    ("unknown_response_format", 400, "response_format type 'xml' is not supported"),
    ("tools", 400, "tool calling is not supported"),
    ("top_logprobs_without_logprobs", 400, "top_logprobs needs logprobs"),
    ("chat_echo", 400, "echo is not supported for chat"),
    ("continue_with_generation_prompt", 400, "continue_final_message needs add_generation_prompt set to false"),
    ("tokenize_continue_with_generation_prompt", 400, "continue_final_message needs add_generation_prompt"),
    ("max_tokens_zero_without_echo", 400, "0 is allowed only with echo"),
    ("beam_search_with_stop", 400, "top_k, stop cannot be used with use_beam_search"),
    ("too_many_samples_streamed", 400, "n=65 needs 65 sequences at once, more than max_num_seqs=64"),
]


def error_request(case: str, model: str) -> dict:
    """The request of ``case``, asking for ``model``: its route (``path``) and the keyword
    arguments of ``httpx.request`` that send it."""
    path, body = "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 4}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    request = {
        "bad_param": dict(json={**body, "temperature": -1}),
        "malformed_json": dict(content=b'{"prompt": "hi",', headers={"content-type": "application/json"}),
        "too_long": dict(json={**body, "prompt": "word " * 600}),
        "no_key": dict(json=body, headers={"Authorization": ""}),
        "wrong_key": dict(json=body, headers={"Authorization": "Bearer nope"}),
        "unknown_model": dict(json={**body, "model": "gpt-9"}),
        "too_big": dict(json={**body, "prompt": "x" * (5 * 2**20)}),
        "too_big_chunked": dict(content=(b"x" * 2**20 for _ in range(5)), headers={"content-type": "application/json"}),
        "bad_token_id": dict(json={**body, "prompt": [999999]}),
        "bad_token_id_streamed": dict(json={**body, "prompt": [999999], "stream": True}),
        "bad_logit_bias_token": dict(json={**body, "logit_bias": {"999999": 5}}),
        "logit_bias_key_not_a_token": dict(json={**body, "logit_bias": {"blue": 5}}),
        "bad_allowed_token": dict(json={**body, "allowed_token_ids": [5, 999999]}),
        "suffix": dict(json={**body, "suffix": " and so on."}),
        "stream_options_without_stream": dict(json={**body, "stream_options": {"include_usage": True}}),
        "image_part": dict(path=CHAT, json={**chat, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]}]}),
        "text_part_without_text": dict(path=CHAT, json={**chat, "messages": [
            {"role": "user", "content": [{"type": "text", "text": None}]}]}),
        "forced_tool_call": dict(path=CHAT, json={**chat, "tool_choice": "required"}),
        "echo_only_with_min_tokens": dict(json={**body, "echo": True, "max_tokens": 0, "min_tokens": 2}),
        "unknown_response_format": dict(path=CHAT, json={**chat, "response_format": {"type": "xml"}}),
        "tools": dict(path=CHAT, json={**chat, "tools": [{"type": "function", "function": {"name": "f"}}]}),
        "top_logprobs_without_logprobs": dict(path=CHAT, json={**chat, "top_logprobs": 2}),
        "chat_echo": dict(path=CHAT, json={**chat, "echo": True}),
        "continue_with_generation_prompt": dict(path=CHAT, json={**chat, "continue_final_message": True}),
        "tokenize_continue_with_generation_prompt": dict(path="/tokenize", json={
            "messages": chat["messages"], "continue_final_message": True}),
        "max_tokens_zero_without_echo": dict(json={**body, "max_tokens": 0}),
        "beam_search_with_stop": dict(path=CHAT, json={**chat, "use_beam_search": True, "stop": ["."], "top_k": 5}),
        "too_many_samples_streamed": dict(json={**body, "n": 65, "stream": True}),
    }[case]
    return {"path": path, **request}
