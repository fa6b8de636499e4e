"""Hugging Face hub IDs (``HuggingFaceTB/SmolLM2-135M-Instruct``) → a local checkpoint directory.

The local Hugging Face cache is looked in first (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``), as vLLM and ``transformers`` do; a model missing there is
downloaded through ``huggingface_hub`` unless the hub is off (``HF_HUB_OFFLINE=1``) or out of
reach. Only what this engine reads is fetched: JSON configs, safetensors and tokenizer files.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import huggingface_hub
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

# owner/name, as the hub spells repository IDs
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_WANTED_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken"]
_TRUE = ("1", "true", "yes", "on")


class HubModelNotFound(Exception):
    """The ID is in neither the local cache nor (reachable) on the hub; the message says where it looked."""


def is_repo_id(name: str) -> bool:
    """Whether ``name`` has the shape of a hub ID (``owner/name``)."""
    return bool(_REPO_ID.match(name))


def cache_dir() -> Path:
    """The hub cache, from the environment as it is now (``HF_HUB_CACHE``, ``HF_HOME``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(huggingface_hub.constants.HF_HUB_CACHE)


def offline() -> bool:
    """``HF_HUB_OFFLINE`` set (read now, not when ``huggingface_hub`` was imported)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE or huggingface_hub.constants.HF_HUB_OFFLINE


def snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The directory of ``repo_id``'s files: the cached snapshot, else a download.

    Raises HubModelNotFound, naming the cache it looked in and why the hub did not answer.
    """
    cache = cache_dir()
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                                      allow_patterns=_WANTED_FILES, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    where = f"{repo_id!r} is not in the Hugging Face cache ({cache})"
    if offline():
        raise HubModelNotFound(f"{where}, and HF_HUB_OFFLINE is set; download it where the hub is reachable "
                               f"(hf download {repo_id}) or give a local directory") from None
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                                      allow_patterns=_WANTED_FILES))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise HubModelNotFound(f"{where}, and the hub did not provide it: {reason}") from None
