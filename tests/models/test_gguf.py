"""The GGUF route on a tiny file: every quantisation type, and llama.cpp's Q/K row permutation undone."""

from __future__ import annotations

import itertools
import os
import shutil

import gguf
import jax
import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file
from tiny_models import write_checkpoint

import models
from engine import LLM
from models import gguf_cache
from tests.engine.tiny import ENGINE, assert_greedy_batch_matches
from tests.hf_torch import load_hf_model, require_torch

QUANT_TYPES = [gguf.GGMLQuantizationType[name] for name in ("F16", "Q8_0", "Q4_0", "Q4_1", "F32")]


def _llama_cpp_permute(weights, num_heads):
    """What llama.cpp's convert_hf_to_gguf.py does to Q and K rows: interleave each head's rotary halves."""
    shape = weights.shape
    return weights.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _write_gguf(checkpoint, path, quant_types=QUANT_TYPES):
    """Write the HF checkpoint in directory ``checkpoint`` as llama.cpp would (a llama or qwen2
    GGUF), cycling the 2-D tensors through ``quant_types``."""
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    arch = config.model_type
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    quant_types = itertools.cycle(quant_types)
    for name, data in load_file(checkpoint / "model.safetensors").items():
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            data = _llama_cpp_permute(data, heads)
        qtype = next(quant_types) if data.ndim == 2 else gguf.GGMLQuantizationType.F32
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), gguf.quants.quantize(data, qtype),
                          raw_dtype=qtype)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()


