"""Run as ``python -m tests.engine.tp_check N`` with N host devices: tensor parallelism over N
devices must reproduce the single-device engine. Exits non-zero with a message otherwise."""

from __future__ import annotations

import os
import sys

DEVICES = int(sys.argv[1])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"

import tempfile  # noqa: E402

import numpy as np  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.core.scheduler import ScheduledGroupWork  # noqa: E402
from engine.worker import stages  # noqa: E402
from tests.engine.tiny import ENGINE, prompts  # noqa: E402
from tests.models.tiny_models import write_checkpoint  # noqa: E402

MODEL = {2: "llama_gqa_tied", 4: "llama_mha_bias"}[DEVICES]  # KV heads divisible by the device count


def logits(llm, prompt):
    """Logits of every prompt token from one prefill step, through the engine's runner."""
    runner = llm.engine.runner
    work = ScheduledGroupWork("check", (0,), tuple(prompt), 0, tuple(range(-(-len(prompt) // 8))), True, True)
    inputs = runner.prepare([work], list(range(len(prompt))))
    out, llm.engine.cache.kv_caches = runner.run(inputs, llm.engine.cache.kv_caches)
    return np.asarray(out.logits)[: len(prompt)]


def main():
    directory = tempfile.mkdtemp()
    write_checkpoint(MODEL, directory)
    batch = prompts(8, 256, seed=1)
    greedy = SamplingParams(temperature=0, max_tokens=10)
    single = LLM(directory, **ENGINE)
    split = LLM(directory, **{**ENGINE, "tensor_parallel_size": DEVICES})

    diff = np.abs(logits(single, batch[-1]) - logits(split, batch[-1])).max()
    assert diff <= 1e-5, f"logits differ by {diff}"
    shard = split.engine.cache.kv_caches[0][0].addressable_shards[0].data
    assert shard.shape[0] == split.engine.model_config.num_kv_heads // DEVICES, shard.shape

    want = [o.outputs[0].token_ids for o in single.generate(batch, greedy, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in split.generate(batch, greedy, use_tqdm=False)]
    assert got == want, "greedy outputs differ"

    scored = SamplingParams(max_tokens=1, prompt_logprobs=3)  # scored from logits split over the vocabulary
    split_scores = split.generate(batch, scored, use_tqdm=False)
    for alone, each in zip(single.generate(batch, scored, use_tqdm=False), split_scores):
        for a, b in zip(alone.prompt_logprobs[1:], each.prompt_logprobs[1:]):
            assert {t: v.rank for t, v in a.items()} == {t: v.rank for t, v in b.items()}, "prompt logprobs differ"
            assert all(abs(a[t] - b[t]) <= 1e-5 for t in a), "prompt logprobs differ"

    swapping = LLM(directory, **{**ENGINE, "tensor_parallel_size": DEVICES, "num_blocks": 12,
                                 "preemption_mode": "swap", "max_num_seqs": 8})
    got = [o.outputs[0].token_ids for o in swapping.generate(batch, greedy, use_tqdm=False)]
    assert swapping.cache_stats().num_preemptions > 0, "the small pool was meant to force preemption"
    assert got == want, "outputs changed under preemption by swap"

    layers = [exe.as_text() for key, exe in stages._compiled.items() if key[0] == "layer" and key[2] is not None]
    assert layers, "no tensor-parallel layer program was compiled"
    for text in layers:
        counts = {op: text.count(f" {op}(") for op in ("all-reduce", "all-gather", "all-to-all", "collective-permute")}
        assert counts == {"all-reduce": 2, "all-gather": 0, "all-to-all": 0, "collective-permute": 0}, counts
    embeds = [exe.as_text() for key, exe in stages._compiled.items() if key[0] == "embed" and key[2] is not None]
    for text in embeds:  # the vocabulary-parallel lookup: each device's own rows, summed
        counts = {op: text.count(f" {op}(") for op in ("all-reduce", "all-gather")}
        assert counts == {"all-reduce": 1, "all-gather": 0}, f"the embedding lookup moves the table: {counts}"
    print(f"ok: {DEVICES} devices, logits within {diff:.1e}, {len(layers)} layer programs with 2 all-reduces each, "
          f"{len(embeds)} embedding programs with one")


if __name__ == "__main__":
    main()
