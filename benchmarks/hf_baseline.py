"""Hugging Face ``generate`` with static batches: the baseline every benchmark compares with."""

from __future__ import annotations

import os
import time

import torch
import transformers
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from models import loader


class HFModel:
    """SmolLM2-135M-Instruct in PyTorch, from the same GGUF the engine serves."""

    def __init__(self, dtype: str):
        torch.set_num_threads(os.cpu_count() or 1)
        path = loader.default_gguf()
        config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
        model.load_state_dict(tensors, strict=False)
        model.tie_weights()
        self.model = model.to(getattr(torch, dtype)).eval()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        self.tokenizer.padding_side = "left"

    def generate(self, prompts, output_lens, batch_size: int) -> tuple[float, int]:
        """Static batching: each batch (padded on the left) runs until its longest output is done.
        Returns (seconds, useful tokens generated)."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        start = time.perf_counter()
        with torch.no_grad():
            for first in range(0, len(prompts), batch_size):
                batch = prompts[first : first + batch_size]
                longest = max(len(p) for p in batch)
                ids = torch.tensor([[pad] * (longest - len(p)) + p for p in batch])
                mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch])
                new = max(output_lens[first : first + batch_size])
                self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                    do_sample=False, pad_token_id=pad)
        return time.perf_counter() - start, sum(output_lens)
