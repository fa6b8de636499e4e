"""Reproducible request sets: the chat setting of the targets and the paper's two traces."""

from __future__ import annotations

import dataclasses

import numpy as np

TOPICS = ["a lighthouse keeper", "a robot chef", "the last library on Mars", "a cat who learns to fly",
          "a violin maker", "a storm chaser", "an old oak tree", "a time-travelling postman"]
FILLER = ("Describe the setting in detail, introduce at least three characters with distinct voices, build "
          "tension slowly through the middle, and end with a surprising but earned twist. Use vivid sensory "
          "language, vary the sentence length, avoid cliches, keep a warm and slightly humorous tone, and make "
          "sure every paragraph moves the plot forward. The story should feel complete on its own.")


def chat_prompts(tokenizer, count: int = 32, target_tokens: int = 110) -> list[list[int]]:
    """``count`` chat-template prompts of about ``target_tokens`` tokens each."""
    prompts = []
    words = FILLER.split()
    for i in range(count):
        for n in range(len(words), 0, -1):
            content = f"Please write story number {i + 1} about {TOPICS[i % len(TOPICS)]}. " + " ".join(words[:n])
            ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
            if len(ids) <= target_tokens:
                break
        prompts.append(list(ids))
    return prompts


@dataclasses.dataclass(frozen=True)
class Trace:
    """Requests as (prompt token ids, output length), and their arrival times in seconds."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: list[float]


# Mean lengths of the paper's datasets (Kwon et al., Fig. 11).
TRACES = {"sharegpt": (161.31, 337.99), "alpaca": (19.31, 58.45)}


def trace(name: str, count: int, *, vocab_size: int, rate: float = float("inf"), seed: int = 0,
          max_len: int = 2048) -> Trace:
    """A synthetic trace with the dataset's mean prompt and output lengths (long-tailed:
    log-normal lengths), random token ids, and Poisson arrivals at ``rate`` requests/s."""
    mean_prompt, mean_output = TRACES[name]
    rng = np.random.default_rng(seed)

    def lengths(mean):
        sigma = 0.8
        values = rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, count)
        return np.clip(np.round(values), 4, max_len // 2).astype(int)

    prompt_lens, output_lens = lengths(mean_prompt), lengths(mean_output)
    prompts = [rng.integers(100, vocab_size - 100, n).tolist() for n in prompt_lens]
    gaps = rng.exponential(1 / rate, count) if np.isfinite(rate) else np.zeros(count)
    return Trace(name, prompts, output_lens.tolist(), np.cumsum(gaps).tolist())
