"""The models' matrix product: bfloat16 and float32 weights packed for the native CPU kernel
against float32 math on the same inputs, the packed layouts, and when weights get packed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_paged
from pallas_paged import native

pytestmark = pytest.mark.skipif(not native.matmul_available(), reason="this CPU has no AVX512-BF16")

SHAPES = [  # (M, K, N): the kernel's code paths
    pytest.param(1, 576, 1536, id="one-row"),
    pytest.param(2, 576, 192, id="narrow-splits-rows"),
    pytest.param(13, 40, 64, id="partial-tile-one-panel"),
    pytest.param(32, 576, 576, id="rows-of-the-odd-panel-split"),
    pytest.param(70, 1536, 576, id="many-rows"),
    pytest.param(200, 1536, 128, id="blocks-of-rows"),
    pytest.param(301, 576, 192, id="blocks-of-rows-partial-tile"),
    pytest.param(3, 2, 128, id="one-pair"),
]


def _bf16(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_packed_product_matches_float32_math(m, k, n, dtype):
    """Products of bfloat16 are exact in float32, so only the order of the float32 sums differs."""
    rng = np.random.default_rng(m * 1000 + n)
    x, w = _bf16(rng, (m, k)).astype(dtype), _bf16(rng, (k, n)).astype(dtype)
    got = jax.jit(pallas_paged.matmul)(x, pallas_paged.pack(w))
    want = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
    assert got.dtype == jnp.float32 and got.shape == (m, n)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_float32_packs_any_depth():
    """float32 panels hold whole rows, so K may be odd (bfloat16 pairs rows and needs it even)."""
    rng = np.random.default_rng(7)
    x, w = rng.standard_normal((5, 7)).astype(np.float32), rng.standard_normal((7, 128)).astype(np.float32)
    got = jax.jit(pallas_paged.matmul)(x, pallas_paged.pack(w))
    np.testing.assert_allclose(got, jnp.dot(x, w, precision="highest"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 32, 250])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_several_weights_in_one_call_match_a_call_each(m, dtype):
    """A layer's Q, K, V (576, 192, 192 columns) in one native call; an unpacked weight among
    them sends every product to its own call."""
    rng = np.random.default_rng(m)
    x = _bf16(rng, (m, 576))
    ws = [_bf16(rng, (576, n)).astype(dtype) for n in (576, 192, 192)]
    together = jax.jit(pallas_paged.matmuls)(x, [pallas_paged.pack(w) for w in ws])
    for got, w in zip(together, ws, strict=True):
        np.testing.assert_array_equal(got, pallas_paged.matmul(x, pallas_paged.pack(w)))
    mixed = pallas_paged.matmuls(x, [pallas_paged.pack(ws[0]), ws[1]])
    np.testing.assert_array_equal(mixed[0], together[0])
    np.testing.assert_allclose(mixed[1], x.astype(jnp.float32) @ ws[1].astype(jnp.float32), rtol=1e-5, atol=1e-3)


def test_packed_layout_pairs_rows_within_panels_of_64_columns():
    """Word [p, s, j] holds w[2s, 64p + j] in its low half and w[2s + 1, 64p + j] in its high half."""
    w = np.arange(4 * 128, dtype=np.float32).reshape(4, 128).astype(jnp.bfloat16)
    packed = np.asarray(pallas_paged.pack(w))
    assert packed.shape == (2, 2, 64) and packed.dtype == np.uint32
    bits = w.view(np.uint16).astype(np.uint32)
    assert packed[1, 1, 3] == bits[2, 67] | bits[3, 67] << 16
    assert packed[0, 0, 63] == bits[0, 63] | bits[1, 63] << 16
    wide = np.arange(3 * 128, dtype=np.float32).reshape(3, 128)  # float32: panels of whole rows
    np.testing.assert_array_equal(pallas_paged.pack(wide), wide.reshape(3, 2, 64).transpose(1, 0, 2))


def test_what_packs(monkeypatch):
    rng = np.random.default_rng(0)
    assert pallas_paged.packable(_bf16(rng, (8, 64)))
    assert pallas_paged.packable(np.ones((7, 64), np.float32))  # float32 needs no pairs of rows
    assert not pallas_paged.packable(np.ones((8, 64), np.float16))
    assert not pallas_paged.packable(_bf16(rng, (7, 64)))  # odd K
    assert not pallas_paged.packable(_bf16(rng, (8, 96)))  # N not a multiple of 64
    with jax.set_mesh(jax.make_mesh((1,), ("tp",))):  # XLA partitions products under a mesh
        assert not pallas_paged.packable(_bf16(rng, (8, 64)))
    monkeypatch.setenv("PALLAS_PAGED_CPU_MATMUL", "xla")
    assert not pallas_paged.packable(_bf16(rng, (8, 64)))


@pytest.mark.parametrize("packed", [False, True], ids=["xla", "native"])
def test_matmul_keeps_leading_axes_and_casts_to_the_weights_dtype(packed):
    """x [2, 3, K] float32 → float32 [2, 3, N], whichever product runs."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    w = _bf16(rng, (64, 128))
    got = pallas_paged.matmul(x, pallas_paged.pack(w) if packed else w)
    want = jnp.einsum("abk,kn->abn", x.astype(jnp.bfloat16).astype(jnp.float32), w.astype(jnp.float32),
                      precision="highest")
    assert got.shape == (2, 3, 128) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    lowered = jax.jit(pallas_paged.matmul).lower(x, pallas_paged.pack(w) if packed else w).as_text()
    assert (native.MATMUL_TARGET in lowered) == packed


