"""Hugging Face's outputs, stored under tests/data/ so that model parity runs without torch.

- ``hf_smollm2.json``: HF ``generate``'s greedy continuations on the real SmolLM2 (f32, from the
  packaged GGUF) of the prompt sets of :func:`smollm2_prompts`: "greedy" (a few, for
  tests/models) and "parity" (16, for tests/engine).
- ``hf_tiny_logits.npz``: for every config in ``TINY_CONFIGS``, HF's greedy extension of the
  reference prompts and the float32 logits at every position.

The Python 3.11 leg (with torch) recomputes both and compares (tests/models/test_hf_references.py).
To write them again: ``python -m tests.hf_references`` from the repository root.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import numpy as np

from tests.models.tiny_models import (
    REFERENCE_DECODE_STEPS,
    REFERENCE_PROMPT_LENS,
    TINY_CONFIGS,
    reference_prompts,
    write_checkpoint,
)

DATA = Path(__file__).resolve().parent / "data"
SMOLLM2_FILE = DATA / "hf_smollm2.json"
TINY_FILE = DATA / "hf_tiny_logits.npz"
REGENERATE = "python -m tests.hf_references"
NEW_TOKENS = 32

GREEDY_TEXTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a small village,"]
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


def smollm2_prompts(tokenizer) -> dict[str, list[list[int]]]:
    """The token ids of each stored prompt set: "greedy" (a chat and three texts) and "parity"
    (``PARITY_TEXTS``, then ``PARITY_CHATS`` through the chat template)."""
    return {"greedy": [_chat(tokenizer, PARITY_CHATS[0]), *(tokenizer(t)["input_ids"] for t in GREEDY_TEXTS)],
            "parity": [tokenizer(t)["input_ids"] for t in PARITY_TEXTS] + [_chat(tokenizer, c) for c in PARITY_CHATS]}


def _chat(tokenizer, content: str) -> list[int]:
    """One user message through the chat template, with the assistant's turn begun."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


def stale(path: Path) -> str:
    """What to do when a stored reference no longer fits."""
    return (f"{path.relative_to(DATA.parent.parent)} is not what Hugging Face computes now: write it again with "
            f"`{REGENERATE}` (and find out why it changed)")


def stored_smollm2(prompt_set: str, prompts: list[list[int]]) -> list[list[int]]:
    """HF's stored greedy continuations (``NEW_TOKENS`` at most, EOS included) of ``prompts``,
    which must be the stored set ``prompt_set``."""
    stored = json.loads(SMOLLM2_FILE.read_text())
    assert stored["new_tokens"] == NEW_TOKENS and stored[prompt_set]["prompts"] == prompts, stale(SMOLLM2_FILE)
    return stored[prompt_set]["continuations"]


def stored_tiny(name: str) -> list[tuple[list[int], np.ndarray]]:
    """For ``TINY_CONFIGS[name]``, per reference prompt: (prompt and HF's greedy ids,
    float32[len(ids), vocab] HF logits)."""
    with np.load(TINY_FILE) as data:
        return [(data[f"{name}.ids{i}"].tolist(), data[f"{name}.logits{i}"])
                for i in range(len(REFERENCE_PROMPT_LENS))]


def hf_smollm2_references(model, tokenizer) -> dict:
    """What ``SMOLLM2_FILE`` holds, computed now with HF's torch ``model`` of SmolLM2."""
    from tests.hf_torch import greedy_continuation

    eos = tokenizer.eos_token_id
    return {"new_tokens": NEW_TOKENS, **{
        name: {"prompts": prompts, "continuations": [greedy_continuation(model, p, NEW_TOKENS, eos) for p in prompts]}
        for name, prompts in smollm2_prompts(tokenizer).items()}}


def hf_tiny_references(name: str, directory) -> list[tuple[list[int], np.ndarray]]:
    """What ``TINY_FILE`` holds for ``TINY_CONFIGS[name]``, computed now with HF on the
    checkpoint written to ``directory``."""
    from tests.hf_torch import greedy_logits, load_hf_model

    config = write_checkpoint(name, directory)
    model = load_hf_model(directory)
    return [greedy_logits(model, p, REFERENCE_DECODE_STEPS) for p in reference_prompts(config.vocab_size)]


def _json_one_sequence_a_line(data) -> str:
    """``data`` as indented JSON with each list of numbers on one line."""
    return re.sub(r"\[[\d,\s]*\]", lambda match: json.dumps(json.loads(match.group())), json.dumps(data, indent=1))


def main() -> None:
    """Recompute every stored reference with HF (needs torch) and write the files."""
    import models
    from models import loader
    from tests.hf_torch import hf_from_gguf

    tokenizer = models.load_model().tokenizer
    SMOLLM2_FILE.write_text(_json_one_sequence_a_line(hf_smollm2_references(hf_from_gguf(loader.default_gguf()),
                                                                            tokenizer)) + "\n")
    arrays = {}
    for name in TINY_CONFIGS:
        with tempfile.TemporaryDirectory() as directory:
            for i, (ids, logits) in enumerate(hf_tiny_references(name, directory)):
                arrays |= {f"{name}.ids{i}": np.asarray(ids, np.int32), f"{name}.logits{i}": logits}
    np.savez_compressed(TINY_FILE, **arrays)
    for path in (SMOLLM2_FILE, TINY_FILE):
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
