"""``make bench-gpu``'s scripts, checked here without a GPU: their ``--quick`` runs print the
tables with the GPU-only columns marked n/a and write only the *_quick files, a full-size run
refuses to start, and the adapters the GPU columns rely on are right where they can run."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest

import pallas_paged
from benchmarks import gpu_kernels, gpu_throughput, timing
from benchmarks.gpu_report import NO_GPU
from pallas_paged import reference
from tests.hf_torch import require_torch
from tests.pallas_paged.test_lowering import TRITON, export

off_gpu = pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks what the scripts do off a GPU")


@pytest.fixture
def results(tmp_path, monkeypatch):
    """benchmarks/results/ redirected to a temporary folder."""
    monkeypatch.setattr(timing, "RESULTS", tmp_path)
    return tmp_path


def table_rows(text: str, first_cell: str) -> list[list[str]]:
    """The cells of the Markdown table rows in ``text`` that start with ``first_cell``."""
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]
    return [row for row in rows if row[0] == first_cell]


def positive(cell: str) -> bool:
    """Whether a table cell is a number (thousands separated by commas) above 0."""
    return float(cell.replace(",", "")) > 0


@off_gpu
@pytest.mark.slow
def test_kernels_quick_marks_gpu_columns_and_writes_only_the_quick_file(results):
    text = gpu_kernels.main(["--quick"])
    assert [path.name for path in results.iterdir()] == ["gpu_kernels_quick.md"]
    assert (results / "gpu_kernels_quick.md").read_text() == text + "\n"
    assert "Command: `PYTHONPATH=. python -m benchmarks.gpu_kernels --quick`" in text
    assert f"jax {jax.__version__}" in text and "MISMATCH" not in text
    decode, prefill = text.split("Prefill (whole prompts")
    decode_rows = table_rows(decode, "32/8 x 128") + table_rows(decode, "9/3 x 64")
    prefill_rows = table_rows(prefill, "32/8 x 128")
    assert len(decode_rows) == len(gpu_kernels.QUICK_DECODE) and len(prefill_rows) == len(gpu_kernels.QUICK_PREFILL)
    for row in decode_rows:  # ours, dense: timed; ours before issue 41, JAX's paged op (Triton), Mosaic GPU: n/a
        assert positive(row[3]) and row[5] == NO_GPU and positive(row[7]) and row[9] == NO_GPU and row[11] == NO_GPU
    for row in prefill_rows:  # ours, XLA: timed; ours before issue 41, cuDNN, Mosaic GPU, cuDNN prompts: n/a
        assert positive(row[3]) and row[4] == row[5] == NO_GPU and positive(row[6]) and row[7] == row[8] == NO_GPU


@off_gpu
@pytest.mark.slow
def test_throughput_quick_runs_both_systems_and_writes_only_the_quick_file(results):
    text = gpu_throughput.main(["--quick", "--models", "smollm2", "--num-prompts", "4", "--new-tokens", "3",
                                "--num-scheduler-steps", "1,2"])
    assert [path.name for path in results.iterdir()] == ["gpu_throughput_quick.md"]
    rows = table_rows(text, "smollm2")
    assert [(row[1], row[2], row[3]) for row in rows] == [("4", "1", "3"), ("4", "2", "3")]
    for (_, _, _, _, startup, seconds, ours, hf, versus) in rows:
        assert positive(startup) and positive(seconds) and positive(ours)
        try:
            import torch  # noqa: F401
        except ImportError:
            assert (hf, versus) == (gpu_throughput.NO_TORCH, "n/a")
        else:
            assert positive(hf) and positive(versus)


@off_gpu
@pytest.mark.parametrize("script", [gpu_kernels, gpu_throughput])
def test_a_full_size_run_refuses_to_start_off_a_gpu(script, results):
    with pytest.raises(SystemExit, match="GPU numbers only"):
        script.main([])
    assert list(results.iterdir()) == []


def test_jax_paged_op_reads_our_cache_layout_given_a_prescaled_query():
    """JAX's GPU paged op, run in interpret mode, on the benchmark's shuffled paged copy of a
    contiguous cache: it agrees with the oracle once q carries the scale, as does the dense
    baseline on the contiguous cache. Importing it raises no deprecation warning."""
    case = gpu_kernels.Case(q_heads=8, kv_heads=2, head_dim=64, seqs=2, context=256)
    q, k, v = gpu_kernels.random_inputs(case, jax.random.key(1), case.seqs)
    paged = (q, *gpu_kernels.paged_inputs(case, k, v, np.random.default_rng(1)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        op = gpu_kernels.jax_paged_attention()
    expected = np.asarray(reference.paged_attention(*paged), np.float32)
    got = op((q * case.head_dim**-0.5).astype(q.dtype), *paged[1:], interpret=True)
    np.testing.assert_allclose(np.asarray(got, np.float32), expected, atol=gpu_kernels.TOLERANCE)
    dense = gpu_kernels.dense_decode(q, k, v, paged[-1])
    np.testing.assert_allclose(np.asarray(dense, np.float32), expected, atol=gpu_kernels.TOLERANCE)


def test_random_checkpoint_loads_into_hf_without_missing_or_unexpected_weights(tmp_path):
    torch = require_torch("loading the checkpoint into Hugging Face's model")
    config = gpu_throughput.model_config("llama-3.2-1b", quick=True)
    gpu_throughput.write_checkpoint(config, tmp_path)
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.config.rope_parameters["rope_type"] == "llama3" and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("case", gpu_kernels.DECODE,
                         ids=lambda c: f"{c.q_heads}-{c.kv_heads}x{c.head_dim}-{c.seqs}x{c.context}")
def test_jax_paged_op_and_ours_lower_to_triton_at_every_benchmark_shape(case):
    """Exported for CUDA (an abstract H100): JAX's op accepts the shapes (its blocks per sequence
    must split into 16 parts) and both lower to Triton kernels, without deprecation warnings."""
    blocks = case.context // gpu_kernels.BLOCK_SIZE
    cache = jax.ShapeDtypeStruct((case.kv_heads, case.seqs * blocks, gpu_kernels.BLOCK_SIZE, case.head_dim),
                                 gpu_kernels.DTYPE)
    args = [jax.ShapeDtypeStruct((case.seqs, case.q_heads, case.head_dim), gpu_kernels.DTYPE), cache, cache,
            jax.ShapeDtypeStruct((case.seqs, blocks), np.int32), jax.ShapeDtypeStruct((case.seqs,), np.int32)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for fn in (gpu_kernels.jax_paged_attention(), pallas_paged.paged_attention):
            assert TRITON in export(fn, args, "cuda")