@pytest.mark.parametrize("m, k, n", [(1, 576, 1536), (13, 40, 64), (32, 576, 576), (301, 576, 192), (250, 1536, 128)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gated_product_matches_silu_of_gate_times_up(m, k, n, dtype):
    """SwiGLU's gating in the native call, against XLA's silu of the same call's products (which
    test_packed_product_matches_float32_math checks): its exp is a polynomial, not XLA's, so
    they agree to about float32 rounding, over gates well into both tails of silu."""
    rng = np.random.default_rng(m + n)
    x = _bf16(rng, (m, k)).astype(dtype)
    gate, up = (pallas_paged.pack(_bf16(rng, (k, n)).astype(dtype)) for _ in range(2))
    got = jax.jit(pallas_paged.gated_matmul)(x, gate, up)
    g, u = pallas_paged.matmuls(x, [gate, up])
    assert float(jnp.min(g)) < -4 and float(jnp.max(g)) > 4
    np.testing.assert_allclose(got, jax.nn.silu(g) * u, rtol=1e-6, atol=1e-30)


def test_gated_product_over_the_tails_of_silu():
    """Gates far past where exp overflows or underflows in float32 (silu is x there, or 0)."""
    x = jnp.asarray(np.linspace(-300, 300, 61, dtype=np.float32)[:, None])
    gate, up = jnp.ones((1, 64), jnp.float32), jnp.full((1, 64), 2.0, jnp.float32)
    got = pallas_paged.gated_matmul(x, pallas_paged.pack(gate), pallas_paged.pack(up))
    want = jax.nn.silu(x) * (2 * x)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, jnp.broadcast_to(want, got.shape), rtol=1e-6, atol=1e-30)


def _residual_stream(rng, shape):
    """float32 rows at the scale of a model's residual stream, with a few large features."""
    x = rng.standard_normal(shape).astype(np.float32)
    x[:, :3] *= 40
    return x


@pytest.mark.parametrize("m", [1, 32, 301])  # 301: the workers share the prologue's chunks of rows
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("scale_dtype", [jnp.bfloat16, jnp.float32])
def test_norm_and_residual_in_the_call_match_xla(m, dtype, scale_dtype):
    """RMSNorm of float32 rows, their rounding to bfloat16, and the residual add, done in the
    native call, against XLA doing each of them around the same call's product. The residual
    add is bitwise XLA's; the norm sums in another order, so the normalized rows may differ in
    their last bit, and a bfloat16 one by one bfloat16 step where float32 falls near a tie."""
    rng = np.random.default_rng(m)
    x, residual = _residual_stream(rng, (m, 576)), rng.standard_normal((m, 192)).astype(np.float32)
    w = pallas_paged.pack(_bf16(rng, (576, 192)).astype(dtype))
    scale = jnp.asarray(rng.uniform(0.5, 2.0, 576), scale_dtype)
    fused = jax.jit(lambda x, w, s, r: pallas_paged.matmuls(x, [w], rms_scale=s, eps=1e-5, residual=r)[0])
    got = fused(x, w, scale, residual)
    h = pallas_paged.rms_norm(jnp.asarray(x), scale, 1e-5)
    want = residual + pallas_paged.matmul(h, w)
    tolerance = 2**-8 if dtype == jnp.bfloat16 else 2**-20
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance * float(jnp.max(jnp.abs(want))))
    unfused = pallas_paged.matmul(h, w)
    np.testing.assert_array_equal(jax.jit(lambda h, w, r: pallas_paged.matmuls(h, [w], residual=r)[0])(h, w, residual),
                                  residual + unfused)


