"""benchmarks/l2_residency.py (the persisting L2 window benchmarks/markov_l2.py measures): input
checks on CPU; on a GPU, that a runtime ``CapturedGraph`` carries the stream's window into its
kernel nodes."""
import pytest
import torch

from benchmarks import l2_residency as l2


def test_window_needs_a_contiguous_cuda_weight():
    with pytest.raises(ValueError, match="contiguous CUDA tensor.*on cpu"):
        l2.set_window(None, torch.zeros(4, 4), 1 << 20)
    with pytest.raises(ValueError, match="strided tensor"):
        l2.set_window(None, torch.zeros(4, 4).t(), 1 << 20)


def test_resident_bytes_follow_the_hit_ratio():
    w = l2.L2Window(base_ptr=0, num_bytes=78 << 20, hit_ratio=0.25, persisting_limit_bytes=20 << 20)
    assert w.resident_bytes == int((78 << 20) * 0.25)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_window_is_captured_into_kernel_nodes():
    pytest.importorskip("cuda.bindings", reason="needs cuda-python")
    from dspark_trt.runtime.cuda_graphs import CapturedGraph
    w = torch.randn(1 << 20, device="cuda")
    stream = torch.cuda.Stream()
    window = l2.set_window(stream, w, 1 << 20)
    assert 0 < window.hit_ratio <= 1 and window.persisting_limit_bytes <= l2.l2_info(0)["max_persisting_bytes"]
    g = CapturedGraph(lambda: w.mul(2.0), torch.cuda.MemPool(), "cuda-python", stream=stream)
    assert all(n == window.num_bytes for n in l2.graph_windows(g._graph))
    l2.clear_window(stream)
