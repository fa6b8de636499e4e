"""Building blocks shared by the models, and the parameter layout they expect.

Every matmul weight is stored ``[in, out]`` so a projection is a plain
``x @ w`` (XLA:CPU picks its fast kernels for that form).

* linear: ``{"w": [in, out], "b": [out]}``, ``"b"`` only when the model has biases.
* norm: ``{"scale": [d], "bias": [d]}``, either may be absent.
* attention: linears ``"q"`` (output columns head-major, ``[heads, head_dim]``),
  ``"k"`` and ``"v"`` (``[kv_heads, head_dim]``) and ``"o"``; query head h
  reads KV head ``h // queries_per_kv``.

Q/K/V and gate/up stay separate weights. Q/K/V are multiplied together (:func:`linears`):
packed ones in one native call, faster than three. Gate and up, with SwiGLU's gating, go to
:func:`pallas_paged.gated_matmul`: packed, one native call that writes only the gated result.
A pre-norm layer's RMSNorm and residual adds go into those calls too (``norm=``, ``residual=``),
so at one row no XLA kernel sits between its products but the rotary embedding and the KV writes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pallas_paged
from models.config import ModelConfig, ModelLoadError
from models.sharding import AXIS

ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
}


def linear(x, p, *, norm=None, residual=None):
    """x: [T, in] → float32 [T, out] with ``p = {"w": [in, out], "b"?: [out]}``.

    The product (:func:`pallas_paged.matmul`) runs in the weights' dtype with float32
    accumulation and a float32 result: activations stay float32 between layers whatever the
    weights are. ``w`` may be packed for the native CPU product (:func:`packed_for_cpu`).
    norm: (RMSNorm params, eps), applied to x first; residual: [T, out], added to the result.
    """
    return linears(x, [p], norm=norm, residual=residual)[0]


def linears(x, ps, *, norm=None, residual=None) -> list:
    """``[linear(x, p) for p in ps]`` (norm and residual as there, the residual with one p only),
    in one call where the products can be (:func:`pallas_paged.matmuls`, which takes the norm
    and the residual into the call without biases). x: [T, in] → float32 [T, out_j] each."""
    ws = [p["w"] for p in ps]
    if not any("b" in p for p in ps):
        return pallas_paged.matmuls(x, ws, **_rms_norm_args(norm), residual=residual)
    ys = pallas_paged.matmuls(x, ws, **_rms_norm_args(norm))
    ys = [y + p["b"].astype(jnp.float32) if "b" in p else y for y, p in zip(ys, ps)]
    return ys if residual is None else [residual + ys[0]]


def _rms_norm_args(norm) -> dict:
    """(RMSNorm params, eps) or None → the products' ``rms_scale`` and ``eps`` arguments."""
    return {} if norm is None else {"rms_scale": norm[0]["scale"], "eps": norm[1]}


def packed_for_cpu(params, *, consume: bool = False):
    """``params`` with every linear weight :func:`pallas_paged.packable` packed for the native
    CPU product, and a tied embedding given a packed copy of itself as the head
    (``"lm_head"``: for SmolLM2, 57 MB more in bfloat16, 113 MB in float32, and in float32 a
    bfloat16 screen for steps that take only arg-maxes, :func:`pallas_paged.argmax_screen`, 57 MB
    more); the same params where nothing packs.

    ``consume``: pack in ``params``' own dicts and lists, and return them. A weight's last
    reference then goes as soon as its packed copy exists, so loading peaks at about one
    weight over the model's size instead of twice it (float32 SmolLM2: 1.2 GB instead of
    1.6 GB); the caller must hold no other reference to the tree or its weights."""
    def visit(node):
        if isinstance(node, list):
            node = node if consume else list(node)
            node[:] = [visit(child) for child in node]
        elif isinstance(node, dict):
            node = node if consume else dict(node)
            for key in list(node):
                node[key] = visit(node[key])
            if not isinstance(node.get("w", {}), dict) and pallas_paged.packable(node["w"]):
                node["w"] = pallas_paged.pack(node["w"])
        return node
    packed = visit(params)
    if "lm_head" not in packed and pallas_paged.packable(packed["embed"].T):
        packed["lm_head"] = {"w": pallas_paged.pack(packed["embed"].T)}
        if pallas_paged.screenable(packed["embed"]):  # float32: 57 MB more for SmolLM2
            packed["lm_head"].update(pallas_paged.argmax_screen(packed["embed"]))
    return packed


