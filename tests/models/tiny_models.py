"""Tiny random Hugging Face checkpoints and their reference outputs."""

from __future__ import annotations

import torch
import transformers

_LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=128, initializer_range=0.1)
_OPT = dict(model_type="opt", vocab_size=256, hidden_size=64, ffn_dim=96, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=64, init_std=0.1)

TINY_CONFIGS = {
    "llama_mha_bias": dict(_LLAMA, num_key_value_heads=4, tie_word_embeddings=False,
                           attention_bias=True, mlp_bias=True),
    "llama_gqa_tied": dict(_LLAMA, num_key_value_heads=2, tie_word_embeddings=True),
    "llama_mqa_untied": dict(_LLAMA, num_key_value_heads=1, tie_word_embeddings=False),
    "llama3_rope": dict(_LLAMA, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=50000.0,
                        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=32)),
    # Qwen2: biases on Q, K and V only. Mistral: a sliding window longer than the tests' sequences.
    "qwen2": dict(_LLAMA, model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1e6),
    "mistral": dict(_LLAMA, model_type="mistral", num_key_value_heads=2, tie_word_embeddings=False,
                    sliding_window=96),
    "opt": dict(_OPT),
    "opt_project_in_out": dict(_OPT, word_embed_proj_dim=32),
    "opt_post_norm": dict(_OPT, word_embed_proj_dim=32, do_layer_norm_before=False),
}


def build_hf_model(name: str, directory) -> transformers.PreTrainedModel:
    """A random HF model for ``TINY_CONFIGS[name]``, saved to ``directory``.

    Norm scales and biases are randomised too (HF initialises them to 1 and 0).
    """
    options = dict(TINY_CONFIGS[name])
    config = transformers.AutoConfig.for_model(options.pop("model_type"), **options)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.ndim == 1:
                param.normal_(1.0 if param_name.endswith("weight") else 0.0, 0.1)
    model.save_pretrained(directory)
    return model


def hf_greedy_logits(model, prompt, new_tokens):
    """Greedy-extend ``prompt`` by ``new_tokens`` with HF; return (all ids, float32[len, vocab] logits)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
    return ids, logits

