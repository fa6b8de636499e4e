"""LLaMA 1/2/3 and compatible models (SmolLM2, TinyLlama, ...): RMSNorm, RoPE, SwiGLU, GQA.

Parameters (layout in :mod:`models.layers`)::

    {"embed": [vocab, hidden],
     "layers": [{"attn_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down"}, ...],
     "final_norm": {"scale": [hidden]},
     "lm_head": {"w": [hidden, vocab]}}      # absent with tied embeddings

Layers are a Python list of per-layer arrays (faster on CPU than ``scan`` over
stacked weights); the stages (``embed``, ``layer``, ``head``) are composed by
:func:`models.forward_fn` or run one by one by the engine.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from models import layers
from models.config import ModelConfig


def embed(config: ModelConfig, params, input_ids, positions):
    """Token embeddings. input_ids, positions: int32[T] → float32 [T, hidden]."""
    return params["embed"][input_ids].astype(jnp.float32)


def layer(config: ModelConfig, p, x, positions, metadata, kv_cache):
    """One pre-norm decoder layer. x: [T, hidden]; positions: int32[T] → ([T, hidden], kv_cache)."""
    rope = layers.rotary(positions, layers.rope_inv_freq(config))
    h = layers.rms_norm(x, p["attn_norm"], config.rms_norm_eps)
    attn, kv_cache = layers.attention(config, p, h, metadata, kv_cache, rope)
    x = x + attn
    h = layers.rms_norm(x, p["mlp_norm"], config.rms_norm_eps)
    return x + layers.gated_mlp(p, h), kv_cache


def head(config: ModelConfig, params, x, rows):
    """Logits of the tokens ``rows``. x: [T, hidden]; rows: int32[L] → float32[L, vocab]."""
    h = layers.rms_norm(x[rows], params["final_norm"], config.rms_norm_eps)
    return layers.logits(params, h)


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
        **layers.attention_from_hf(get, prefix + "self_attn.", "o_proj", config),
        "mlp_norm": {"scale": get(prefix + "post_attention_layernorm.weight")},
        **{key: layers.linear_from_hf(get, f"{mlp}{key}_proj", config.mlp_bias) for key in ("gate", "up", "down")},
    }
