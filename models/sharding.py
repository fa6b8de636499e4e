"""Named partitioning of parameters and KV caches for tensor parallelism.

Megatron-style, over one mesh axis ``"tp"``:

* column-parallel linears (``q``, ``k``, ``v``, ``gate``, ``up``, ``fc1``,
  ``lm_head``) split their output columns: ``w: P(None, "tp")``,
  ``b: P("tp")``. Q columns are head-major and K/V columns KV-head-major, so
  device s gets query heads ``s * heads / tp ...`` and exactly the KV heads
  they read (query head h reads KV head ``h // queries_per_kv``);
* row-parallel linears (``o``, ``down``, ``fc2``) split their input rows,
  ``w: P("tp", None)``, and keep the bias replicated (XLA adds it after the
  partial sums are reduced);
* the embedding is split over the vocabulary, ``P("tp", None)``, so a tied
  head is vocabulary-parallel too;
* KV caches split over KV heads, ``P("tp", None, None, None)``;
* everything else (norms, positions, project_in/out) is replicated.

The ``"tp"`` size must divide the KV heads, the intermediate size and the
vocabulary. Nothing is sharded unless a caller places arrays with these
specs (``jax.device_put(params, named_shardings(mesh, params))``).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "tp"
COLUMN_PARALLEL = frozenset({"q", "k", "v", "gate", "up", "fc1", "lm_head"})
ROW_PARALLEL = frozenset({"o", "down", "fc2"})


def _spec(path, leaf) -> P:
    names = [entry.key for entry in path if isinstance(entry, jax.tree_util.DictKey)]
    owner, name = (names[-2] if len(names) > 1 else None), names[-1]
    if owner in COLUMN_PARALLEL:
        return P(None, AXIS) if name == "w" else P(AXIS)
    if owner in ROW_PARALLEL and name == "w":
        return P(AXIS, None)
    if name == "embed":
        return P(AXIS, None)
    return P(*([None] * leaf.ndim))


def param_specs(params):
    """A pytree of ``PartitionSpec`` matching ``params``, one spec per array."""
    return jax.tree_util.tree_map_with_path(_spec, params)


def kv_cache_specs(num_layers: int) -> list[tuple[P, P]]:
    """Specs for ``KVCacheSpec.allocate()``'s per-layer (k_cache, v_cache): split over KV heads."""
    spec = P(AXIS, None, None, None)
    return [(spec, spec)] * num_layers


def named_shardings(mesh: jax.sharding.Mesh, specs):
    """Turn a pytree of specs into ``NamedSharding``s on ``mesh`` (which has a ``"tp"`` axis)."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))
