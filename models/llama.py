"""LLaMA 1/2/3 and compatible models (SmolLM2, TinyLlama, ...): RMSNorm, RoPE, SwiGLU, GQA.

Parameters (layout in :mod:`models.layers`)::

    {"embed": [vocab, hidden],
     "layers": [{"attn_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down"}, ...],
     "final_norm": {"scale": [hidden]},
     "lm_head": {"w": [hidden, vocab]},      # absent with tied embeddings
     "rope": {"cos", "sin"}}                 # float32 [positions, head_dim / 2], not weights

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
    """Token embeddings, and the RoPE tables every layer rotates by.

    input_ids, positions: int32[T] → (float32 [T, hidden], (cos, sin) float32[T, 1, d/2]).
    The tables are rows of ``params["rope"]`` (:func:`models.layers.rope_table`), gathered
    once a step, so the layer programs of a prompt step take them as arguments.
    """
    return layers.embedding(params["embed"], input_ids), layers.rotary(positions, params["rope"])


def layer(config: ModelConfig, p, x, rope, metadata, kv_cache):
    """One pre-norm decoder layer. x: [T, hidden]; rope: (cos, sin) from :func:`embed` →
    ([T, hidden], kv_cache)."""
    eps = config.rms_norm_eps
    x, kv_cache = layers.attention(config, p, x, metadata, kv_cache, rope, norm=(p["attn_norm"], eps), residual=x)
    return layers.gated_mlp(p, x, norm=(p["mlp_norm"], eps), residual=x), kv_cache


def head(config: ModelConfig, params, x, rows, argmax_rows=None):
    """Logits of the tokens ``rows``. x: [T, hidden]; rows: int32[L] → float32[L, vocab]; with
    argmax_rows (int32 []), rows below it may hold only their arg-max exactly (:func:`layers.logits`)."""
    h = layers.rms_norm(x[rows], params["final_norm"], config.rms_norm_eps)
    return layers.logits(params, h, argmax_rows)


def params_from_hf(config: ModelConfig, get: Callable[[str], np.ndarray], put: Callable):
    """Build the parameter pytree from Hugging Face tensors, one layer at a time.

    get(name) returns the HF tensor ``name`` (``[out, in]`` for linears);
    put(tree) turns a NumPy tree into device arrays, so at most one layer is
    held twice.
    """
    hidden = (config.hidden_size,)
    params = {
        "embed": put(layers.tensor_from_hf(get, "model.embed_tokens.weight", (config.vocab_size, *hidden))),
        "layers": [put(_layer_from_hf(config, get, f"model.layers.{i}.")) for i in range(config.num_layers)],
        "final_norm": put({"scale": layers.tensor_from_hf(get, "model.norm.weight", hidden)}),
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = put(layers.linear_from_hf(get, "lm_head", False, (config.vocab_size, *hidden)))
    # float32 whatever the weights' dtype (``put`` casts): HF rotates in float32 too.
    params["rope"] = {key: jnp.asarray(table) for key, table in layers.rope_table(config).items()}
    return params


def _layer_from_hf(config: ModelConfig, get, prefix: str):
    mlp, hidden, inner = prefix + "mlp.", config.hidden_size, config.intermediate_size
    shapes = {"gate": (inner, hidden), "up": (inner, hidden), "down": (hidden, inner)}
    return {
        "attn_norm": {"scale": layers.tensor_from_hf(get, prefix + "input_layernorm.weight", (hidden,))},
        **layers.attention_from_hf(get, prefix + "self_attn.", "o_proj", config),
        "mlp_norm": {"scale": layers.tensor_from_hf(get, prefix + "post_attention_layernorm.weight", (hidden,))},
        **{key: layers.linear_from_hf(get, f"{mlp}{key}_proj", config.mlp_bias, shape)
           for key, shape in shapes.items()},
    }
