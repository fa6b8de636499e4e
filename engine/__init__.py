"""Requests, memory and time: the serving engine.

    from engine import LLM, SamplingParams
    outputs = LLM().generate(["Hello"], SamplingParams(max_tokens=32))
"""

from engine.llm import LLM, CacheStats
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "BeamSearchParams", "CacheStats", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
