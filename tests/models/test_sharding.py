"""Tensor-parallel partitioning: one spec per parameter, and a sharded forward pass gives the same logits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import pytest
from jax.sharding import PartitionSpec as P
from tiny_models import write_checkpoint

import models


@pytest.mark.parametrize("name", ["llama_gqa_tied", "opt_project_in_out"])
def test_one_spec_per_array_with_matching_rank(name, tmp_path):
    write_checkpoint(name, tmp_path)
    config, params, _ = models.load_model(tmp_path)
    specs = models.param_specs(params)
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P)) == jax.tree.structure(params)
    for spec, x in zip(jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)), jax.tree.leaves(params)):
        assert len(spec) == x.ndim, (spec, x.shape)
    layer = specs["layers"][0]
    assert layer["q"]["w"] == layer["k"]["w"] == P(None, "tp") and layer["o"]["w"] == P("tp", None)
    assert specs["embed"] == P("tp", None)
    column, row = ("gate", "down") if config.architecture == "llama" else ("fc1", "fc2")
    assert layer[column]["w"] == P(None, "tp") and layer[row]["w"] == P("tp", None)


_SHARDED_FORWARD = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
sys.path.insert(0, {here!r})
import tempfile
import jax, numpy as np
import models
from paged_batch import PagedModel
from tiny_models import write_checkpoint
with tempfile.TemporaryDirectory() as directory:
    write_checkpoint("llama_gqa_tied", directory)
    config, params, _ = models.load_model(directory)
prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
want = PagedModel(config, params).prefill(prompts, all_logits=True)
mesh = jax.make_mesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
sharded = PagedModel(config, jax.device_put(params, models.named_shardings(mesh, models.param_specs(params))))
sharded.kv_caches = jax.device_put(sharded.kv_caches,
                                   models.named_shardings(mesh, models.kv_cache_specs(config.num_layers)))
got = sharded.prefill(prompts, all_logits=True)
assert sharded.params["layers"][0]["k"]["w"].addressable_shards[0].data.shape[1] == config.head_dim
np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
"""


def test_sharded_forward_matches_unsharded():
    """Two CPU devices (in a fresh process, as the device count is fixed at start-up)."""
    code = _SHARDED_FORWARD.format(here=str(Path(__file__).parent))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
