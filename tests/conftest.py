"""Session fixtures shared by every test package: the real SmolLM2-135M-Instruct and its Hugging Face reference.

HF's outputs are read from tests/data/ (see tests/hf_references.py), so parity runs without
torch; HF's torch model itself (``hf_smollm2_torch``) skips the tests that ask for it there.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

# Converted models and compiled programs persist between runs, in the user's cache directory
# (apart from the engine's own default, ~/.cache/pallas-paged), so that a new clone or worktree
# starts warm: on a clean cache every program compiles afresh, which is about a third of the
# suite's time. Entries are keyed by what they were made from (a GGUF's path, size and
# modification time; a program's HLO, options and JAX version), so checkouts and JAX versions
# sharing the folder read only their own.
os.environ.setdefault("PALLAS_PAGED_CACHE_DIR",
                      str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pallas-paged-tests"))

import pytest

import models
from models import loader
from tests import hf_references
from tests.hf_torch import hf_from_gguf


@dataclasses.dataclass(frozen=True)
class HFReference:
    """Prompts (token ids) and HF's greedy continuations (up to ``new_tokens``, EOS included)."""

    new_tokens: int
    prompts: list[list[int]]
    continuations: list[list[int]]


@pytest.fixture(scope="session")
def smollm2():
    """Our load of the default model: (config, params, tokenizer)."""
    return models.load_model()


@pytest.fixture(scope="session")
def smollm2_prompts(smollm2) -> dict[str, list[list[int]]]:
    """The prompt sets HF's outputs are stored for (``hf_references.smollm2_prompts``)."""
    return hf_references.smollm2_prompts(smollm2.tokenizer)


@pytest.fixture(scope="session")
def hf_smollm2_torch():
    """transformers' f32 load of the default model's GGUF (needs torch)."""
    return hf_from_gguf(loader.default_gguf())


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_prompts) -> HFReference:
    """HF's greedy outputs on a few prompts (stored)."""
    prompts = smollm2_prompts["greedy"]
    return HFReference(hf_references.NEW_TOKENS, prompts, hf_references.stored_smollm2("greedy", prompts))


@pytest.fixture(scope="session")
def hf_smollm2_safetensors(smollm2, hf_smollm2_torch, tmp_path_factory) -> Path:
    """HF's load of the default model saved as safetensors, with our tokenizer (needs torch)."""
    directory = tmp_path_factory.mktemp("smollm2_safetensors")
    hf_smollm2_torch.save_pretrained(directory)
    smollm2.tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def parity_prompts(smollm2_prompts) -> list[list[int]]:
    """16 prompts of varied lengths (two through the chat template), as token ids."""
    return smollm2_prompts["parity"]


@pytest.fixture(scope="session")
def hf_parity(parity_prompts) -> list[list[int]]:
    """HF ``generate`` greedy continuations (NEW_TOKENS each, EOS included) of ``parity_prompts`` (stored)."""
    return hf_references.stored_smollm2("parity", parity_prompts)
