"""Session fixtures shared by every test package: the real SmolLM2-135M-Instruct and its Hugging Face reference."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

# Converted models and compiled programs persist between local runs, inside the checkout.
os.environ.setdefault("PALLAS_PAGED_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".cache"))

import pytest
import torch
import transformers
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

import models
from models import loader

NEW_TOKENS = 32


@dataclasses.dataclass(frozen=True)
class HFReference:
    """Prompts (token ids), HF's greedy continuations (up to ``new_tokens``), and the HF model saved as safetensors."""

    new_tokens: int
    prompts: list[list[int]]
    continuations: list[list[int]]
    safetensors_dir: str


def _prompts(tokenizer) -> list[list[int]]:
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
    texts = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a small village,"]
    return [list(chat), *(tokenizer(t)["input_ids"] for t in texts)]


def _hf_from_gguf(path) -> transformers.PreTrainedModel:
    """transformers' own GGUF conversion into an f32 PyTorch model.

    ``from_pretrained(..., gguf_file=...)`` would do the same but needs the
    ``accelerate`` package, which the project does not depend on.
    """
    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing = model.load_state_dict(tensors, strict=False).missing_keys
    assert missing == (["lm_head.weight"] if config.tie_word_embeddings else []), missing
    return model.eval()


@pytest.fixture(scope="session")
def smollm2():
    """Our load of the default model: (config, params, tokenizer)."""
    return models.load_model()


@pytest.fixture(scope="session")
def hf_smollm2_torch() -> transformers.PreTrainedModel:
    """transformers' f32 load of the default model's GGUF (the reference for parity tests)."""
    return _hf_from_gguf(loader.default_gguf())


@pytest.fixture(scope="session")
def hf_smollm2(smollm2, hf_smollm2_torch, tmp_path_factory) -> HFReference:
    """HF's greedy outputs on a few prompts, and the HF model saved as safetensors."""
    hf = hf_smollm2_torch
    tokenizer = smollm2.tokenizer
    prompts = _prompts(tokenizer)
    with torch.no_grad():
        outputs = [hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               pad_token_id=tokenizer.eos_token_id)[0, len(p):].tolist() for p in prompts]
    directory = tmp_path_factory.mktemp("smollm2_safetensors")
    hf.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return HFReference(NEW_TOKENS, prompts, outputs, str(directory))


PARITY_TEXTS = [
    "Hi",
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three prime numbers:",
    "Translate to French: I like cheese.",
    "The mitochondria is",
    "import numpy as np\n\ndef normalize(x):",
    "Q: What is 12 times 12?\nA:",
    "Write a haiku about the sea.",
    "In 1969, the first humans",
    "The three laws of thermodynamics are",
    "SELECT name, age FROM users WHERE",
    "Dear hiring manager, I am writing to apply for the position of software engineer at your "
    "company. I have five years of experience building distributed systems, and I",
]
PARITY_CHATS = ["What is the capital of France?",
                "Explain in two sentences why the sky is blue, and then give one surprising related fact."]


@pytest.fixture(scope="session")
def parity_prompts(smollm2) -> list[list[int]]:
    """16 prompts of varied lengths (two through the chat template), as token ids."""
    tokenizer = smollm2.tokenizer
    chats = [list(tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)) for c in PARITY_CHATS]
    return [tokenizer(t)["input_ids"] for t in PARITY_TEXTS] + chats


@pytest.fixture(scope="session")
def hf_parity(parity_prompts, hf_smollm2_torch, smollm2) -> list[list[int]]:
    """HF ``generate`` greedy continuations (NEW_TOKENS each, EOS included) of ``parity_prompts``."""
    eos = smollm2.tokenizer.eos_token_id
    outputs = []
    with torch.no_grad():
        for prompt in parity_prompts:
            ids = hf_smollm2_torch.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                            pad_token_id=eos)[0, len(prompt):].tolist()
            outputs.append(ids[: ids.index(eos) + 1] if eos in ids else ids)
    return outputs
