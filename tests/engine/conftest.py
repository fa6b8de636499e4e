"""Fixtures shared by the server test modules."""

from __future__ import annotations

import json

import openai
import pytest
import transformers
from safetensors.numpy import save_file

import models
from tests.engine.server import SERVER_ARGS, running_server
from tests.models.tiny_models import tiny_config, tiny_weights

TINY_MAX_NEW_TOKENS = 6  # the tiny server's cap on every request's max_tokens


@pytest.fixture(scope="session")
def served_url():
    """The base URL of ``python -m engine.serve`` on SmolLM2 with ``SERVER_ARGS`` and no API
    key, started once for every module that asks for it."""
    with running_server(*SERVER_ARGS) as base:
        yield base


@pytest.fixture(scope="session")
def served_client(served_url):
    return openai.OpenAI(base_url=served_url + "/v1", api_key="unused")


@pytest.fixture(scope="session")
def tiny_served_url(tmp_path_factory):
    """The base URL of ``python -m engine.serve`` on a tiny random LLaMA with SmolLM2's
    tokenizer (adding BOS) and chat template (so text prompts and chats work, at a tiny model's cost),
    ``max_new_tokens`` capped at ``TINY_MAX_NEW_TOKENS``."""
    directory = tmp_path_factory.mktemp("tiny_with_tokenizer")
    models.load_tokenizer("SmolLM2-135M-Instruct").save_pretrained(directory)
    # The tokenizer adds BOS to a text, as many models' do (SmolLM2's adds none), so that
    # add_special_tokens makes a difference a test can see.
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, add_bos_token=True)
    config = tiny_config("llama_gqa_tied")
    config.vocab_size, config.max_position_embeddings = len(tokenizer), 256
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.save_pretrained(directory)
    save_file(tiny_weights(config), directory / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(directory)
    with running_server("--model", str(directory), "--max-model-len", "256", "--max-num-seqs", "16",
                        "--max-num-batched-tokens", "256", "--num-blocks", "64", "--swap-space", "0.05",
                        "--override-generation-config",
                        json.dumps({"max_new_tokens": TINY_MAX_NEW_TOKENS})) as base:
        yield base
