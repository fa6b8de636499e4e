"""Tensor parallelism: decode-step time and bytes per device with the model split over N devices.

    python -m benchmarks.tensor_parallel [--quick]

Each N runs in its own process with N host devices (``XLA_FLAGS``); on this CPU the "devices"
share the same two cores, so the step times show the cost of partitioning and the two
all-reduces per layer, not a speed-up. The bytes held per device show what tensor
parallelism is for: weights and KV split about N ways. The model is a random LLaMA with
heads divisible by 4 (SmolLM2's 3 KV heads do not split over 2 or 4 devices).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.timing import print_table, result_name, save_text

MODEL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
             num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048)


def build_model(directory: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**MODEL, tie_word_embeddings=True)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def measure(model_dir: str, devices: int, seqs: int, steps: int) -> dict:
    """In this process (already started with ``devices`` host devices): bytes and step time."""
    import jax
    import numpy as np

    from engine import LLM, SamplingParams

    llm = LLM(model_dir, max_model_len=512, max_num_seqs=seqs, max_num_batched_tokens=512, num_blocks=512,
              swap_space=0.01, tensor_parallel_size=devices)
    engine = llm.engine

    def per_device(tree):
        shard = [s for a in jax.tree.leaves(tree) for s in a.addressable_shards if s.device == jax.devices()[0]]
        return sum(s.data.nbytes for s in shard)

    prompts = [list(np.random.default_rng(i).integers(10, 30000, 64)) for i in range(seqs)]
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    engine.step()  # prefill
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step = (time.perf_counter() - start) / steps
    return {"devices": devices, "weights_mb": per_device(engine.runner.params) / 2**20,
            "kv_mb": per_device(engine.cache.kv_caches) / 2**20, "step_ms": step * 1e3}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    seqs, steps = (4, 4) if args.quick else (16, 32)
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), seqs, steps)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as model_dir:
        build_model(model_dir)
        for devices in (1, 2, 4):
            env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
            out = subprocess.run([sys.executable, "-m", "benchmarks.tensor_parallel", "--child", model_dir,
                                  str(devices)] + (["--quick"] if args.quick else []),
                                 capture_output=True, text=True, env=env, check=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append([devices, result["weights_mb"], result["kv_mb"], result["step_ms"]])
    table = print_table(["devices", "weights MiB per device", "KV MiB per device", f"decode step ms ({seqs} seqs)"],
                        rows)
    save_text(table, result_name("tensor_parallel", args.quick))


if __name__ == "__main__":
    main()
