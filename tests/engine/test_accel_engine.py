"""The engine's own programs compiled ahead of time for an H100, without one (``make test-accel``).

``tests/pallas_paged/test_accel.py`` compiles the kernels alone; this compiles every program a
GPU engine would compile at its warm-up (each decode bucket as one program, the stages of the
steps with prompts, the multi-step loops) and its heaviest sampler, for a model of
Llama-3.2-1B's widths and vocabulary in bfloat16 (two of its 16 layers: the layers' programs
are the same), through the runner's own calls and compile path; with the default kernels and
with the Hopper ones turned on; and the same engine split over two H100s (tensor parallelism),
its collectives counted. A GPU session then spends its minutes on timing and numbers, not on a
program that XLA's GPU compiler refuses, a kernel the engine never reaches, or a table gathered
at every step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

import models
from engine.worker import model_runner, sampler, sampling_rows, stages, tensor_parallel
from models import llama
from models.config import from_hf
from tests.models.tiny_models import llama_shapes
from tests.pallas_paged.test_accel import cudnn_prompts_for_h100, gpu_devices

pytestmark = pytest.mark.accel

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=2,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
                rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8192))
ENGINE = dict(block_size=16, max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=2048)
LOOP_STEPS = 8


@pytest.fixture
def on_h100(monkeypatch):
    """A sharding on a compile-only H100; the runner and the stages see a GPU backend, and
    their compiled programs are kept apart from any CPU ones. JAX's traces are dropped before
    and after: the kernels' choice is read from the environment when a stage is traced."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(stages, "_compiled", {})
    jax.clear_caches()
    yield jax.sharding.SingleDeviceSharding(gpu_devices()[0])
    jax.clear_caches()


def _placed(tree, sharding, dtype=None):
    """Every array (or shape) of ``tree`` as a ``jax.ShapeDtypeStruct`` on ``sharding`` (in ``dtype``, if given)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype or a.dtype, sharding=sharding), tree)


def _runner(sharding, mesh=None) -> tuple[model_runner.ModelRunner, list]:
    """A runner of the Llama-3.2-1B-shaped model (abstract bfloat16 weights) and its KV caches
    (4096 blocks a layer, abstract): on ``sharding``, or split over ``mesh`` as tensor
    parallelism splits them."""
    hf = transformers.LlamaConfig(**LLAMA_1B, architectures=["LlamaForCausalLM"])
    config, shapes = from_hf(hf.to_dict()), llama_shapes(hf)
    params = llama.params_from_hf(config, lambda name: np.broadcast_to(np.float32(0), shapes[name]),
                                  lambda tree: _placed(tree, sharding, jnp.bfloat16))
    params["rope"] = _placed(params["rope"], sharding)  # float32, as the loader keeps them
    cache = (config.num_kv_heads, 4096, ENGINE["block_size"], config.head_dim)
    if mesh is None:
        cache = jax.ShapeDtypeStruct(cache, jnp.bfloat16, sharding=sharding)
    else:
        params = jax.tree.map(lambda a, where: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where), params,
                              models.named_shardings(mesh, models.param_specs(params)))
        cache = jax.ShapeDtypeStruct(cache, jnp.bfloat16, sharding=tensor_parallel.cache_sharding(mesh))
    return model_runner.ModelRunner(config, params, **ENGINE, mesh=mesh), [(cache, cache)] * config.num_layers


# The attention kernels' names in a compiled program, by the kernels a GPU runs.
KERNELS = {"triton": {"decode": "paged_decode_attention\"", "layer": "ragged_paged_attention\""},
           "hopper": {"decode": "paged_decode_attention_sm90", "layer": "ragged_paged_attention_sm90"}}


def _use(kernels: str, monkeypatch) -> None:
    """Run ``kernels``: the default ones (Triton), or the Hopper ones turned on (Mosaic GPU for
    paged attention, cuDNN for steps of whole prompts)."""
    if kernels == "hopper":
        monkeypatch.setenv("PALLAS_PAGED_GPU_ATTENTION", "mosaic")
        cudnn_prompts_for_h100(monkeypatch)


def _check_kernels(kernels: str) -> None:
    """Each compiled program that attends holds ``kernels``' (cuDNN in a step with prompts
    exactly when the Hopper ones are on), and none a CPU kernel's custom call."""
    for key, program in stages._compiled.items():
        text = program.as_text()
        assert "pallas_paged_" not in text, f"{key[0]}: a CPU kernel's custom call"
        if key[0] in ("decode", "decode_steps"):
            assert KERNELS[kernels]["decode"] in text, f"{key[0]} runs no {KERNELS[kernels]['decode']}"
        if key[0] == "layer":  # a step with prompts, or under tensor parallelism any step
            assert any(name in text for name in KERNELS[kernels].values()), "a layer without the paged kernels"
            if "ragged_paged_attention" in text:
                assert ("__cudnn$fmha" in text) == (kernels == "hopper"), "cuDNN for steps of whole prompts"


