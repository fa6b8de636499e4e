"""How the KV pool is sized: num_blocks, kv_cache_memory, or on a GPU or TPU vLLM's
gpu_memory_utilization of the device less the weights and peak activations; a CPU default."""

from __future__ import annotations

import logging

import pytest

from engine.config import EngineConfig
from engine.entrypoints.server import build_parser, engine_config
from engine.worker import kv_cache_size, sampling_rows
from engine.worker.kv_cache_size import DeviceMemory, by_utilization, choose
from tests.engine.tiny import tiny_llm

GIB = 2**30
H100 = DeviceMemory(total=80 * GIB, limit=60 * GIB, in_use=3 * GIB)  # JAX's default limit: 0.75 of the card


def never() -> int:
    raise AssertionError("activations are measured only when the pool is sized by utilization")


def test_explicit_sizes_win_and_a_cpu_gets_the_default():
    common = dict(utilization=0.9, bytes_per_block=GIB // 4, activation_bytes=never)
    assert choose(num_blocks=7, kv_cache_memory=GIB, devices=[H100], **common).num_blocks == 7
    assert choose(num_blocks=None, kv_cache_memory=GIB, devices=[H100], **common).num_blocks == 4
    cpu = choose(num_blocks=None, kv_cache_memory=None, devices=[None], **common)
    assert cpu.num_blocks == 4 and "default of 1.00 GiB" in cpu.reason


def test_utilization_within_jax_limit_less_weights_and_activations():
    size = by_utilization(0.5, [H100], activation_bytes=GIB, bytes_per_block=GIB // 2)
    assert size.num_blocks == 2 * (40 - 3 - 1)
    assert "0.5 of 80.00 GiB" in size.reason and "capped" not in size.reason


def test_utilization_above_jax_limit_is_capped_and_says_how_to_lift_it():
    size = by_utilization(0.9, [H100], activation_bytes=GIB, bytes_per_block=GIB)
    assert size.num_blocks == 60 - 3 - 1  # never more than JAX's allocator can hand out
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in size.reason


def test_tensor_parallel_devices_each_hold_a_share_of_every_block():
    busier = DeviceMemory(total=80 * GIB, limit=60 * GIB, in_use=5 * GIB)
    size = by_utilization(0.5, [H100, busier], activation_bytes=GIB, bytes_per_block=GIB)
    assert size.num_blocks == 2 * (40 - 5 - 1)  # the fullest device decides


def test_no_room_left_is_a_clear_error():
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.05 leaves no room.*raise gpu_memory_utilization"):
        by_utilization(0.05, [H100], activation_bytes=GIB, bytes_per_block=GIB)


@pytest.mark.parametrize("value", [0, 1.5, "0.9"])
def test_a_utilization_outside_0_to_1_is_refused(value):
    expected = r"gpu_memory_utilization must be a fraction of the device's memory in \(0, 1\]"
    with pytest.raises(ValueError, match=expected):
        EngineConfig(gpu_memory_utilization=value)


def test_the_server_takes_vllms_flag():
    args = build_parser().parse_args(["--gpu-memory-utilization", "0.5"])
    assert engine_config(args).gpu_memory_utilization == 0.5


def test_gpu_fraction_of_jax_sets_the_device_total(monkeypatch):
    class FakeGpu:
        platform = "gpu"

        @staticmethod
        def memory_stats():
            return {"bytes_limit": 40 * GIB, "bytes_in_use": GIB, "peak_bytes_in_use": 2 * GIB}

    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".5")
    assert DeviceMemory.of(FakeGpu()) == DeviceMemory(total=80 * GIB, limit=40 * GIB, in_use=GIB)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    assert DeviceMemory.of(FakeGpu()).total == int(40 * GIB / 0.75)


def test_engine_on_a_device_with_a_memory_limit_sizes_its_pool_by_utilization(tmp_path, monkeypatch, caplog):
    """The engine's whole path on a (simulated) 64 MiB accelerator: the weights in use and the
    activations of its largest steps, compiled, come off the budget, and the ready line says so."""
    weights = 5 * 2**20
    device = DeviceMemory(total=64 * 2**20, limit=48 * 2**20, in_use=weights)
    monkeypatch.setattr(kv_cache_size.DeviceMemory, "of", classmethod(lambda cls, d: device))
    with caplog.at_level(logging.INFO, logger="engine.llm_engine"):
        llm, _ = tiny_llm("llama_gqa_tied", tmp_path, num_blocks=None, gpu_memory_utilization=0.5,
                          max_num_batched_tokens=512)
    engine, runner = llm.engine, llm.engine.runner
    model = runner.activation_bytes(engine.cache.kv_caches)
    assert model > 512 * engine.model_config.hidden_size * 4  # at least the largest step's hidden states
    sampler = sampling_rows.activation_bytes(engine.model_config.vocab_size, max(runner.logits_sizes()))
    assert sampler > max(runner.logits_sizes()) * engine.model_config.vocab_size * 4  # at least its logits
    free = 32 * 2**20 - weights - model - sampler
    assert engine.cache.spec.num_blocks == free // engine.cache.spec.bytes_per_block
    assert "sized by gpu_memory_utilization" in caplog.text and "0.5 of 0.06 GiB" in caplog.text
    (output,) = llm.generate([[5, 6, 7]], use_tqdm=False)
    assert output.outputs[0].token_ids
