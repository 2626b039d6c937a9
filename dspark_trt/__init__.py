"""dspark_trt: compiled-graph backend for DSpark speculative decoding."""
__version__ = "0.1.0"

from .runtime import LLM, RequestOutput, SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "__version__"]
