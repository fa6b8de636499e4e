"""Tensor parallelism over 2 and 4 host devices, each run in a fresh process (the device
count is fixed when JAX starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.engine.server import free_port
from tests.engine.tiny import ENGINE, prompts
from tests.models.tiny_models import write_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("devices", [2, 4])
def test_split_model_reproduces_the_single_device_engine(devices):
    result = subprocess.run([sys.executable, "-m", "tests.engine.tp_check", str(devices)], cwd=ROOT,
                            capture_output=True, text=True, env=os.environ.copy(), timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().splitlines()[-1].startswith("ok:")


@pytest.mark.slow
def test_two_processes_split_the_model_like_two_hosts(tmp_path):
    """Multi-host as docs/library.md describes it: every host runs the same script after
    ``jax.distributed.initialize``; here two processes on one machine stand in for two hosts."""
    write_checkpoint("llama_gqa_tied", tmp_path)
    port = str(free_port())
    hosts = [subprocess.Popen([sys.executable, "-m", "tests.engine.tp_multihost", str(rank), port, str(tmp_path)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    results = [host.communicate(timeout=600) for host in hosts]
    assert all(host.returncode == 0 for host in hosts), results[0][1][-3000:] + results[1][1][-3000:]
    outputs = [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in results]
    single = LLM(str(tmp_path), **ENGINE).generate(prompts(4, 256, seed=1), SamplingParams(temperature=0, max_tokens=8),
                                                   use_tqdm=False)
    assert outputs[0] == outputs[1] == [list(o.outputs[0].token_ids) for o in single]


def test_a_split_that_cuts_heads_is_refused(tmp_path):
    write_checkpoint("llama_gqa_tied", tmp_path)  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide the model's attention heads \(4\)"):
        LLM(str(tmp_path), **ENGINE, tensor_parallel_size=3)


def test_more_devices_than_visible_is_refused(tmp_path):
    write_checkpoint("llama_mha_bias", tmp_path)  # 4 heads, 4 KV heads
    with pytest.raises(ValueError, match="needs 4 devices but 1 are visible"):
        LLM(str(tmp_path), **ENGINE, tensor_parallel_size=4)
