"""Session fixtures for the real SmolLM2-135M-Instruct model and its Hugging Face reference."""

from __future__ import annotations

import dataclasses

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
def hf_smollm2(smollm2, tmp_path_factory) -> HFReference:
    """transformers' f32 load of the same GGUF: greedy outputs, and the model saved as safetensors."""
    hf = _hf_from_gguf(loader.default_gguf())
    tokenizer = smollm2.tokenizer
    prompts = _prompts(tokenizer)
    with torch.no_grad():
        outputs = [hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               pad_token_id=tokenizer.eos_token_id)[0, len(p):].tolist() for p in prompts]
    directory = tmp_path_factory.mktemp("smollm2_safetensors")
    hf.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return HFReference(NEW_TOKENS, prompts, outputs, str(directory))
