"""The worker: everything that touches device arrays, carrying out what the core decided.

* ``model_runner``: a step's work as padded arrays, run through ``stages`` (the model's
  compiled programs, one per stage and shape), with ``tensor_parallel`` placement;
* ``cache_engine``: the device KV caches and the host swap space, and the block moves of a
  step; ``kv_cache_size``: how many blocks the device gets; ``huge_pages`` on Linux CPUs;
* ``sampler``: the jitted sampling programs; ``sampling_rows``: requests' rows into the
  sampler's batch, dispatched and fetched;
* ``model_loader``: checkpoints loaded once and shared by the engines that use them.
"""
