"""Runtime: KV caches, the draft-verify loop, the continuous-batching scheduler, the LLM API."""
import sys
import types
import warnings

from . import scheduler
from .llm import LLM
from .sampling_params import RequestError, RequestOutput, SamplingParams, SpecStats
from .scheduler import Scheduler

__all__ = ["LLM", "Scheduler", "SamplingParams", "RequestOutput", "RequestError", "SpecStats"]


def _generator_alias() -> types.ModuleType:
    """``dspark_trt.runtime.generator``, the old name of ``scheduler`` (its ``Generator`` is
    ``Scheduler``): deprecated, removed in the next release. A module object rather than a file,
    so that ``generator.py -> scheduler.py`` stays a plain rename in git."""
    mod = types.ModuleType(__name__ + ".generator", _generator_alias.__doc__)

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        warnings.warn("dspark_trt.runtime.generator is deprecated: use dspark_trt.runtime.scheduler "
                      "(Generator is now Scheduler)", DeprecationWarning, stacklevel=2)
        return getattr(scheduler, "Scheduler" if name == "Generator" else name)

    mod.__getattr__ = __getattr__
    return mod


generator = sys.modules.setdefault(__name__ + ".generator", _generator_alias())
