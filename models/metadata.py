"""Per-step metadata: where each token's KV goes, which blocks it reads, and what the head returns.

Built by the runner, consumed by every attention layer and the head of one forward pass.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
from jax.sharding import PartitionSpec as P

import pallas_paged
from models.sharding import AXIS


@flax.struct.dataclass
class Metadata:
    """Paged-attention inputs shared by all layers of one step.

    slot_mapping: int32[T], cache slot (``block * block_size + offset``) of
      each token's KV; -1 for padding tokens.
    block_tables: int32[S, max_blocks], physical blocks of each sequence.
    context_lens: int32[S], tokens of each sequence including this step's;
      0 for padding sequences.
    query_start_loc: int32[S + 1], sequence i owns tokens
      ``query_start_loc[i]:query_start_loc[i + 1]`` (the last positions of
      its context); tokens past ``query_start_loc[-1]`` are padding.
    logits_indices: int32[L], the tokens whose logits are returned (the last
      token of each sequence, or every prompt token for prompt logprobs).
    argmax_rows: int32[] or None: the first ``argmax_rows`` logits rows are
      sampled by their arg-max alone and the rest are padding, so a head that
      can (``models.layers.logits``) computes exact logits only where they may
      be a row's largest; 0 or None when every logit is wanted.
    decode_only: static; every sequence has exactly one token this step and
      T == S, so the decode kernel is used instead of the ragged one.
    block_size: static; tokens per KV block, what slots and block tables count
      in (0 when not given; the model does not need it).
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array
    query_start_loc: jax.Array
    logits_indices: jax.Array
    argmax_rows: jax.Array | None = None
    decode_only: bool = flax.struct.field(pytree_node=False, default=False)
    block_size: int = flax.struct.field(pytree_node=False, default=0)

    def write_and_attend(self, q, k, v, kv_cache, *, scale):
        """Store this step's K and V, then causal paged attention for its queries.

        q: [T, q_heads, head_dim]; k, v: [T, kv_heads, head_dim]; kv_cache:
        (k_cache, v_cache), each [kv_heads, blocks, block_size, head_dim].
        Returns ([T, q_heads, head_dim] (zeros for padding tokens), new kv_cache).

        Under a mesh with a ``"tp"`` axis (tensor parallelism) the kernels run on
        each device's own heads (``jax.shard_map``): attention needs no
        communication, as every query head's KV head lives on its device.
        """
        mesh = jax.sharding.get_abstract_mesh()
        if AXIS not in mesh.axis_names or mesh.shape[AXIS] == 1:
            return _write_and_attend(self, q, k, v, kv_cache, scale)
        heads, cache = P(None, AXIS, None), P(AXIS, None, None, None)
        local = jax.shard_map(functools.partial(_write_and_attend, scale=scale), mesh=mesh,
                              in_specs=(P(), heads, heads, heads, (cache, cache)), out_specs=(heads, (cache, cache)),
                              check_vma=False)
        return local(self, q, k, v, kv_cache)

    def attend(self, q, k_cache, v_cache, *, scale, new_kv=None):
        """Causal paged attention for this step's queries.

        q: [T, q_heads, head_dim]; k_cache, v_cache: [kv_heads, blocks,
        block_size, head_dim], already holding this step's KV; new_kv: optionally
        that KV, (k, v) [T, kv_heads, head_dim] each (a GPU may attend over it
        instead when the step is all whole prompts: ``pallas_paged.cudnn_prompts``).
        Returns [T, q_heads, head_dim] (zeros for padding tokens).
        """
        if self.decode_only:
            return pallas_paged.paged_attention(
                q, k_cache, v_cache, self.block_tables, self.context_lens, scale=scale)
        return pallas_paged.ragged_paged_attention(
            q, k_cache, v_cache, self.block_tables, self.context_lens, self.query_start_loc, scale=scale,
            new_kv=new_kv)


def _write_and_attend(metadata: Metadata, q, k, v, kv_cache, scale):
    k_cache, v_cache = pallas_paged.write_kv(*kv_cache, k, v, metadata.slot_mapping)
    return metadata.attend(q, k_cache, v_cache, scale=scale, new_kv=(k, v)), (k_cache, v_cache)