def test_float32_rows_round_to_bfloat16_in_the_call_as_xla_rounds_them():
    """float32 x with bfloat16 weights: the call rounds x to nearest even, bitwise XLA's convert,
    ties and NaN included (a NaN row stays NaN)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    x[0, :8] = np.float32(1 + 2**-8) * np.array([1, -1, 3, -3, 5, 7, 9, 11], np.float32)  # halfway cases
    x[1, 0] = np.nan
    w = pallas_paged.pack(_bf16(rng, (64, 128)))
    got = np.asarray(native.matmul(jnp.asarray(x), w)[0])
    want = np.asarray(native.matmul(jnp.asarray(x).astype(jnp.bfloat16), w)[0])
    np.testing.assert_array_equal(got, want)
    assert np.isnan(got[1]).all() and np.isfinite(got[[0, 2, 3]]).all()


@pytest.mark.parametrize("packed", [False, True], ids=["xla", "native"])
def test_gated_product_takes_the_norm_into_the_call(packed):
    """silu(h @ gate) * (h @ up) with h the RMSNorm of x, whichever product runs."""
    rng = np.random.default_rng(11)
    x, scale = _residual_stream(rng, (3, 576)), jnp.asarray(rng.uniform(0.5, 2.0, 576), jnp.float32)
    gate, up = (rng.standard_normal((576, 128)).astype(np.float32) for _ in range(2))
    if packed:
        gate, up = pallas_paged.pack(gate), pallas_paged.pack(up)
    got = pallas_paged.gated_matmul(x, gate, up, rms_scale=scale, eps=1e-6)
    want = pallas_paged.gated_matmul(pallas_paged.rms_norm(jnp.asarray(x), scale, 1e-6), gate, up)
    np.testing.assert_allclose(got, want, rtol=0, atol=2**-20 * float(jnp.max(jnp.abs(want))))


def test_a_norm_of_bfloat16_rows_is_xlas():
    """rms_norm rounds normalized bfloat16 rows to bfloat16 before scaling them, which the
    native call (made for float32 rows) does not: such rows are normalized by XLA, bitwise."""
    rng = np.random.default_rng(13)
    x, scale = _bf16(rng, (3, 64)), jnp.asarray(rng.uniform(0.5, 2.0, 64), jnp.float32)
    w, gate = pallas_paged.pack(_bf16(rng, (64, 128))), pallas_paged.pack(_bf16(rng, (64, 128)))
    h = pallas_paged.rms_norm(x, scale, 1e-6)
    np.testing.assert_array_equal(pallas_paged.matmuls(x, [w], rms_scale=scale, eps=1e-6)[0], pallas_paged.matmul(h, w))
    np.testing.assert_array_equal(pallas_paged.gated_matmul(x, gate, w, rms_scale=scale, eps=1e-6),
                                  pallas_paged.gated_matmul(h, gate, w))


def test_residual_goes_with_a_single_product():
    """A residual is added to one product: asking for it with several weights is refused, and
    a native call refuses one of the wrong shape, naming it."""
    rng = np.random.default_rng(5)
    x, w = _bf16(rng, (2, 64)), pallas_paged.pack(_bf16(rng, (64, 64)))
    with pytest.raises(ValueError, match="one product"):
        pallas_paged.matmuls(x, [w, w], residual=jnp.zeros((2, 64)))
    with pytest.raises(Exception, match="residual must be float32"):
        jax.block_until_ready(native.matmul(x, w, residual=jnp.zeros((2, 128), jnp.float32)))
    with pytest.raises(Exception, match="RMS norm needs float32 x"):
        jax.block_until_ready(native.matmul(x, w, rms_scale=jnp.ones(64, jnp.float32)))


def _tied_head(embed):
    """A tied float32 embedding [N, K] as the engine packs its head."""
    return {"w": pallas_paged.pack(embed.T), **pallas_paged.argmax_screen(embed)}


def _argmax_head(x, embed, argmax_rows) -> np.ndarray:
    return np.asarray(jax.jit(pallas_paged.argmax_head)(x, _tied_head(embed), embed, np.int32(argmax_rows)))


def _embedding_with_ties(rng, n: int = 4096, k: int = 576) -> np.ndarray:
    """Random rows, and near the front copies of row 7: exact (100) and a float32 rounding or
    so apart (200, 300), which a bfloat16 product cannot tell apart."""
    embed = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    embed[100] = embed[7]
    embed[200] = embed[7] * np.float32(1 + 2**-22)
    embed[300] = np.nextafter(embed[7], np.float32(1))
    return embed


@pytest.mark.parametrize("m, argmax_rows", [(1, 1), (5, 3), (32, 32), (40, 37)])
def test_argmax_head_keeps_the_full_products_largest_logits_bitwise(m, argmax_rows):
    """Rows below argmax_rows hold the full product's largest logit bitwise in exactly the
    columns that hold it there (so ties go to the same first one), the rest within the proven
    bound of the full product's; rows from argmax_rows on are zeros; with 0, the full product."""
    rng = np.random.default_rng(m)
    embed = _embedding_with_ties(rng)
    x = rng.standard_normal((m, 576)).astype(np.float32)
    x[::2] = embed[7] * 40 + rng.standard_normal((len(x[::2]), 576)).astype(np.float32) * 0.01  # row 7's copies lead
    full = np.asarray(pallas_paged.matmul(x, pallas_paged.pack(embed.T)))
    np.testing.assert_array_equal(_argmax_head(x, embed, 0), full)
    got = _argmax_head(x, embed, argmax_rows)
    bound = 0.0081 * np.linalg.norm(x, axis=1, keepdims=True) * np.linalg.norm(embed, axis=1)
    for row in range(argmax_rows):
        largest = full[row].max()
        np.testing.assert_array_equal(np.flatnonzero(got[row] == got[row].max()), np.flatnonzero(full[row] == largest))
        assert got[row].max() == largest
        assert np.all(np.abs(got[row] - full[row]) <= bound[row])
        assert np.count_nonzero(got[row] == full[row]) < 100, "the row should be screened, not computed in full"
    assert np.all(got[argmax_rows:] == 0)
    leaders = np.argmax(got[:argmax_rows:2], axis=1)
    assert set(leaders) <= {7, 200, 300} and len(leaders) > 0


