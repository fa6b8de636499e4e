"""Hugging Face's torch models as references, for the tests that need them.

torch is a test dependency of the Python 3.11 leg only (``make test``); a leg without it
(Python 3.12 with the newest JAX) skips these tests through :func:`require_torch`, and runs
model parity against the outputs stored under tests/data/ (see tests/hf_references.py).
"""

from __future__ import annotations

import pytest
import transformers


def require_torch(purpose: str = "Hugging Face's reference model"):
    """The torch module; without it, skip the calling test (or fixture, or module) and say why."""
    return pytest.importorskip("torch", reason=f"needs torch for {purpose}; runs in the Python 3.11 leg (make test)")


def load_hf_model(directory) -> transformers.PreTrainedModel:
    """HF's float32 torch model of the checkpoint in ``directory`` (eager attention, eval mode)."""
    torch = require_torch()
    return transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager",
                                                             dtype=torch.float32).eval()


def hf_from_gguf(path) -> transformers.PreTrainedModel:
    """transformers' own GGUF conversion into an f32 PyTorch model.

    ``from_pretrained(..., gguf_file=...)`` would do the same but needs the
    ``accelerate`` package, which the project does not depend on.
    """
    torch = require_torch()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing = model.load_state_dict(tensors, strict=False).missing_keys
    assert missing == (["lm_head.weight"] if config.tie_word_embeddings else []), missing
    return model.eval()


def greedy_continuation(model, prompt: list[int], new_tokens: int, eos: int) -> list[int]:
    """HF ``generate``'s greedy continuation of ``prompt``: up to ``new_tokens`` ids, EOS included."""
    torch = require_torch()
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=eos)[0, len(prompt):].tolist()
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def greedy_logits(model, prompt: list[int], new_tokens: int):
    """Greedy-extend ``prompt`` by ``new_tokens`` with full forward passes; return
    (all ids, float32[len, vocab] logits of every position)."""
    torch = require_torch()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
    return ids, logits


def next_token_logprobs(model, prompt: list[int]):
    """float64[len(prompt), vocab]: HF's log-probabilities of the next token after each prompt prefix."""
    torch = require_torch()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1).numpy()
