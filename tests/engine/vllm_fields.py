"""The request fields of vLLM's OpenAI server, which ``test_request_fields``' table must cover."""

# vLLM's request fields (vllm/entrypoints/openai/protocol.py, CompletionRequest and
# ChatCompletionRequest, mid 2025), and OpenAI's that may change an answer.
VLLM_FIELDS = {
    "completions": "model prompt prompt_embeds best_of echo frequency_penalty logit_bias logprobs max_tokens n "
                   "presence_penalty seed stop stream stream_options suffix temperature top_p user use_beam_search "
                   "top_k min_p repetition_penalty length_penalty stop_token_ids include_stop_str_in_output "
                   "ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens "
                   "allowed_token_ids prompt_logprobs add_special_tokens response_format guided_json guided_regex "
                   "guided_choice guided_grammar guided_decoding_backend guided_whitespace_pattern priority "
                   "request_id logits_processors return_tokens_as_token_ids cache_salt kv_transfer_params "
                   "vllm_xargs bad_words structured_outputs",
    "chat": "messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens n "
            "presence_penalty response_format seed stop stream stream_options temperature top_p tools tool_choice "
            "reasoning_effort include_reasoning parallel_tool_calls user best_of use_beam_search top_k min_p "
            "repetition_penalty length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens "
            "skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens prompt_logprobs "
            "allowed_token_ids bad_words echo add_generation_prompt continue_final_message add_special_tokens "
            "documents chat_template chat_template_kwargs mm_processor_kwargs guided_json guided_regex "
            "guided_choice guided_grammar structural_tag guided_decoding_backend guided_whitespace_pattern "
            "priority request_id logits_processors return_tokens_as_token_ids cache_salt kv_transfer_params "
            "vllm_xargs structured_outputs functions function_call modalities audio web_search_options verbosity "
            "store metadata service_tier prediction",
}