@pytest.mark.parametrize("kernels", ["triton", "hopper"])
def test_every_program_of_a_gpu_engine_compiles_for_h100(on_h100, monkeypatch, kernels):
    """With the default kernels and with the Hopper ones: the engine's float32 queries over
    its bfloat16 cache reach them, in every program that attends."""
    _use(kernels, monkeypatch)
    runner, kv_caches = _runner(on_h100)
    assert runner.one_program_buckets == runner.decode_buckets, "on a GPU every decode step is one program"
    calls = [call for shape in runner._step_shapes() for call in runner._calls(shape, kv_caches)]
    calls += [runner._loop_call(rows, kv_caches, LOOP_STEPS) for rows in runner.decode_buckets]
    calls = [(stage, config, mesh, _placed(args, on_h100)) for stage, config, mesh, args in calls]
    compiled = stages.compile_all(calls)
    assert compiled == len({stages._key(*call) for call in calls}) > 30
    stages_compiled = {key[0] for key in stages._compiled}
    assert stages_compiled == {"decode", "decode_steps", "embed", "layer", "head", "pick"}
    _check_kernels(kernels)


def test_the_heaviest_sampler_compiles_for_h100(on_h100):
    """The sampler with everything on (temperature, top-k, top-p, penalties, ranks, 20
    log-probabilities) over 256 rows of a 128256-token vocabulary, alone and inside a
    multi-step loop (which compiles on first use of such sampling)."""
    rows, vocab = ENGINE["max_num_seqs"], LLAMA_1B["vocab_size"]
    batch = sampling_rows.batch_for([], 0, vocab, size=rows, steps=LOOP_STEPS).replace(
        all_greedy=False, top_p_or_min_p=True, max_top_k=64, penalties=True, logprobs=True, ranks=True,
        num_top_logprobs=20)
    logits = jax.ShapeDtypeStruct((rows, vocab), jnp.float32, sharding=on_h100)
    program = sampler.sample.lower(logits, _placed(batch, on_h100)).compile()
    assert stages.footprint(program) < 2**30
    runner, kv_caches = _runner(on_h100)
    stage, config, mesh, args = runner._loop_call(rows, kv_caches, LOOP_STEPS)
    params, input_ids, positions, metadata, kv_caches, _, per_row, tokens = _placed(args, on_h100)
    loop = (params, input_ids, positions, metadata, kv_caches, _placed(batch, on_h100), per_row, tokens)
    assert stages.compile_all([(stage, config, mesh, loop)]) == 1


@pytest.mark.parametrize("kernels", ["triton", "hopper"])
def test_a_tensor_parallel_engine_compiles_for_two_h100s(on_h100, monkeypatch, kernels):
    """Every program of an engine split over two GPUs (``tensor_parallel_size=2``), which no
    GPU session here has had, its multi-step loops included: each layer all-reduces its two
    partial sums and gathers nothing, each device runs the kernels on its own 4 of the 8 KV
    heads, and the embedding lookup sums each device's own rows (XLA's partitioner had the
    whole table gathered, on GPUs, though not on CPUs: ``models.layers.embedding``)."""
    _use(kernels, monkeypatch)
    devices = gpu_devices("1x1x2")
    mesh = jax.sharding.Mesh(np.array(devices), (models.sharding.AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    runner, kv_caches = _runner(whole, mesh)
    monkeypatch.setattr(runner, "_inputs", None)  # step inputs made on the host, then placed on the mesh

    def on_mesh(tree):  # the step's inputs replicated; weights and caches as they are split
        return jax.tree.map(lambda a: a if getattr(a.sharding, "mesh", None) == mesh
                            else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole), tree)

    calls = [call for shape in runner._step_shapes() for call in runner._calls(shape, kv_caches)]
    calls += [runner._loop_call(rows, kv_caches, LOOP_STEPS) for rows in runner.decode_buckets[-2:]]
    calls = [(stage, config, mesh, on_mesh(args)) for stage, config, mesh, args in calls]
    assert stages.compile_all(calls) == len({stages._key(*call) for call in calls}) > 30
    _check_kernels(kernels)
    per_device_cache = f"bf16[4,4096,{ENGINE['block_size']},64]"
    for key, program in stages._compiled.items():
        text = program.as_text()
        if key[0] in ("embed", "layer"):  # (the head gathers the logits, split over the vocabulary)
            assert "all-gather" not in text, f"{key[0]} gathers what tensor parallelism keeps split"
            assert text.count("all-reduce-start(") == {"embed": 1, "layer": 2}[key[0]], key[0]
        if key[0] == "layer":
            assert per_device_cache in text
