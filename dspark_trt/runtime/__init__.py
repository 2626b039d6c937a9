"""Runtime: KV caches, the draft-verify loop, the LLM API."""
from .llm import LLM
from .sampling_params import RequestError, RequestOutput, SamplingParams, SpecStats

__all__ = ["LLM", "SamplingParams", "RequestOutput", "RequestError", "SpecStats"]
