"""Tiny random Hugging Face checkpoints, written with numpy (no torch needed).

:func:`write_checkpoint` writes what ``save_pretrained`` of a random HF model would: config.json,
generation_config.json and model.safetensors under HF's parameter names and shapes. The 3.11
leg checks that HF loads them exactly (tests/models/test_hf_references.py); the tests that need
HF's torch model load it from the same directory (``tests.hf_torch.load_hf_model``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import transformers
from safetensors.numpy import save_file
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

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

# The prompts of the stored HF logits (tests/data/hf_tiny_logits.npz): their lengths, and how
# many greedy tokens HF appended to each.
REFERENCE_PROMPT_LENS = (7, 1, 13, 4)
REFERENCE_DECODE_STEPS = 8


def tiny_config(name: str) -> transformers.PretrainedConfig:
    """HF's config of ``TINY_CONFIGS[name]``, as ``save_pretrained`` of its model would write it."""
    options = dict(TINY_CONFIGS[name])
    model_type = options.pop("model_type")
    return transformers.AutoConfig.for_model(model_type, **options, dtype="float32",
                                             architectures=[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]])


def write_checkpoint(name: str, directory) -> transformers.PretrainedConfig:
    """Write a random checkpoint of ``TINY_CONFIGS[name]`` to ``directory``; return its config.

    Seeded, so every call writes the same weights: matrices ~N(0, 0.1), 1-D norm scales
    ~N(1, 0.1) and biases ~N(0, 0.1) (HF would initialise those to 1 and 0).
    """
    config = tiny_config(name)
    directory = Path(directory)
    config.save_pretrained(directory)
    transformers.GenerationConfig.from_model_config(config).save_pretrained(directory)
    save_file(tiny_weights(config), directory / "model.safetensors", metadata={"format": "pt"})
    return config


def tiny_weights(config: transformers.PretrainedConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 random weights under HF's names and shapes for ``config`` (as HF saves them:
    a tied head is left out)."""
    shapes = opt_shapes(config) if config.model_type == "opt" else llama_shapes(config)
    rng = np.random.default_rng(seed)
    return {name: rng.normal(1.0 if len(shape) == 1 and name.endswith("weight") else 0.0, 0.1, shape)
            .astype(np.float32) for name, shape in shapes.items()}


def llama_shapes(config) -> dict[str, tuple[int, ...]]:
    """HF's parameter shapes of a LLaMA, Qwen2 or Mistral model (``LlamaForCausalLM`` and kin)."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    q, kv, ffn = heads * head_dim, config.num_key_value_heads * head_dim, config.intermediate_size
    projections = {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
                   "self_attn.o_proj": (hidden, q), "mlp.gate_proj": (ffn, hidden), "mlp.up_proj": (ffn, hidden),
                   "mlp.down_proj": (hidden, ffn)}
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes[f"{prefix}{norm}.weight"] = (hidden,)
        for projection, shape in projections.items():
            shapes[f"{prefix}{projection}.weight"] = shape
            if _has_bias(config, projection):
                shapes[f"{prefix}{projection}.bias"] = shape[:1]
    return shapes


def _has_bias(config, projection: str) -> bool:
    """Whether HF's LLaMA-family ``projection`` (e.g. "self_attn.q_proj") has a bias."""
    if config.model_type == "qwen2":
        return projection in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    flag = "mlp_bias" if projection.startswith("mlp.") else "attention_bias"
    return getattr(config, flag, False)


def opt_shapes(config) -> dict[str, tuple[int, ...]]:
    """HF's parameter shapes of an OPT model (``OPTForCausalLM``; biases on, the head tied)."""
    hidden, embed, ffn = config.hidden_size, config.word_embed_proj_dim, config.ffn_dim
    prefix = "model.decoder."
    shapes = {f"{prefix}embed_tokens.weight": (config.vocab_size, embed),
              f"{prefix}embed_positions.weight": (config.max_position_embeddings + 2, hidden)}
    if embed != hidden:
        shapes |= {f"{prefix}project_in.weight": (hidden, embed), f"{prefix}project_out.weight": (embed, hidden)}
    if config.do_layer_norm_before and not config._remove_final_layer_norm:
        shapes |= _with_bias(f"{prefix}final_layer_norm", (hidden,))
    for layer in range(config.num_hidden_layers):
        block = f"{prefix}layers.{layer}."
        for projection in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes |= _with_bias(f"{block}self_attn.{projection}", (hidden, hidden))
        for norm in ("self_attn_layer_norm", "final_layer_norm"):
            shapes |= _with_bias(f"{block}{norm}", (hidden,))
        shapes |= _with_bias(f"{block}fc1", (ffn, hidden)) | _with_bias(f"{block}fc2", (hidden, ffn))
    return shapes


def _with_bias(module: str, weight_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """``module``'s weight and bias shapes (the bias as long as the weight's first axis)."""
    return {f"{module}.weight": weight_shape, f"{module}.bias": weight_shape[:1]}


def reference_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """The random prompts (lengths ``REFERENCE_PROMPT_LENS``, ids from 3) of the stored HF logits."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, n).tolist() for n in REFERENCE_PROMPT_LENS]
