"""Fixtures shared by the server test modules."""

from __future__ import annotations

import openai
import pytest

from tests.engine.server import SERVER_ARGS, running_server


@pytest.fixture(scope="session")
def served_url():
    """The base URL of ``python -m engine.serve`` on SmolLM2 with ``SERVER_ARGS`` and no API
    key, started once for every module that asks for it."""
    with running_server(*SERVER_ARGS) as base:
        yield base


@pytest.fixture(scope="session")
def served_client(served_url):
    return openai.OpenAI(base_url=served_url + "/v1", api_key="unused")
