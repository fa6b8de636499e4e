"""One of two processes standing in for two hosts: ``python -m tests.engine.tp_multihost RANK PORT MODEL_DIR``.

Each process sees one CPU device; ``jax.distributed.initialize`` joins them (gloo collectives
over loopback) and both run the same offline generation with the model split over the two.
Prints the generated token ids as JSON.
"""

from __future__ import annotations

import json
import os
import sys

rank, port, model_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=rank)

from engine import LLM, SamplingParams  # noqa: E402
from tests.engine.tiny import ENGINE, prompts  # noqa: E402

llm = LLM(model_dir, **ENGINE, tensor_parallel_size=2)
outputs = llm.generate(prompts(4, 256, seed=1), SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
print(json.dumps([list(o.outputs[0].token_ids) for o in outputs]))
