"""A converted copy of each GGUF file, so only the first load pays for the conversion.

Reading a GGUF means dequantising every tensor and rebuilding the tokenizer from its
vocabulary (about 1.6 s for SmolLM2-135M); the converted tensors (HF names, float32, one
``.npy`` file each, memory-mapped on load) and the tokenizer (``save_pretrained``) load in
well under a second. The copy lives in ``$PALLAS_PAGED_CACHE_DIR/models`` (default
``~/.cache/pallas-paged``; an empty value turns caching off), keyed by the file's contents
(its size and a hash of its first and last MiB: a GGUF's header names every tensor, so two
files alike there are the same model), so the same file installed in another environment
uses the same copy. A copy is written to a temporary directory first, then renamed; after
each new one, only the :data:`KEPT_ENTRIES` most recently used copies of files of that name
are kept (each is the model's size in float32: half a GB for SmolLM2-135M).
"""

from __future__ import annotations

import contextlib
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


KEPT_ENTRIES = 2  # per file name, the most recently used first (see prune)
_SAMPLE_BYTES = 2**20  # hashed from each end of the file


def entry(gguf: Path) -> Path | None:
    """The cache directory for ``gguf`` (which may not exist yet)."""
    root = cache_root()
    if root is None:
        return None
    size = gguf.stat().st_size
    key = hashlib.sha256(f"{FORMAT}|{size}|".encode())
    with open(gguf, "rb") as file:
        key.update(file.read(_SAMPLE_BYTES))
        file.seek(max(0, size - _SAMPLE_BYTES))
        key.update(file.read(_SAMPLE_BYTES))
    return root / "models" / f"{gguf.stem}-{key.hexdigest()[:16]}"


def prune(directory: Path, *, keep: int = KEPT_ENTRIES) -> None:
    """Delete all but the ``keep`` most recently used copies (:func:`load` marks a use) of
    files named as ``directory``'s. A process that has a deleted copy's tensors mapped keeps
    them (the files stay until unmapped)."""
    stem = directory.name.rsplit("-", 1)[0]
    copies = []
    for copy in directory.parent.glob(f"{stem}-*"):
        if copy.name.rsplit("-", 1)[0] == stem:  # (not another name that starts with this one)
            try:
                copies.append((copy.stat().st_mtime, copy))
            except FileNotFoundError:  # another process pruned it meanwhile
                continue
    for _, stale in sorted(copies, reverse=True)[keep:]:
        shutil.rmtree(stale, ignore_errors=True)


def load(directory: Path):
    """(config, get(hf_name) -> np.ndarray, tokenizer or None) from a complete entry, marked
    as used now (:func:`prune` keeps the most recently used)."""
    record = json.loads((directory / "config.json").read_text())
    with contextlib.suppress(OSError):
        os.utime(directory)
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
        prune(self.directory)

    def abandon(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
