"""LLaMA 1/2/3 and compatible models (SmolLM2, TinyLlama, ...): RMSNorm, RoPE, SwiGLU, GQA.

Parameters (layout in :mod:`models.layers`)::

    {"embed": [vocab, hidden],
     "layers": [{"attn_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down"}, ...],
     "final_norm": {"scale": [hidden]},
     "lm_head": {"w": [hidden, vocab]}}      # absent with tied embeddings

Layers are a Python list unrolled by the forward pass: per-layer arrays are
faster on CPU than ``scan`` over stacked weights.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from models import layers
from models.config import ModelConfig


def forward(config: ModelConfig, params, input_ids, positions, metadata, kv_caches):
    """One model step over a ragged batch.

    input_ids, positions: int32[T]; metadata: :class:`models.metadata.Metadata`;
    kv_caches: per layer (k_cache, v_cache), each [kv_heads, blocks, block_size, head_dim].
    Returns (float32[L, vocab] logits for ``metadata.logits_indices``, new kv_caches).
    """
    x = params["embed"][input_ids]
    rope = layers.rotary(positions, layers.rope_inv_freq(config))
    new_caches = []
    for p, kv_cache in zip(params["layers"], kv_caches, strict=True):
        x, kv_cache = _block(config, p, x, metadata, kv_cache, rope)
        new_caches.append(kv_cache)
    h = layers.rms_norm(x[metadata.logits_indices], params["final_norm"], config.rms_norm_eps)
    return layers.logits(params, h), new_caches


def _block(config: ModelConfig, p, x, metadata, kv_cache, rope):
    """One pre-norm decoder layer. x: [T, hidden] → ([T, hidden], kv_cache)."""
    h = layers.rms_norm(x, p["attn_norm"], config.rms_norm_eps)
    attn, kv_cache = layers.attention(config, p, h, metadata, kv_cache, rope)
    x = x + attn
    h = layers.rms_norm(x, p["mlp_norm"], config.rms_norm_eps)
    return x + layers.gated_mlp(p, h), kv_cache


def params_from_hf(config: ModelConfig, get: Callable[[str], np.ndarray], put: Callable):
    """Build the parameter pytree from Hugging Face tensors, one layer at a time.

    get(name) returns the HF tensor ``name`` (``[out, in]`` for linears);
    put(tree) turns a NumPy tree into device arrays, so at most one layer is
    held twice.
    """
    params = {
        "embed": put(get("model.embed_tokens.weight")),
        "layers": [put(_layer_from_hf(config, get, f"model.layers.{i}.")) for i in range(config.num_layers)],
        "final_norm": put({"scale": get("model.norm.weight")}),
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = put(layers.linear_from_hf(get, "lm_head", bias=False))
    return params


def _layer_from_hf(config: ModelConfig, get, prefix: str):
    mlp = prefix + "mlp."
    return {
        "attn_norm": {"scale": get(prefix + "input_layernorm.weight")},
        **layers.attention_from_hf(get, prefix + "self_attn.", "o_proj", config.attention_bias),
        "mlp_norm": {"scale": get(prefix + "post_attention_layernorm.weight")},
        **{key: layers.linear_from_hf(get, f"{mlp}{key}_proj", config.mlp_bias) for key in ("gate", "up", "down")},
    }
