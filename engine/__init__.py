"""Requests, memory and time: the serving engine.

    from engine import LLM, SamplingParams
    outputs = LLM().generate(["Hello"], SamplingParams(max_tokens=32))
"""

from engine.entrypoints.llm import LLM, CacheStats
from engine.inputs import TextPrompt, TokensPrompt
from engine.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import (
                                    BeamSearchParams,
                                    GuidedDecodingParams,
                                    RequestOutputKind,
                                    SamplingParams,
                                    StructuredOutputsParams,
)

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CacheStats", "CompletionOutput",
           "GuidedDecodingParams", "Logprob", "RequestOutput", "RequestOutputKind", "SamplingParams",
           "StructuredOutputsParams", "TextPrompt", "TokensPrompt"]
