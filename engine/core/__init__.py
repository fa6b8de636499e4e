"""The engine's core: pure Python over immutable state, no JAX, no device.

Which sequences run, and where their KV blocks are:

* ``scheduler``: ``schedule(state) -> (state, plan)`` and ``update(state, actions)``, the
  protocol of a step (its records in ``scheduler_state``, the two halves in
  ``scheduler_plan`` and ``scheduler_update``);
* ``block_manager``: blocks for groups of sequences (admission, appending, fork,
  copy-on-write, swap, free), over ``block_pool`` (reference counts and the free list),
  ``prefix_cache`` (blocks found by their content), ``allocation`` (the paper's reservation
  policies) and ``buddy`` (the Orca baselines' contiguous runs); ``block_stats`` counts;
* ``sequence``: a sequence's tokens and status.

The worker carries out what the core decides; nothing here imports JAX (import-linter keeps it so).
"""
