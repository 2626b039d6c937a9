"""Inconsistent torchrun launches fail before any process group is joined, naming the variables
(``parallel.topology``); per-rank engine files; the build's shared-directory check."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dspark_trt.config import ConfigError
from dspark_trt.parallel import TPInfo, init_tp
from dspark_trt.parallel.topology import Launch, check_gpus, check_tp_size

TWO_BY_FOUR = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
               "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}


def test_reads_a_multi_node_launch():
    la = Launch.from_env(TWO_BY_FOUR)
    assert (la.rank, la.world, la.local_rank, la.local_world, la.node, la.nodes) == (5, 8, 1, 4, 1, 2)
    assert la.describe() == "rank 5 of 8 (node 1 of 2, local rank 1 of 4)"
    assert Launch.from_env({}) == Launch()                      # not under torchrun: rank 0 of 1
    assert Launch.from_env({}).describe() == "rank 0 of 1 (local rank 0)"


@pytest.mark.parametrize("change, message", [
    ({"RANK": "x"}, "RANK='x' is not an integer"),
    ({"RANK": "8"}, "RANK=8 is outside WORLD_SIZE=8"),
    ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE=0"),
    ({"LOCAL_RANK": "4"}, "LOCAL_RANK=4 is outside LOCAL_WORLD_SIZE=4"),
    ({"LOCAL_RANK": "-1"}, "LOCAL_RANK=-1"),
    ({"LOCAL_WORLD_SIZE": "16"}, "LOCAL_WORLD_SIZE=16 .* WORLD_SIZE=8"),
    ({"GROUP_RANK": "2"}, "GROUP_RANK=2 is outside GROUP_WORLD_SIZE=2"),
    ({"GROUP_WORLD_SIZE": "9", "GROUP_RANK": "0"}, "GROUP_WORLD_SIZE=9 nodes for WORLD_SIZE=8"),
])
def test_inconsistent_variables_are_named(change, message):
    with pytest.raises(ConfigError, match=message):
        Launch.from_env({**TWO_BY_FOUR, **change})


def test_tp_size_must_be_the_whole_launch():
    la = Launch.from_env(TWO_BY_FOUR)
    check_tp_size(8, la, "--tp-size 8")                          # 2 nodes x 4 = 8: fine
    with pytest.raises(ConfigError, match=r"--tp-size 4 but this launch has WORLD_SIZE=8 \(2 node\(s\) x "
                                          r"4 process\(es\)\); one tensor-parallel group spans the whole "
                                          r"launch .*--nnodes N .* N x M = 4"):
        check_tp_size(4, la, "--tp-size 4")
    with pytest.raises(ConfigError, match="--tp-size 3 but this launch has WORLD_SIZE=8 .*: launch with") as e:
        check_tp_size(3, la, "--tp-size 3")
    assert "data-parallel" not in str(e.value)                   # 8 is no multiple of 3
    with pytest.raises(ConfigError, match=r"tp_size=2 but WORLD_SIZE is 1 \(or not set: not under torchrun\)"):
        check_tp_size(2, Launch(), "tp_size=2")
    with pytest.raises(ConfigError, match="must be >= 1"):
        check_tp_size(0, la, "--tp-size 0")


def test_each_rank_of_a_node_needs_its_own_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    la = Launch.from_env(TWO_BY_FOUR)
    check_gpus(la, 4)
    with pytest.raises(ConfigError, match=r"LOCAL_WORLD_SIZE=4 processes on this node but 2 GPU\(s\) visible "
                                          r"\(CUDA_VISIBLE_DEVICES=0,1,2,3\): --nproc-per-node"):
        check_gpus(la, 2)
    by_hand = Launch(rank=3, world=4, local_rank=3)              # no LOCAL_WORLD_SIZE: the rank itself
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=3 but 2 GPU\(s\) visible"):
        check_gpus(by_hand, 2)


def test_init_tp_checks_before_joining(monkeypatch):
    """On "cuda" with too few GPUs, and with a tp_size other than WORLD_SIZE, init_tp raises on
    the variables before it sets a device or joins a group."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device before the check"))
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: pytest.fail("joined"))
    for k, v in TWO_BY_FOUR.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE=4 processes on this node but 2 GPU"):
        init_tp(device_type="cuda", tp_size=8)
    with pytest.raises(ConfigError, match="tp_size=4 but this launch has WORLD_SIZE=8"):
        init_tp(device_type="cuda", tp_size=4)


def test_a_gpu_index_under_tensor_parallelism_is_refused(monkeypatch):
    import dspark_trt.runtime.llm as llm_mod
    monkeypatch.setattr(llm_mod, "resolve_device", lambda d: torch.device("cuda", 1))
    with pytest.raises(ConfigError, match="'cuda:1' with tp_size=2: each rank uses cuda:LOCAL_RANK"):
        llm_mod._join_tp(2, "cuda:1")


def _engine(tmp: Path, world: int) -> Path:
    """A manifest-only engine directory with a shared file and one file per rank part."""
    from dspark_trt.engine.manifest import device_info, toolchain_versions, write_manifest
    (tmp / "tokenizer.json").write_text("{}")
    for r in range(world):
        (tmp / f"rank{r}").mkdir()
        (tmp / f"rank{r}" / "weights.safetensors").write_bytes(bytes([r]) * 8)
    write_manifest(tmp, {"backend": "aoti", "versions": toolchain_versions(), "tp_size": world,
                         "device": device_info(torch.device("cpu"))})
    return tmp


def test_a_rank_checks_only_its_own_engine_part(tmp_path):
    from dspark_trt.engine.manifest import EngineError, check_engine, rank_of_file
    assert [rank_of_file(n) for n in ("rank3/weights.safetensors", "tokenizer.json", "rank3",
                                      "ranks/x", "rank1x/y")] == [3, None, None, None, None]
    eng = _engine(tmp_path, 2)
    (eng / "rank1" / "weights.safetensors").unlink()            # this "node" holds rank 0's part only
    assert check_engine(eng, torch.device("cpu"), rank=0)["tp_size"] == 2
    with pytest.raises(EngineError, match="'rank1/weights.safetensors' listed in the manifest is missing"):
        check_engine(eng, torch.device("cpu"), rank=1)
    with pytest.raises(EngineError, match="rank1/weights.safetensors"):
        check_engine(eng, torch.device("cpu"))                   # no rank: every file
    (eng / "tokenizer.json").write_text('{"x": 1}')             # a shared file: every rank checks it
    with pytest.raises(EngineError, match="'tokenizer.json' is corrupted"):
        check_engine(eng, torch.device("cpu"), rank=0)
    assert json.loads((eng / "manifest.json").read_text())["tp_size"] == 2


def test_build_on_nodes_without_a_shared_output_fails_clearly(tmp_path):
    from dspark_trt.builder.backends import BuildError
    from dspark_trt.builder.build import _check_visible
    la = Launch.from_env(TWO_BY_FOUR)
    tp = TPInfo(la.rank, la.world, la.local_rank, torch.device("cpu"), la)
    _check_visible(tmp_path, tp)                                 # visible: fine
    with pytest.raises(BuildError, match=r"rank 5 of 8 \(node 1 of 2, local rank 1 of 4\) does not see "
                                         r"rank 0's temporary engine directory .*shared by every node"):
        _check_visible(tmp_path / "on-node-0-only", tp)
