"""The engine on the GPU, tiny random models (no model hub): greedy output as Hugging Face's,
the same output under preemption by swapping and by recomputation, the KV pool sized from the
device's memory, and the server answering the ``openai`` client."""

from __future__ import annotations

import openai
import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from engine import LLM, SamplingParams
from pallas_paged import hopper
from pallas_paged import prompts as fresh_prompts
from tests.engine.server import running_server
from tests.engine.tiny import ENGINE, assert_greedy_batch_matches, prompts, tiny_llm
from tests.gpu.conftest import gpu_only, hopper_or_skip
from tests.hf_torch import load_hf_model, require_torch
from tests.models import tiny_models
from tests.models.tiny_models import write_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=24)


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.cache_stats()
    assert stats.device_blocks_free == stats.device_blocks_total, stats
    assert stats.host_blocks_free == stats.host_blocks_total, stats


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", ["llama_gqa_tied", "qwen2", "opt"])
def test_greedy_batch_matches_hugging_face(name, dtype, tmp_path):
    """HF in float32 on the CPU is the reference; bfloat16 and float16 weights must stay among its top-5
    where they part (see :func:`tests.engine.tiny.assert_same_or_close`)."""
    require_torch()
    llm, _ = tiny_llm(name, tmp_path, dtype=dtype)
    assert_greedy_batch_matches(llm, load_hf_model(tmp_path))


@pytest.mark.parametrize("dtype,cudnn", [("bfloat16", False), ("float16", False), ("bfloat16", True)],
                         ids=["bf16", "f16", "bf16-cudnn-prompts"])
def test_the_mosaic_gpu_kernels_match_hugging_face(dtype, cudnn, tmp_path, monkeypatch):
    """The engine with the Hopper kernels (PALLAS_PAGED_GPU_ATTENTION=mosaic) on a model whose
    heads they take (size 64; the tiny models' are 16): prompts through the ragged kernel,
    tokens through decode, as Hugging Face's greedy output (within its top-5, as above). With
    ``cudnn``, the first step's whole prompts go through cuDNN (PALLAS_PAGED_CUDNN_PROMPTS=1)."""
    hopper_or_skip()
    require_torch()
    monkeypatch.setenv("PALLAS_PAGED_GPU_ATTENTION", "mosaic")
    if cudnn:
        monkeypatch.setenv("PALLAS_PAGED_CUDNN_PROMPTS", "1")
        attention = fresh_prompts.cudnn_attention
        monkeypatch.setattr(fresh_prompts, "cudnn_attention",
                            lambda *arrays, **options: traced.append("cudnn") or attention(*arrays, **options))
    monkeypatch.setitem(tiny_models.TINY_CONFIGS, "llama_head64",
                        dict(tiny_models.TINY_CONFIGS["llama_gqa_tied"], head_dim=64))
    traced = []

    def spied(name):
        kernel = getattr(hopper, name)
        return lambda *arrays, **options: traced.append(name) or kernel(*arrays, **options)

    for name in ("paged_attention", "ragged_paged_attention"):
        monkeypatch.setattr(hopper, name, spied(name))
    llm, _ = tiny_llm("llama_head64", tmp_path, dtype=dtype)
    assert_greedy_batch_matches(llm, load_hf_model(tmp_path))
    assert {"paged_attention", "ragged_paged_attention"} <= set(traced), "the engine did not run the Mosaic kernels"
    assert ("cudnn" in traced) == cudnn, "cuDNN for the whole prompts"


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_leaves_the_output_unchanged(mode, tmp_path):
    llm, config = tiny_llm("llama_gqa_tied", tmp_path)
    batch = prompts(12, config.vocab_size, seed=7)
    want = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
    small = LLM(str(tmp_path), **{**ENGINE, "num_blocks": 14, "preemption_mode": mode})
    got = [o.outputs[0].token_ids for o in small.generate(batch, GREEDY, use_tqdm=False)]
    assert small.cache_stats().num_preemptions > 0, "the small pool was meant to force preemption"
    assert got == want
    assert_all_blocks_free(small)


def test_multi_step_decode_leaves_the_output_unchanged(tmp_path):
    """Loops of 8 decode steps sampled on the device (with and without a loop dispatched while
    the one before runs): the tokens of one step at a time, greedy and seeded."""
    llm, config = tiny_llm("llama_gqa_tied", tmp_path)
    batch = prompts(12, config.vocab_size, seed=3)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=21) if i % 2 else GREEDY
              for i in range(len(batch))]
    want = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    for async_scheduling in (True, False):
        multi = LLM(str(tmp_path), **{**ENGINE, "num_scheduler_steps": 8, "async_scheduling": async_scheduling})
        got = [o.outputs[0].token_ids for o in multi.generate(batch, params, use_tqdm=False)]
        assert multi.engine.counters.multi_steps > 0
        assert got == want
        assert_all_blocks_free(multi)


@gpu_only
def test_the_pool_is_sized_from_the_device_memory(tmp_path):
    llm, _ = tiny_llm("llama_gqa_tied", tmp_path, num_blocks=None, gpu_memory_utilization=0.3)
    size = llm.engine.kv_cache_size
    assert size.reason.startswith("gpu_memory_utilization")
    assert llm.engine.cache.spec.num_blocks == size.num_blocks > 1000  # a tiny model on a GPU: a large pool


def write_byte_tokenizer(directory, vocab_size: int) -> None:
    """A byte-level tokenizer (one token per byte) with a chat template, saved into ``directory``,
    so a tiny random model can serve text. Token 2, the tiny models' end of sequence, is its EOS."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    assert len(alphabet) <= vocab_size
    tokenizer = Tokenizer(models.BPE(vocab={symbol: i for i, symbol in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=alphabet[2])
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}")
    fast.save_pretrained(directory)


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread", "engine-process"])
def test_the_server_answers_the_openai_client(tmp_path, engine_process):
    """With the engine on the server's thread, and in a process of its own (whose parent must
    leave the GPU to it)."""
    config = write_checkpoint("llama_gqa_tied", tmp_path)
    write_byte_tokenizer(tmp_path, config.vocab_size)
    args = ["--model", str(tmp_path), "--served-model-name", "tiny", "--max-model-len", "128", "--max-num-seqs", "8",
            "--swap-space", "0.01"] + (["--engine-process"] if engine_process else [])
    with running_server(*args) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        completion = client.completions.create(model="tiny", prompt="Hello, GPU", max_tokens=12, temperature=0)
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=8, temperature=0)
    expected = LLM(str(tmp_path), **ENGINE).generate(["Hello, GPU"], SamplingParams(temperature=0, max_tokens=12),
                                                     use_tqdm=False)[0].outputs[0]
    assert completion.choices[0].text == expected.text
    assert completion.usage.completion_tokens == len(expected.token_ids)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens > 0