def test_argmax_head_computes_rows_without_a_clear_leader_in_full():
    """A row of zeros (every logit ties at 0), a row whose largest logits 1000 columns come
    within a rounding of, and a row that is not finite: each computed in full (too many
    candidates to screen, or no bound), as the full product does; a plain row is screened."""
    rng = np.random.default_rng(3)
    embed = _embedding_with_ties(rng)
    embed[1000:2000] = embed[7]
    x = rng.standard_normal((4, 576)).astype(np.float32)
    x[0] = 0
    x[1] = embed[7] * 40
    x[2, 5] = np.inf
    full = np.asarray(pallas_paged.matmul(x, pallas_paged.pack(embed.T)))
    got = _argmax_head(x, embed, 4)
    np.testing.assert_array_equal(got[:3], full[:3])
    assert np.count_nonzero(full[1] >= full[1].max() - 1e-3) > 1000  # too many candidates, surely
    assert np.count_nonzero(got[3] == full[3]) < 100 and np.argmax(got[3]) == np.argmax(full[3])


def test_argmax_head_refuses_argmax_rows_past_its_rows():
    embed = _embedding_with_ties(np.random.default_rng(0), n=512)
    with pytest.raises(Exception, match="argmax_rows must be between 0 and the rows of x"):
        _argmax_head(np.ones((2, 576), np.float32), embed, 3)
