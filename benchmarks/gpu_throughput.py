"""Offline throughput on one GPU: this engine against Hugging Face ``generate`` on the same device.

    PYTHONPATH=. python -m benchmarks.gpu_throughput [--quick] [--models smollm2,llama-3.2-1b]
        [--num-prompts 256,512]

No checkpoint is downloaded: each model is random weights (matrices ~N(0, 0.02), norm scales 1)
in the real shapes, written as a bfloat16 safetensors checkpoint with HF's names and
config.json into a temporary directory, which both systems load in bfloat16. Workload: random
prompts (token ids, seeded) of 64-255 tokens, uniformly, 128 new tokens each, greedy,
``ignore_eos``, so both generate exactly the same number of tokens. Ours: one
``engine.LLM`` per prompt count, ``max_num_seqs`` equal to it, ``max_model_len`` 512, warm-up
on (its time is the start-up column), all prompts submitted at once after a short warm-up
request. HF: ``AutoModelForCausalLM`` on the same device, static batches of 64 left-padded
prompts, ``generate(max_new_tokens=128, min_new_tokens=128, do_sample=False)``, after a short
warm-up call; measured on the first prompt count only (each batch of 64 does the same work
whatever the count). tokens/s: generated tokens over wall seconds. Without torch the HF
columns say "n/a (no torch)".
"""

from __future__ import annotations

import argparse
import functools
import gc
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import transformers
from safetensors.numpy import save_file

from benchmarks.gpu_report import header, require_gpu_unless_quick, save
from benchmarks.timing import print_table
from engine import LLM, SamplingParams
from tests.models.tiny_models import llama_shapes

NO_TORCH = "n/a (no torch)"
HF_BATCH = 64
PROMPT_LENS = (64, 255)  # inclusive
MAX_MODEL_LEN = 512

MODELS = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0,
                    max_position_embeddings=8192),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                         rope_theta=500000.0, max_position_embeddings=131072,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
}
QUICK_SHAPE = dict(num_hidden_layers=2, vocab_size=1024)  # --quick: each model with 2 layers and a small vocabulary


def model_config(name: str, quick: bool) -> transformers.LlamaConfig:
    """HF's config of ``MODELS[name]`` (``QUICK_SHAPE`` on top with ``quick``), bfloat16."""
    shape = {**MODELS[name], **(QUICK_SHAPE if quick else {})}
    return transformers.LlamaConfig(**shape, rms_norm_eps=1e-5, dtype="bfloat16", architectures=["LlamaForCausalLM"])


@functools.partial(jax.jit, static_argnums=(1, 2))
def random_matrix(key: jax.Array, shape: tuple[int, ...], std: float) -> jax.Array:
    """bfloat16 ``shape`` ~N(0, std), drawn on the device (seconds faster than numpy for a 1B model)."""
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(jnp.bfloat16)


