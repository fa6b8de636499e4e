"""A converted copy of each GGUF file, so only the first load pays for the conversion.

Reading a GGUF means dequantising every tensor and rebuilding the tokenizer from its
vocabulary (about 1.6 s for SmolLM2-135M); the converted tensors (HF names, float32, one
``.npy`` file each, memory-mapped on load) and the tokenizer (``save_pretrained``) load in
well under a second. The copy lives in ``$PALLAS_PAGED_CACHE_DIR/models`` (default
``~/.cache/pallas-paged``; an empty value turns caching off), keyed by the file's path, size
and modification time, and is written to a temporary directory first, then renamed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from models.config import Llama3RopeScaling, ModelConfig


def cache_root() -> Path | None:
    """Where converted models and compiled programs are kept, or None when caching is off."""
    root = os.environ.get("PALLAS_PAGED_CACHE_DIR", os.path.expanduser("~/.cache/pallas-paged"))
    return Path(root) if root else None


# Part of every entry's key: raise it when what an entry records changes (its config fields),
# so older entries are converted afresh rather than read with fields missing.
FORMAT = 2


def entry(gguf: Path) -> Path | None:
    """The cache directory for ``gguf`` (which may not exist yet)."""
    root = cache_root()
    if root is None:
        return None
    stat = gguf.stat()
    key = hashlib.sha256(f"{FORMAT}|{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return root / "models" / f"{gguf.stem}-{key}"


def load(directory: Path):
    """(config, get(hf_name) -> np.ndarray, tokenizer or None) from a complete entry."""
    record = json.loads((directory / "config.json").read_text())
    if record.get("rope_scaling"):
        record["rope_scaling"] = Llama3RopeScaling(**record["rope_scaling"])
    record["eos_token_ids"] = tuple(record["eos_token_ids"])
    config = ModelConfig(**record)

    def get(name: str) -> np.ndarray:
        return np.load(directory / "tensors" / f"{name}.npy", mmap_mode="r")

    tokenizer_dir = directory / "tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir.is_dir() else None
    return config, get, tokenizer


class Writer:
    """Collects a conversion as it happens: wrap ``get`` with :meth:`recording`, then :meth:`finish`."""

    def __init__(self, directory: Path):
        self.directory = directory
        directory.parent.mkdir(parents=True, exist_ok=True)
        self.staging = Path(tempfile.mkdtemp(dir=directory.parent, prefix=".incomplete-"))
        (self.staging / "tensors").mkdir()

    def recording(self, get: Callable[[str], np.ndarray]) -> Callable[[str], np.ndarray]:
        def recorded(name: str) -> np.ndarray:
            tensor = get(name)
            np.save(self.staging / "tensors" / f"{name}.npy", np.ascontiguousarray(tensor))
            return tensor

        return recorded

    def finish(self, config: ModelConfig, tokenizer) -> None:
        (self.staging / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
        if tokenizer is not None:
            tokenizer.save_pretrained(self.staging / "tokenizer")
        try:
            self.staging.rename(self.directory)
        except OSError:  # another process finished first
            shutil.rmtree(self.staging, ignore_errors=True)

    def abandon(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
