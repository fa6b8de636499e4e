"""Matrix products for the models: ``x @ w`` in the weights' dtype, accumulated and
returned in float32.

On a CPU with AVX512-BF16, bfloat16 and float32 weights can be packed ahead of time
(:func:`pack`; the engine packs every weight it can when it loads a checkpoint, with
:func:`models.packed_for_cpu`) for the native product (:func:`pallas_paged.native.matmul`).
A packed weight holds 64 output columns per panel, read in memory order:

* bfloat16: uint32 ``[N/64, K/2, 64]``, each word the pair of bfloat16 ``(w[2s, n],
  w[2s+1, n])`` that one ``VDPBF16PS`` lane multiplies;
* float32: float32 ``[N/64, K, 64]``.

:func:`gated_matmul` does SwiGLU's gate and up products and the gating in one native call.
:func:`argmax_head` is a float32 head tied to its embedding that, for steps that only take
each row's arg-max, multiplies a bfloat16 copy (:func:`argmax_screen`) and computes exactly
only the logits that can be the largest. Everything else runs XLA's dot.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_paged import native
from pallas_paged.precision import for_operands

PANEL = 64  # output columns per panel of a packed weight


def packing_enabled() -> bool:
    """Whether weights get packed here: on a CPU whose native product runs, outside a device
    mesh (where XLA partitions the product), unless ``PALLAS_PAGED_CPU_MATMUL=xla`` (for
    comparisons)."""
    if os.environ.get("PALLAS_PAGED_CPU_MATMUL", "native") == "xla":
        return False
    if jax.default_backend() != "cpu" or jax.sharding.get_abstract_mesh().axis_names:
        return False
    return native.matmul_available()


_PACKED_DTYPES = {np.dtype(jnp.bfloat16): np.dtype(jnp.uint32), np.dtype(jnp.float32): np.dtype(jnp.float32)}


def packable(w) -> bool:
    """Whether :func:`pack` applies to ``w`` here: bfloat16 (with K even) or float32
    ``[K, N]``, N a multiple of 64, where :func:`packing_enabled`."""
    if w.ndim != 2 or np.dtype(w.dtype) not in _PACKED_DTYPES or w.shape[1] % PANEL:
        return False
    if np.dtype(w.dtype) == np.dtype(jnp.bfloat16) and w.shape[0] % 2:
        return False
    return packing_enabled()


def is_packed(w) -> bool:
    """Whether ``w`` is a weight :func:`pack` made."""
    return w.ndim == 3 and np.dtype(w.dtype) in _PACKED_DTYPES.values() and w.shape[2] == PANEL


def _input_dtype(packed):
    """The dtype the native product takes x in, for a packed weight: bfloat16 for uint32 pairs."""
    return jnp.bfloat16 if np.dtype(packed.dtype) == np.dtype(jnp.uint32) else jnp.float32


@jax.jit
def pack(w):
    """bfloat16 w: [K, N] → uint32 [N/64, K/2, 64]; float32 w: [K, N] → [N/64, K, 64]: the
    native product's layouts (see above)."""
    k, n = w.shape
    if w.dtype == jnp.float32:
        return w.reshape(k, n // PANEL, PANEL).transpose(1, 0, 2)
    pairs = jax.lax.bitcast_convert_type(w.reshape(k // 2, 2, n).transpose(0, 2, 1), jnp.uint32)  # [K/2, N]
    return pairs.reshape(k // 2, n // PANEL, PANEL).transpose(1, 0, 2)


def matmul(x, w, *, transposed: bool = False):
    """x: [..., K] and w: [K, N], [N, K] when ``transposed`` (a tied embedding as the head),
    or packed by :func:`pack` → float32 [..., N]. x is cast to w's dtype first."""
    if is_packed(w):
        return matmuls(x, [w])[0]
    rows = x.astype(w.dtype).reshape(-1, x.shape[-1])
    contract = 1 if transposed else 0
    out = jax.lax.dot_general(rows, w, (((1,), (contract,)), ((), ())), precision=for_operands(w.dtype),
                              preferred_element_type=jnp.float32)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def rms_norm(x, scale, eps: float):
    """RMSNorm over the last axis, computed in float32: ``scale * (x / sqrt(mean(x²) + eps))``.
    x: [..., d]; scale: [d] → [..., d] in x's dtype times scale's."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale * xf.astype(x.dtype)


def matmuls(x, ws, *, rms_scale=None, eps: float = 0.0, residual=None) -> list:
    """``[matmul(h, w) for w in ws]`` with ``h = rms_norm(x, rms_scale, eps)`` if rms_scale is
    given, else x, and ``residual`` (float32 [..., N], one weight only) added to the product:
    x: [..., K], each w [K, N_j] or packed → float32 [..., N_j] each.

    When every w is packed alike, one native call does it all, which shares the work among
    the cores better than a call for each (a layer's K and V have three panels each), and
    takes the norm, the rounding of x to the weights' dtype and the residual add into the
    call: at one row, each of those was its own XLA kernel, about a tenth of a bfloat16 decode
    step together. The call's norm sums in another order than XLA's, so h can differ in the
    last bit; its residual add is XLA's, bitwise."""
    if residual is not None and len(ws) != 1:
        raise ValueError(f"a residual is added to one product, not {len(ws)}")
    if not ws or not all(is_packed(w) and w.dtype == ws[0].dtype for w in ws) or not _normalizes(x, rms_scale):
        h = x if rms_scale is None else rms_norm(x, rms_scale, eps)
        ys = [matmul(h, w) for w in ws]
        return ys if residual is None else [residual + ys[0]]
    rows = _native_input(x, ws[0])
    extra = {} if residual is None else {"residual": residual.astype(jnp.float32).reshape(rows.shape[0], -1)}
    outs = native.matmul(rows, *ws, rms_scale=rms_scale, eps=eps, **extra)
    return [out.reshape(*x.shape[:-1], out.shape[-1]) for out in outs]


def gated_matmul(x, gate, up, *, rms_scale=None, eps: float = 0.0):
    """SwiGLU's ``silu(h @ gate) * (h @ up)``, h as in :func:`matmuls`: x: [..., K], gate and
    up [K, N] or packed → float32 [..., N]. Packed alike, one native call does both products
    and the gating, so the two [.., N] products never reach memory (XLA's gating fusion alone
    took 2.4 ms a layer on a 1760-token prefill here)."""
    if not _normalizes(x, rms_scale):
        return gated_matmul(rms_norm(x, rms_scale, eps), gate, up)
    if not (is_packed(gate) and is_packed(up) and gate.dtype == up.dtype and gate.shape == up.shape):
        g, u = matmuls(x, [gate, up], rms_scale=rms_scale, eps=eps)
        return jax.nn.silu(g) * u
    out = native.gated_matmul(_native_input(x, gate), gate, up, rms_scale=rms_scale, eps=eps)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _normalizes(x, rms_scale) -> bool:
    """Whether the native call computes :func:`rms_norm` of x: for float32 x (for other x,
    rms_norm rounds the normalized rows to x's dtype before scaling them, which it does not)."""
    return rms_scale is None or x.dtype == jnp.float32


def _native_input(x, packed):
    """x: [..., K] as the native product takes it with ``packed``: [M, K], float32 (which it
    rounds to bfloat16 itself) or in the weights' dtype."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if x.dtype == jnp.float32 else rows.astype(_input_dtype(packed))


def screenable(embed) -> bool:
    """Whether a tied embedding [N, K] can be its head's screen (:func:`argmax_screen`): float32,
    K even, and its transpose :func:`packable`."""
    return embed.ndim == 2 and embed.dtype == jnp.float32 and embed.shape[1] % 2 == 0 and packable(embed.T)


@jax.jit
def argmax_screen(embed) -> dict:
    """What :func:`argmax_head` needs of a tied float32 embedding besides the packed head.
    embed: float32 [N, K] → {"screen": uint32 [N/64, K/2, 64], the head packed in bfloat16
    (half the float32 head's bytes), "norms": float32 [N], each embedding row's Euclidean norm}."""
    return {"screen": pack(embed.T.astype(jnp.bfloat16)), "norms": jnp.linalg.norm(embed, axis=1)}


def argmax_head(x, head: dict, embed, argmax_rows):
    """Logits of a float32 head tied to ``embed``: x: [L, K]; head: {"w": packed float32 [N/64,
    K, 64], and :func:`argmax_screen`'s "screen" and "norms"}; embed: float32 [N, K]; argmax_rows:
    int32 [], at run time → float32 [L, N].

    With argmax_rows 0, ``x @ head``, bitwise :func:`matmul`'s. Otherwise each row below
    argmax_rows holds its exact logits (bitwise the same) only where a proven bound on a
    bfloat16 product's error says they may be the row's largest, and that product's logits,
    all below the largest, elsewhere, so its arg-max (ties to the first) is the full
    product's; rows from argmax_rows on are padding, zeros. SmolLM2's head took 5.7 ms
    this way against 9.4 ms for 32 rows, and 2.1 against 4.4 ms for one."""
    rows = x.astype(jnp.float32).reshape(-1, x.shape[-1])
    out = native.argmax_head(rows, head["w"], head["screen"], embed, head["norms"], argmax_rows)
    return out.reshape(*x.shape[:-1], out.shape[-1])