def random_weights(config: transformers.LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """bfloat16 weights under HF's names and shapes (a tied head left out, as HF saves it):
    matrices ~N(0, ``initializer_range``), norm scales 1."""
    key = jax.random.key(seed)

    def draw(index, shape):
        if len(shape) == 1:
            return np.ones(shape, jnp.bfloat16)
        return np.asarray(random_matrix(jax.random.fold_in(key, index), shape, config.initializer_range))

    return {name: draw(i, shape) for i, (name, shape) in enumerate(llama_shapes(config).items())}


def write_checkpoint(config: transformers.LlamaConfig, directory: pathlib.Path) -> pathlib.Path:
    """config.json and model.safetensors (random weights) in ``directory``; returns it."""
    config.save_pretrained(directory)
    save_file(random_weights(config), directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def random_prompts(count: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of random token ids (from 3, past the special ids) and lengths in PROMPT_LENS."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(PROMPT_LENS[0], PROMPT_LENS[1] + 1, count)
    return [rng.integers(3, vocab_size, n).tolist() for n in lengths]


def engine_throughput(directory: pathlib.Path, prompts: list[list[int]], new_tokens: int,
                      num_scheduler_steps: int = 1) -> tuple[float, float, int]:
    """Our engine on ``prompts`` (max_num_seqs: all of them), ``num_scheduler_steps`` decode steps
    per dispatch: (start-up seconds, generation seconds after a warm-up request, tokens generated)."""
    start = time.perf_counter()
    llm = LLM(model=str(directory), dtype="bfloat16", max_model_len=MAX_MODEL_LEN, max_num_seqs=len(prompts),
              warmup=True, num_scheduler_steps=num_scheduler_steps)
    startup = time.perf_counter() - start
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    failed = [o.error for o in outputs if o.error]
    if failed:
        print(f"WARNING: {len(failed)} requests failed, e.g. {failed[0]}", file=sys.stderr)
    del llm
    gc.collect()
    return startup, seconds, sum(len(o.outputs[0].token_ids) for o in outputs if o.outputs)


def torch_or_none():
    """The torch module, or None where it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def hf_generate(model, prompts: list[list[int]], new_tokens: int, batch_size: int = HF_BATCH) -> int:
    """HF ``generate`` in static batches of left-padded ``prompts``, exactly ``new_tokens`` each
    (greedy); returns the tokens generated."""
    torch = torch_or_none()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id
    generated = 0
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first : first + batch_size]
        longest = max(map(len, batch))
        mask = np.array([[0] * (longest - len(p)) + [1] * len(p) for p in batch])
        ids = np.full(mask.shape, pad)
        ids[mask == 1] = np.concatenate(batch)
        with torch.no_grad():
            out = model.generate(input_ids=torch.from_numpy(ids).to(model.device),
                                 attention_mask=torch.from_numpy(mask).to(model.device), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        generated += (out.shape[1] - longest) * len(batch)
    return generated


def hf_throughput(directory: pathlib.Path, prompts: list[list[int]], new_tokens: int) -> float | str:
    """Hugging Face's tokens/s on ``prompts`` (after a warm-up call), on CUDA where torch has it;
    :data:`NO_TORCH` without torch."""
    torch = torch_or_none()
    if torch is None:
        return NO_TORCH
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).to(device).eval()
    hf_generate(model, prompts[:2], 2)
    start = time.perf_counter()
    tokens = hf_generate(model, prompts, new_tokens)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return tokens / seconds


def model_rows(name: str, counts: list[int], new_tokens: int, quick: bool, steps: list[int]) -> list[list]:
    """Table rows for one model: a row per prompt count and ``num_scheduler_steps``, HF measured
    on the first count's prompts."""
    config = model_config(name, quick)
    with tempfile.TemporaryDirectory(prefix=f"gpu-throughput-{name}-") as folder:
        directory = write_checkpoint(config, pathlib.Path(folder))
        hf = hf_throughput(directory, random_prompts(counts[0], config.vocab_size), new_tokens)
        runs = {(count, k): engine_throughput(directory, random_prompts(count, config.vocab_size), new_tokens, k)
                for count in counts for k in steps}
    rows = []
    for (count, k), (startup, seconds, tokens) in runs.items():
        ours = tokens / seconds
        if isinstance(hf, str):
            hf_cell, versus = hf, "n/a"
        else:
            where = "" if count == counts[0] else f" (on {counts[0]} prompts)"
            hf_cell, versus = f"{hf:,.0f}{where}", f"{ours / hf:.2f}"
        rows.append([name, count, k, new_tokens, f"{startup:.1f}", f"{seconds:.2f}", f"{ours:,.0f}", hf_cell,
                     versus])
    return rows


HEADERS = ["model", "prompts = max_num_seqs", "num_scheduler_steps", "new tokens each", "engine start-up s", "ours s",
           "ours tokens/s", "HF generate tokens/s", "ours / HF"]


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; print the table and write it (with where it ran); return the text."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="2-layer models, 8 and 16 prompts, 8 new tokens: to check the script (any backend)")
    parser.add_argument("--models", default="smollm2,llama-3.2-1b", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--num-prompts", default=None,
                        help="comma-separated prompt counts, a row each (default 256,512; quick 8,16)")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="tokens generated per prompt (default 128; quick 8)")
    parser.add_argument("--num-scheduler-steps", default="1,8",
                        help="comma-separated decode steps per dispatch, a row each (default 1,8)")
    args = parser.parse_args(argv)
    require_gpu_unless_quick(args.quick)
    names = args.models.split(",")
    if unknown := [name for name in names if name not in MODELS]:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    counts = [int(n) for n in (args.num_prompts or ("8,16" if args.quick else "256,512")).split(",")]
    new_tokens = args.new_tokens or (8 if args.quick else 128)
    top = header("benchmarks.gpu_throughput", list(sys.argv[1:] if argv is None else argv),
                 ("torch", "transformers", "safetensors"))
    steps = [int(k) for k in args.num_scheduler_steps.split(",")]
    rows = [row for name in names for row in model_rows(name, counts, new_tokens, args.quick, steps)]
    shapes = "2-layer, 1024-token-vocabulary versions of the models" if args.quick else "the models' real shapes"
    note = (f"Random weights in {shapes}, bfloat16; prompts of {PROMPT_LENS[0]}-{PROMPT_LENS[1]} random tokens, "
            f"greedy, ignore_eos; ours max_model_len {MAX_MODEL_LEN}, warm-up on; HF static batches of {HF_BATCH}, "
            f"left-padded, on {hf_device()}.")
    text = "\n\n".join([top, note, print_table(HEADERS, rows)])
    save(text, "gpu_throughput", args.quick)
    return text


def hf_device() -> str:
    """Where HF runs: a CUDA device's name, "cpu", or that torch is missing."""
    torch = torch_or_none()
    if torch is None:
        return "nothing (no torch)"
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
