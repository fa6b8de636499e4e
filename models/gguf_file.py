"""Reading a GGUF file: its metadata, its tensors and the tokenizer it describes.

One parse of the file serves all three. ``AutoTokenizer.from_pretrained(gguf_file=...)`` would
parse it a second time, and transformers' GGUF reader imports torch, which this package does
not depend on; the tokenizer is built here with transformers' own GGUF tokenizer converter
instead, which needs only ``tokenizers``.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from transformers import PreTrainedTokenizerBase, TokenizersBackend
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

# transformers' names for the special tokens, and the GGUF keys of their ids.
_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                   "pad_token": "padding_token_id"}


class _Reader(gguf.GGUFReader):
    """``gguf.GGUFReader`` over a plain array view of the memory-mapped file.

    Every slice of an ``np.memmap`` runs Python code to set up the subclass, and the parse
    takes a slice per vocabulary string: 2.4 s for SmolLM2's 49k tokens and merges, against
    0.65 s through a plain view of the same mapping.
    """

    def _get(self, offset, dtype, count=1, override_order=None):
        if type(self.data) is np.memmap:
            self.data = self.data.view(np.ndarray)
        return super()._get(offset, dtype, count, override_order)


def read(path: Path) -> tuple[dict, dict]:
    """``(tensors by GGUF name, metadata)`` of the file at ``path``.

    The metadata holds every scalar and the ``tokenizer.*`` arrays; other arrays, and the
    reader with its parsed fields (more memory than the quantised weights), are dropped.
    """
    reader = _Reader(path)
    metadata = {key: field.contents() for key, field in reader.fields.items()
                if field.types[:1] != [gguf.GGUFValueType.ARRAY] or key.startswith("tokenizer.")}
    return {tensor.name: tensor for tensor in reader.tensors}, metadata


def tokenizer(metadata: dict) -> PreTrainedTokenizerBase | None:
    """The tokenizer ``metadata`` (from :func:`read`) describes, or None if it has none: the one
    ``AutoTokenizer.from_pretrained(directory, gguf_file=name)`` builds, from the same keys."""
    if gguf.Keys.Tokenizer.MODEL not in metadata:
        return None
    groups = {group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                      if f"tokenizer.{key}" in metadata}
              for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    vocabulary, config = groups["tokenizer"], groups["tokenizer_config"]
    if vocabulary.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp's default for a sentencepiece vocabulary
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = vocabulary["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata[gguf.Keys.General.ARCHITECTURE], vocabulary)
    return TokenizersBackend(tokenizer_object=backend, **config, **extra)