@pytest.fixture(autouse=True)
def converted_copies_in(tmp_path, monkeypatch):
    """Keep this module's converted GGUF copies out of the shared cache."""
    monkeypatch.setenv("PALLAS_PAGED_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("name", ["llama_gqa_tied", "llama_mqa_untied"])
def test_gguf_params_match_transformers_conversion(name, tmp_path):
    require_torch("transformers' GGUF conversion")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    hf_config = write_checkpoint(name, tmp_path / "hf")
    path = tmp_path / "tiny.gguf"
    _write_gguf(tmp_path / "hf", path)

    config, params, tokenizer = models.load_model(path)

    assert tokenizer is None and config.tie_word_embeddings == hf_config.tie_word_embeddings
    want = load_gguf_checkpoint(path, return_tensors=True, model_to_load=load_hf_model(tmp_path / "hf"))["tensors"]
    layer = params["layers"][1]
    for key, hf_name in [("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("gate", "mlp.gate_proj")]:
        np.testing.assert_array_equal(layer[key]["w"], want[f"model.layers.1.{hf_name}.weight"].numpy().T)
    np.testing.assert_array_equal(params["embed"], want["model.embed_tokens.weight"].numpy())
    if not config.tie_word_embeddings:
        np.testing.assert_array_equal(params["lm_head"]["w"], want["lm_head.weight"].numpy().T)
    q = load_file(tmp_path / "hf" / "model.safetensors")["model.layers.1.self_attn.q_proj.weight"].T
    assert np.abs(np.asarray(layer["q"]["w"]) - q).max() < 0.1 * np.abs(q).max()


def test_second_load_reads_the_converted_copy(tmp_path, converted_copies_in, monkeypatch):
    write_checkpoint("llama_gqa_tied", tmp_path / "hf")
    path = tmp_path / "tiny.gguf"
    _write_gguf(tmp_path / "hf", path)
    first = models.load_model(path)
    assert len(list((converted_copies_in / "models").iterdir())) == 1

    def no_conversion(*args, **kwargs):
        raise AssertionError("the GGUF was converted again")

    monkeypatch.setattr(models.loader, "_convert_gguf", no_conversion)
    second = models.load_model(path)
    assert second.config == first.config
    jax.tree.map(np.testing.assert_array_equal, second.params, first.params)


def test_the_same_file_elsewhere_reads_the_same_copy_and_old_copies_go(tmp_path, converted_copies_in, monkeypatch):
    """A GGUF installed again in another environment (another path, a new mtime) finds its
    converted copy; copies of other files of that name beyond the two most recently used are
    deleted when a new one is written, so reinstalls and upgrades do not fill the disk."""
    write_checkpoint("llama_gqa_tied", tmp_path / "hf")
    original = tmp_path / "one" / "tiny.gguf"
    original.parent.mkdir()
    _write_gguf(tmp_path / "hf", original)
    models.load_model(original)
    elsewhere = tmp_path / "two" / "tiny.gguf"
    elsewhere.parent.mkdir()
    shutil.copy(original, elsewhere)  # a new path and modification time
    copies = converted_copies_in / "models"
    assert gguf_cache.entry(elsewhere) == gguf_cache.entry(original) and len(list(copies.iterdir())) == 1

    stale = [copies / f"tiny-{i:016x}" for i in range(3)]  # older copies of other files named tiny.gguf
    for age, copy in enumerate(stale):
        copy.mkdir()
        os.utime(copy, (1000 + age, 1000 + age))
    other = copies / "tiny-other-0000000000000000"  # another file's name
    other.mkdir()
    os.utime(other, (1, 1))
    edited = tmp_path / "three" / "tiny.gguf"
    edited.parent.mkdir()
    edited.write_bytes(original.read_bytes() + b"\0" * 32)  # another file: converted afresh
    models.load_model(edited)
    assert sorted(path.name for path in copies.iterdir()) == sorted(
        [gguf_cache.entry(edited).name, gguf_cache.entry(original).name, other.name])



def test_default_gguf_tokenizer_is_the_one_transformers_builds():
    require_torch("transformers' GGUF tokenizer (its GGUF reader imports torch)")
    path = models.loader.default_gguf()
    ours = models.gguf_file.tokenizer(models.gguf_file.read(path)[1])
    want = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = ["Hello, world!", "  leading spaces and\ttabs\nnew lines", "naïve café – 東京 🙂", "x" * 300,
             "<|im_start|>user\nWhat is 2+2?<|im_end|>", "def f(a):\n    return a ** 2  # comment", ""]
    for text in texts:
        assert ours(text).input_ids == want(text).input_ids, text
        assert ours.decode(want(text).input_ids) == want.decode(want(text).input_ids)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == want.apply_chat_template(
        chat, add_generation_prompt=True)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids"):
        assert getattr(ours, name) == getattr(want, name), name
    assert len(ours) == len(want)


def test_default_gguf_loads_without_torch(tmp_path):
    """torch is only a test dependency: converting the default GGUF, tokenizer and chat template
    included, must not need it (transformers' own GGUF tokenizer route imports torch)."""
    import os
    import subprocess
    import sys

    script = ("import sys; sys.modules['torch'] = None\n"
              "from models import loader\n"
              "config, params, tokenizer = loader.load_model()\n"
              "chat = tokenizer.apply_chat_template([{'role': 'user', 'content': 'Hi'}], add_generation_prompt=True)\n"
              "assert 'torch' not in sys.modules or sys.modules['torch'] is None\n"
              "print(len(chat), config.num_layers)\n")
    env = {**os.environ, "PALLAS_PAGED_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "30"


def test_gguf_projection_biases_are_loaded(tmp_path):
    write_checkpoint("llama_mha_bias", tmp_path / "hf")
    path = tmp_path / "bias.gguf"
    _write_gguf(tmp_path / "hf", path)
    config, params, _ = models.load_model(path)
    _, want, _ = models.load_model(tmp_path / "hf")
    assert config.attention_bias and config.mlp_bias
    for key in ("q", "k", "v", "o", "gate", "up", "down"):  # 1-D tensors are stored as F32: exact
        np.testing.assert_array_equal(params["layers"][1][key]["b"], want["layers"][1][key]["b"])


def test_a_qwen2_gguf_generates_what_hugging_face_does(tmp_path):
    """llama.cpp's qwen2 files: Q, K and V biases, and Q/K rows in HF's order (not permuted)."""
    write_checkpoint("qwen2", tmp_path / "hf")
    hf = load_hf_model(tmp_path / "hf")
    path = tmp_path / "qwen2.gguf"
    _write_gguf(tmp_path / "hf", path, quant_types=[gguf.GGMLQuantizationType.F32])
    llm = LLM(str(path), **ENGINE)
    config = llm.engine.model_config
    assert config.attention_bias and not config.attention_out_bias
    assert_greedy_batch_matches(llm, hf, count=4)