def embedding(table, input_ids):
    """Rows ``input_ids`` of ``table``: [vocab, hidden] → float32 [T, hidden] (input_ids int32[T]).

    Under a mesh with a ``"tp"`` axis the table is split over the vocabulary
    (:mod:`models.sharding`): each device takes the rows it holds, zeros for the others, and
    one all-reduce sums them (Megatron's vocabulary-parallel embedding). Left to XLA's
    partitioner, the lookup gathered the whole table on every device at every step (525 MB for
    Llama-3.2-1B in bfloat16).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if AXIS not in mesh.axis_names or mesh.shape[AXIS] == 1:
        return table[input_ids].astype(jnp.float32)

    def own_rows(table, input_ids):
        rows = table.shape[0]
        index = input_ids - jax.lax.axis_index(AXIS) * rows
        held = (index >= 0) & (index < rows)
        found = table[jnp.clip(index, 0, rows - 1)].astype(jnp.float32)
        return jax.lax.psum(jnp.where(held[:, None], found, 0.0), AXIS)

    return jax.shard_map(own_rows, mesh=mesh, in_specs=(P(AXIS, None), P()), out_specs=P(), check_vma=False)(
        table, input_ids)


def rms_norm(x, p, eps):
    """RMSNorm over the last axis, computed in float32. x: [T, d] → [T, d] in x's dtype."""
    return pallas_paged.rms_norm(x, p["scale"], eps)


