"""Test helper: run sequences through a model's paged forward pass.

``PagedModel`` owns the KV caches, hands each sequence blocks drawn from a
shuffled free list (so block tables are scattered), and builds the ragged
metadata: a prefill of several prompts in one batch, then decode steps on
the decode-only path. Every batch carries a padding sequence and padding
tokens, as a real runner's buckets would.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import models
from pallas_paged import KVCacheSpec, blocks_needed


@functools.cache
def compiled_forward(config):
    """One jitted step per config, shared by every ``PagedModel`` (compiles once per shape)."""
    return jax.jit(models.forward_fn(config), donate_argnums=4)


class PagedModel:
    """A model, its KV caches and the block tables of the sequences it runs."""

    def __init__(self, config, params, *, block_size=4, max_len=64, max_seqs=8, dtype=jnp.float32, seed=0):
        self.config, self.params, self.block_size = config, params, block_size
        self.max_blocks = blocks_needed(max_len, block_size)
        num_blocks = self.max_blocks * max_seqs
        self.free = list(np.random.default_rng(seed).permutation(num_blocks))
        self.kv_caches = KVCacheSpec(num_blocks, block_size, config.num_kv_heads, config.head_dim,
                                     config.num_layers, dtype).allocate()
        self.step = compiled_forward(config)
        self.tables: list[list[int]] = []
        self.lens: list[int] = []

    def prefill(self, prompts, all_logits=False, pad_tokens=3):
        """Start one sequence per prompt in one ragged batch.

        Returns float32 logits, [sum(len(p)), vocab] for every prompt token
        when ``all_logits`` else [len(prompts), vocab] for the last ones.
        """
        first = len(self.lens)
        for prompt in prompts:
            self.tables.append([int(self.free.pop()) for _ in range(self.max_blocks)])
            self.lens.append(len(prompt))
        seqs = list(range(first, len(self.lens)))
        positions = [list(range(len(p))) for p in prompts]
        ends = np.cumsum([len(p) for p in prompts])
        logits_indices = np.arange(ends[-1]) if all_logits else ends - 1
        return self._run(seqs, [t for p in prompts for t in p], positions, logits_indices, pad_tokens, False)

    def decode(self, tokens):
        """Append one token to every running sequence (decode-only path). Returns [num_seqs, vocab]."""
        seqs = list(range(len(self.lens)))
        for seq in seqs:
            self.lens[seq] += 1
        positions = [[self.lens[seq] - 1] for seq in seqs]
        return self._run(seqs, list(tokens), positions, np.arange(len(seqs)), 1, True)

    def _run(self, seqs, tokens, positions, logits_indices, pad_tokens, decode_only):
        """One forward pass; padding: ``pad_tokens`` tokens and one empty sequence."""
        flat_positions = [p for ps in positions for p in ps]
        slots = [self._slot(seq, p) for seq, ps in zip(seqs, positions) for p in ps]
        q_lens = [len(ps) for ps in positions] + [0]
        context_lens = [self.lens[seq] for seq in seqs] + [0]
        tables = [self.tables[seq] for seq in seqs] + [[0] * self.max_blocks]
        if decode_only:
            q_lens[-1] = 1
        metadata = models.Metadata(
            slot_mapping=_int32(slots + [-1] * pad_tokens),
            block_tables=_int32(tables),
            context_lens=_int32(context_lens),
            query_start_loc=_int32(np.concatenate([[0], np.cumsum(q_lens)])),
            logits_indices=_int32(logits_indices),
            decode_only=decode_only,
        )
        ids = _int32(tokens + [0] * pad_tokens)
        logits, self.kv_caches = self.step(self.params, ids, _int32(flat_positions + [0] * pad_tokens),
                                           metadata, self.kv_caches)
        return np.asarray(logits)

    def _slot(self, seq, position):
        block, offset = divmod(position, self.block_size)
        return self.tables[seq][block] * self.block_size + offset


def _int32(values):
    return jnp.asarray(np.asarray(values, dtype=np.int32))


def greedy(model: PagedModel, prompts, max_new_tokens):
    """Greedy continuations of ``prompts`` (lists of ids) computed together, each ``max_new_tokens`` long."""
    tokens = model.prefill(prompts).argmax(-1)
    out = [[int(t)] for t in tokens]
    for _ in range(max_new_tokens - 1):
        tokens = model.decode(tokens).argmax(-1)
        for seq, t in zip(out, tokens):
            seq.append(int(t))
    return out
