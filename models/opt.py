"""OPT (125m to 66b layouts): learned positions, LayerNorm, ReLU MLP, biases.

Parameters (layout in :mod:`models.layers`)::

    {"embed": [vocab, word_embed_proj_dim],
     "pos_embed": [max_positions + 2, hidden],     # OPT offsets positions by 2
     "project_in": {"w"}, "project_out": {"w"},    # only when word_embed_proj_dim != hidden (opt-350m)
     "layers": [{"attn_norm", "q", "k", "v", "o", "mlp_norm", "fc1", "fc2"}, ...],
     "final_norm": {"scale", "bias"},              # only with do_layer_norm_before
     "lm_head": {"w": [word_embed_proj_dim, vocab]}}  # absent with tied embeddings
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from models import layers
from models.config import ModelConfig, ModelLoadError

POSITION_OFFSET = 2


def embed(config: ModelConfig, params, input_ids, positions):
    """Token plus learned position embeddings. input_ids, positions: int32[T] → (float32
    [T, hidden], ()): the layers need nothing more about positions."""
    x = layers.embedding(params["embed"], input_ids)
    if "project_in" in params:
        x = layers.linear(x, params["project_in"])
    return x + params["pos_embed"][positions + POSITION_OFFSET], ()


def layer(config: ModelConfig, p, x, positional, metadata, kv_cache):
    """One decoder layer (learned positions: ``positional`` is the empty tuple :func:`embed` returns)."""
    return _block(config, p, x, metadata, kv_cache)


def head(config: ModelConfig, params, x, rows, argmax_rows=None):
    """Logits of the tokens ``rows``. x: [T, hidden]; rows: int32[L] → float32[L, vocab]; with
    argmax_rows (int32 []), rows below it may hold only their arg-max exactly (:func:`layers.logits`)."""
    h = x[rows]
    if "final_norm" in params:
        h = layers.layer_norm(h, params["final_norm"])
    if "project_out" in params:
        h = layers.linear(h, params["project_out"])
    return layers.logits(params, h, argmax_rows)


def _block(config: ModelConfig, p, x, metadata, kv_cache):
    """One decoder layer, pre- or post-norm. x: [T, hidden] → ([T, hidden], kv_cache)."""
    pre_norm = config.do_layer_norm_before
    h = layers.layer_norm(x, p["attn_norm"]) if pre_norm else x
    attn, kv_cache = layers.attention(config, p, h, metadata, kv_cache)
    x = x + attn
    if not pre_norm:
        x = layers.layer_norm(x, p["attn_norm"])
    h = layers.layer_norm(x, p["mlp_norm"]) if pre_norm else x
    x = x + layers.linear(layers.ACTIVATIONS[config.activation](layers.linear(h, p["fc1"])), p["fc2"])
    if not pre_norm:
        x = layers.layer_norm(x, p["mlp_norm"])
    return x, kv_cache


def params_from_hf(config: ModelConfig, get: Callable[[str], np.ndarray], put: Callable):
    """Build the parameter pytree from Hugging Face tensors, one layer at a time (see ``llama.params_from_hf``)."""
    if config.activation not in layers.ACTIVATIONS:
        raise ModelLoadError(f"OPT activation {config.activation!r} is not supported; "
                             f"supported: {', '.join(layers.ACTIVATIONS)}")
    root, embed = _decoder_root(get)
    hidden, words = config.hidden_size, config.word_embed_proj_dim
    params = {
        "embed": put(layers.checked(embed, root + "embed_tokens.weight", (config.vocab_size, words))),
        "pos_embed": put(layers.tensor_from_hf(get, root + "embed_positions.weight",
                                               (config.max_position_embeddings + POSITION_OFFSET, hidden))),
        "layers": [put(_layer_from_hf(config, get, f"{root}layers.{i}.")) for i in range(config.num_layers)],
    }
    if words != hidden:
        params["project_in"] = put(layers.linear_from_hf(get, root + "project_in", False, (hidden, words)))
        params["project_out"] = put(layers.linear_from_hf(get, root + "project_out", False, (words, hidden)))
    if config.final_layer_norm:
        params["final_norm"] = put(_norm_from_hf(config, get, root + "final_layer_norm"))
    if not config.tie_word_embeddings:
        params["lm_head"] = put(layers.linear_from_hf(get, "lm_head", False, (config.vocab_size, words)))
    return params


def _decoder_root(get) -> tuple[str, np.ndarray]:
    """The prefix of the decoder's tensors, and its token embeddings. Checkpoints saved by
    recent transformers say ``model.decoder.``; the original facebook/opt ones, ``decoder.``."""
    try:
        return "model.decoder.", get("model.decoder.embed_tokens.weight")
    except ModelLoadError:
        return "decoder.", get("decoder.embed_tokens.weight")


def _layer_from_hf(config: ModelConfig, get, prefix: str):
    ffn = config.intermediate_size
    return {
        "attn_norm": _norm_from_hf(config, get, prefix + "self_attn_layer_norm"),
        **layers.attention_from_hf(get, prefix + "self_attn.", "out_proj", config),
        "mlp_norm": _norm_from_hf(config, get, prefix + "final_layer_norm"),
        "fc1": layers.linear_from_hf(get, prefix + "fc1", config.mlp_bias, (ffn, config.hidden_size)),
        "fc2": layers.linear_from_hf(get, prefix + "fc2", config.mlp_bias, (config.hidden_size, ffn)),
    }


def _norm_from_hf(config: ModelConfig, get, name: str):
    if not config.layer_norm_affine:
        return {}
    shape = (config.hidden_size,)
    return {"scale": layers.tensor_from_hf(get, name + ".weight", shape),
            "bias": layers.tensor_from_hf(get, name + ".bias", shape)}
