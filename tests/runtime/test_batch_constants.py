"""The batch's per-request round inputs, built once per batch composition (``batch_constants.py``)."""
import numpy as np
import pytest

from dspark_trt.runtime.batch_constants import BatchConstantsCache
from dspark_trt.runtime.confidence import MODE_IDS
from dspark_trt.runtime.sampling_params import SamplingParams
from dspark_trt.runtime.scheduler import Sequence


def _seq(i: int, slot: int, **kw) -> Sequence:
    s = Sequence(i, [1, 2], SamplingParams(max_new_tokens=4, **kw), seed=1000 + i)
    s.slot = slot
    return s


def test_constants_follow_each_rows_params_and_are_rebuilt_when_the_batch_changes():
    a = _seq(0, 3, temperature=0.7, top_p=0.9, top_k=5, verify_mode="scheduled")
    b = _seq(1, 1, temperature=0.0, min_p=0.1, repetition_penalty=1.2, logprobs=3)
    c = _seq(2, 0, verify_mode="scheduled")
    cache = BatchConstantsCache()
    ab = cache.get([a, b])
    np.testing.assert_array_equal(ab.fields["seed"], [1000, 1001])
    np.testing.assert_array_equal(ab.fields["slot"], [3, 1])
    np.testing.assert_allclose(ab.fields["temperature"], [0.7, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(ab.fields["top_k"], [5, b.params.top_k])
    np.testing.assert_allclose(ab.fields["repetition_penalty"], [1.0, 1.2], rtol=1e-6)
    np.testing.assert_array_equal(ab.fields["verify_mode"], [MODE_IDS["scheduled"], MODE_IDS["fixed"]])
    assert ab.mods.top_p and ab.mods.top_k and ab.mods.min_p and ab.mods.penalties
    assert ab.logprobs_k == 3 and not ab.all_scheduled
    with pytest.raises(ValueError):
        ab.fields["seed"][0] = 7                       # shared by the batch's rounds: read-only
    assert cache.get([a, b]) is ab                     # same batch: not rebuilt
    ac = cache.get([a, c])                             # another batch
    assert ac is not ab and ac.all_scheduled and ac.logprobs_k is None and not ac.mods.penalties
    assert cache.get([a, b]) is ab                     # the two latest are kept (rounds and a prefill)
    c.slot = 5                                         # a preempted request re-admitted on another slot
    np.testing.assert_array_equal(cache.get([a, c]).fields["slot"], [3, 5])
    assert cache.get([c, a]).fields["seed"].tolist() == [1002, 1000]      # order is the batch's
