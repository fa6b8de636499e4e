"""What a model looks like: one frozen record for every architecture.

``ModelConfig`` is built from a Hugging Face ``config.json`` dict or from a
GGUF file's metadata. It is hashable, so it can be a static argument of a
jitted function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import gguf

SUPPORTED_ARCHITECTURES = ("llama", "opt")
# Hugging Face model types and the architecture that runs them: Mistral and Qwen2 are LLaMA
# with a sliding window (which this engine does not implement, see ``sliding_window``) and,
# for Qwen2, biases on the Q, K and V projections.
HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "opt": "opt"}
# llama.cpp's architectures that run as LLaMA (their biases are read from the tensors present).
GGUF_ARCHITECTURES = ("llama", "qwen2")


class ModelLoadError(ValueError):
    """A model cannot be loaded: missing files, unknown architecture or unsupported options."""


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent RoPE scaling (HF ``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a decoder-only model.

    ``architecture`` is "llama" (LLaMA 1/2/3, SmolLM2, Mistral, Qwen2, ...) or
    "opt". ``attention_bias`` is for the Q, K and V projections,
    ``attention_out_bias`` for the output one. ``sliding_window``: the model was
    trained to attend to only its last that many tokens; the engine attends to the
    whole context, so it keeps ``max_model_len`` within the window, where the two are
    the same. The fields after ``sliding_window`` apply to one architecture only.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    # LLaMA
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    # OPT
    do_layer_norm_before: bool = True
    final_layer_norm: bool = True
    layer_norm_affine: bool = True
    word_embed_proj_dim: int | None = None
    activation: str = "relu"

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"{self.num_heads} attention heads are not a multiple of {self.num_kv_heads} KV heads")

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head (1 without GQA)."""
        return self.num_heads // self.num_kv_heads


def from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Build a config from a Hugging Face ``config.json`` dict."""
    model_type = hf.get("model_type")
    builders = {"llama": _llama_from_hf, "opt": _opt_from_hf}
    if not isinstance(model_type, str) or model_type not in HF_MODEL_TYPES:
        if hf.get("auto_map"):
            raise ModelLoadError(
                f"this model's code ships with it (config.json auto_map: {sorted(hf['auto_map'])}); this engine "
                f"runs no remote code, whatever trust_remote_code says, and implements the model types "
                f"{', '.join(HF_MODEL_TYPES)}")
        raise ModelLoadError(
            f"unsupported model_type {model_type!r} (architectures {hf.get('architectures')}); "
            f"supported: {', '.join(HF_MODEL_TYPES)}")
    try:
        return builders[HF_MODEL_TYPES[model_type]](hf)
    except KeyError as missing:
        raise ModelLoadError(f"the {model_type} config has no {missing}") from None


def _common_from_hf(hf: Mapping[str, Any], tie_default: bool) -> dict[str, Any]:
    """Fields every architecture has; ``tie_default`` is HF's default for the model type."""
    eos = hf.get("eos_token_id")
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=hf.get("tie_word_embeddings", tie_default),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
    )


def _llama_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """LLaMA and the model types :data:`HF_MODEL_TYPES` runs as LLaMA."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{hf['model_type']} with hidden_act {hf['hidden_act']!r} is not supported, only 'silu'")
    qwen2 = hf["model_type"] == "qwen2"
    attention_bias = qwen2 or hf.get("attention_bias", False)
    # Mistral's window applies whenever it is set; Qwen2's only with use_sliding_window.
    window = hf.get("sliding_window") if hf.get("use_sliding_window", not qwen2) else None
    return ModelConfig(
        architecture="llama",
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"],
        attention_bias=attention_bias,
        attention_out_bias=attention_bias and not qwen2,
        mlp_bias=hf.get("mlp_bias", False),
        sliding_window=window,
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_scaling=_rope_scaling(rope),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        **_common_from_hf(hf, tie_default=False),
    )


def _rope_scaling(rope: Mapping[str, Any]) -> Llama3RopeScaling | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "llama3":
        return Llama3RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    raise ModelLoadError(f"RoPE scaling {rope_type!r} is not supported; supported: default, llama3")


def _opt_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    heads = hf["num_attention_heads"]
    pre_norm = hf.get("do_layer_norm_before", True)
    return ModelConfig(
        architecture="opt",
        num_kv_heads=heads,
        head_dim=hf["hidden_size"] // heads,
        intermediate_size=hf["ffn_dim"],
        attention_bias=hf.get("enable_bias", True),
        attention_out_bias=hf.get("enable_bias", True),
        mlp_bias=hf.get("enable_bias", True),
        do_layer_norm_before=pre_norm,
        final_layer_norm=pre_norm and not hf.get("_remove_final_layer_norm", False),
        layer_norm_affine=hf.get("layer_norm_elementwise_affine", True),
        word_embed_proj_dim=hf.get("word_embed_proj_dim") or hf["hidden_size"],
        activation=hf.get("activation_function", "relu"),
        **_common_from_hf(hf, tie_default=True),
    )


def from_gguf(metadata: Mapping[str, Any], vocab_size: int, tie_word_embeddings: bool) -> ModelConfig:
    """Build a config from GGUF metadata (key → Python value, as ``ReaderField.contents()`` gives).

    ``vocab_size`` comes from the embedding tensor and ``tie_word_embeddings``
    from whether the file has an ``output.weight`` tensor.
    """
    arch = metadata[gguf.Keys.General.ARCHITECTURE]
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}")

    def key(template: str, default: Any = None) -> Any:
        value = metadata.get(template.format(arch=arch), default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata has no {template.format(arch=arch)!r}")
        return value

    heads = key(gguf.Keys.Attention.HEAD_COUNT)
    hidden = key(gguf.Keys.LLM.EMBEDDING_LENGTH)
    eos = metadata.get(gguf.Keys.Tokenizer.EOS_ID)
    if metadata.get(gguf.Keys.Rope.SCALING_TYPE, "none") != "none":
        raise ModelLoadError(f"GGUF RoPE scaling {metadata[gguf.Keys.Rope.SCALING_TYPE]!r} is not supported")
    return ModelConfig(
        architecture="llama",
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_layers=key(gguf.Keys.LLM.BLOCK_COUNT),
        num_heads=heads,
        num_kv_heads=key(gguf.Keys.Attention.HEAD_COUNT_KV, heads),
        head_dim=key(gguf.Keys.Attention.KEY_LENGTH, hidden // heads),
        intermediate_size=key(gguf.Keys.LLM.FEED_FORWARD_LENGTH),
        max_position_embeddings=key(gguf.Keys.LLM.CONTEXT_LENGTH),
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=metadata.get(gguf.Keys.Tokenizer.BOS_ID),
        eos_token_ids=() if eos is None else (eos,),
        rope_theta=float(key(gguf.Keys.Rope.FREQ_BASE, 10000.0)),
        rms_norm_eps=float(key(gguf.Keys.Attention.LAYERNORM_RMS_EPS)),
    )
