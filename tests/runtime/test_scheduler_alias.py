"""The deprecated names of the scheduler (``runtime.generator.Generator``, ``LLM.generator()``)
still work for one release, warn, and are the new objects."""
import importlib

import pytest

from dspark_trt.runtime import LLM, Scheduler, scheduler


def test_generator_module_alias_is_the_scheduler_module():
    with pytest.warns(DeprecationWarning, match="runtime.scheduler"):
        from dspark_trt.runtime.generator import Generator, NONFINITE_LOGITS, to_output
    assert Generator is Scheduler is scheduler.Scheduler
    assert to_output is scheduler.to_output and NONFINITE_LOGITS is scheduler.NONFINITE_LOGITS
    assert importlib.import_module("dspark_trt.runtime.generator").__name__ == "dspark_trt.runtime.generator"
    with pytest.raises(ImportError), pytest.warns(DeprecationWarning):
        from dspark_trt.runtime.generator import NoSuchName  # noqa: F401


def test_llm_generator_is_a_deprecated_alias_of_scheduler():
    calls = []

    class Fake:
        def scheduler(self, speculative=True, record_confidence=False):
            calls.append((speculative, record_confidence))
            return "sched"

    with pytest.warns(DeprecationWarning, match=r"LLM\.scheduler\(\)"):
        assert LLM.generator(Fake(), False, record_confidence=True) == "sched"
    assert calls == [(False, True)]