def layer_norm(x, p, eps=1e-5):
    """LayerNorm over the last axis, computed in float32. x: [T, d] → [T, d] in x's dtype."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = ((xf - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    y = y * p["scale"] if "scale" in p else y
    return y + p["bias"] if "bias" in p else y


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Rotary inverse frequencies, float32[head_dim // 2], with Llama 3 scaling if configured."""
    d = config.head_dim
    inv_freq = np.float32(1.0) / np.float32(config.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / d)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > old_len / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= old_len / scaling.high_freq_factor) & (wavelen <= old_len / scaling.low_freq_factor)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_table(config: ModelConfig) -> dict[str, np.ndarray]:
    """The rotary angles' cosines and sines at every position the model takes:
    {"cos", "sin"}: float32[max_position_embeddings, head_dim // 2].

    The angles are float32 products, as HF computes them; their cosines and sines are
    rounded from float64. A step gathers its rows (:func:`rotary`): XLA:CPU would otherwise
    compute each sine one element at a time, in every use (each layer's queries and keys),
    which took 7% of a 32-row bfloat16 decode step of SmolLM2."""
    positions = np.arange(config.max_position_embeddings, dtype=np.float32)
    angles = (positions[:, None] * rope_inv_freq(config)[None, :]).astype(np.float64)
    return {"cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)}


def rotary(positions, table):
    """This step's rows of :func:`rope_table`. positions: int32[T] → (cos, sin), each
    float32[T, 1, d/2]."""
    return table["cos"][positions][:, None], table["sin"][positions][:, None]


def apply_rope(x, cos, sin):
    """Rotate halves (the HF LLaMA convention). x: [T, heads, d]; cos, sin: [T, 1, d/2] → [T, heads, d]."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention(config: ModelConfig, p, x, metadata, kv_cache, rope=None, *, norm=None, residual=None):
    """Self-attention through the paged KV cache.

    x: [T, hidden]; p: {"q", "k", "v", "o"} linears; kv_cache: (k_cache,
    v_cache), each [kv_heads, blocks, block_size, head_dim]; rope: optional
    (cos, sin) from :func:`rotary`; norm: (RMSNorm params, eps) applied to x first;
    residual: [T, hidden] added to the result. Writes this step's K and V, then attends.
    Returns ([T, hidden], (k_cache, v_cache)).
    """
    tokens = x.shape[0]
    q, k, v = linears(x, [p["q"], p["k"], p["v"]], norm=norm)
    q = q.reshape(tokens, config.num_heads, config.head_dim)
    k = k.reshape(tokens, config.num_kv_heads, config.head_dim)
    v = v.reshape(tokens, config.num_kv_heads, config.head_dim)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    out, kv_cache = metadata.write_and_attend(q, k, v, kv_cache, scale=config.head_dim ** -0.5)
    return linear(out.reshape(tokens, -1), p["o"], residual=residual), kv_cache


def gated_mlp(p, x, *, norm=None, residual=None):
    """SwiGLU MLP. x: [T, hidden]; p: {"gate", "up", "down"} linears; norm and residual as in
    :func:`attention` → [T, hidden]."""
    if "b" in p["gate"] or "b" in p["up"]:
        gate, up = linears(x, [p["gate"], p["up"]], norm=norm)
        gated = jax.nn.silu(gate) * up
    else:
        gated = pallas_paged.gated_matmul(x, p["gate"]["w"], p["up"]["w"], **_rms_norm_args(norm))
    return linear(gated, p["down"], residual=residual)


def logits(params, h, argmax_rows=None):
    """Vocabulary logits. h: [L, hidden'] → float32[L, vocab], tied to ``params["embed"]`` without an lm_head.

    argmax_rows: int32 [] or None. Rows below it need only their arg-max: where the head has a
    screen (a tied float32 head packed for the CPU, :func:`pallas_paged.argmax_head`), their
    logits are exact only where they may be the largest and a bfloat16 product's (below it)
    elsewhere, and the rows from it on are padding; elsewhere, or when it is 0 or None, every
    logit is exact."""
    if "lm_head" in params:
        if argmax_rows is not None and "screen" in params["lm_head"]:
            return pallas_paged.argmax_head(h, params["lm_head"], params["embed"], argmax_rows)
        return linear(h, params["lm_head"])
    return pallas_paged.matmul(h, params["embed"], transposed=True)  # embed: [vocab, hidden], no copy


def tensor_from_hf(get, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """HF tensor ``name``, which must have the ``shape`` the config implies (see :func:`checked`)."""
    return checked(get(name), name, shape)


def checked(array: np.ndarray, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """``array`` (HF tensor ``name``) if it has ``shape``: a checkpoint whose config disagrees
    with its tensors (a vocabulary of 300 over 256 embedding rows, say) is refused here, as HF
    refuses it, rather than run wrongly."""
    if tuple(array.shape) != tuple(shape):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(array.shape)}, but the config implies "
                             f"{tuple(shape)}; the config and the weights disagree")
    return array


def linear_from_hf(get, name: str, bias: bool, shape: tuple[int, int]):
    """HF linear ``name`` (``.weight: [out, in]`` = ``shape``, ``.bias: [out]``) → a linear in this layout."""
    weight = tensor_from_hf(get, name + ".weight", shape).T
    return {"w": weight, "b": tensor_from_hf(get, name + ".bias", shape[:1])} if bias else {"w": weight}


def attention_from_hf(get, prefix: str, out_name: str, config: ModelConfig):
    """HF ``{prefix}q_proj``, ``k_proj``, ``v_proj`` and ``{prefix}{out_name}`` → the attention
    linears, with biases as ``config.attention_bias`` (Q, K, V) and ``attention_out_bias`` say."""
    hidden, queries, keys = (config.hidden_size, config.num_heads * config.head_dim,
                             config.num_kv_heads * config.head_dim)
    shapes = {"q": ("q_proj", queries), "k": ("k_proj", keys), "v": ("v_proj", keys)}
    linears = {key: linear_from_hf(get, prefix + name, config.attention_bias, (out, hidden))
               for key, (name, out) in shapes.items()}
    return {**linears, "o": linear_from_hf(get, prefix + out_name, config.attention_out_bias, (hidden, queries))}
