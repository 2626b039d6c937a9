"""The engine's sidecar files (calibration, cost curve): replaced in place after a build without
making the engine "corrupted", and written whole or not at all (``atomic_write``)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from dspark_trt import atomic_write
from dspark_trt.checkpoints.files import CALIBRATION_FILE, COST_FILE
from dspark_trt.engine.manifest import SIDECAR_FILES, EngineError, check_engine, device_info, toolchain_versions, \
    write_manifest
from dspark_trt.runtime.confidence import Calibration
from dspark_trt.runtime.cost_curve import CostCurve

CPU = torch.device("cpu")


def fake_engine(d, list_calibration: bool = False):
    """A directory whose manifest checks like a built engine's: one 'network' file and the draft's
    calibration as the build copies it. ``list_calibration``: the manifest lists it, as engines
    built before ``SIDECAR_FILES`` do."""
    d.mkdir()
    (d / "draft_block.pt2").write_bytes(b"\x01network bytes")
    Calibration([1.5, 2.0]).save(d)
    m = write_manifest(d, {"device": device_info(CPU), "backend": "aoti", "versions": toolchain_versions()})
    if list_calibration:
        p = d / "confidence_calibration.json"
        m["files"][p.name] = {"sha256": "0" * 64, "bytes": p.stat().st_size}
        (d / "manifest.json").write_text(json.dumps(m))
    return m


def test_sidecar_names_are_the_files_the_commands_write():
    assert SIDECAR_FILES == {CALIBRATION_FILE, COST_FILE}


@pytest.mark.parametrize("list_calibration", [False, True])
def test_recalibrating_an_engine_and_saving_its_cost_curve_keep_it_valid(tmp_path, list_calibration):
    d = tmp_path / "engine"
    m = fake_engine(d, list_calibration)
    assert ("confidence_calibration.json" in m["files"]) == list_calibration
    assert "draft_block.pt2" in m["files"]
    Calibration([0.5, 0.75, 1.25]).save(d)             # dspark-trt calibrate --engine d
    CostCurve.default().save(d)                         # dspark-trt bench --cost-curve --engine d
    check_engine(d, CPU)
    assert Calibration.find(d).temperatures == [0.5, 0.75, 1.25]
    assert CostCurve.find(d).to_json() == CostCurve.default().to_json()
    (d / "draft_block.pt2").write_bytes(b"\x02network bytes")      # the build's files stay guarded
    with pytest.raises(EngineError, match="draft_block.pt2' is corrupted"):
        check_engine(d, CPU)


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    Calibration([1.5, 2.0]).save(tmp_path)
    before = (tmp_path / "confidence_calibration.json").read_text()

    def crash(*a):
        raise OSError("disk full")
    for where in ("fsync", "replace"):                     # mid-write, and at the rename
        with monkeypatch.context() as mp:
            mp.setattr(atomic_write.os, where, crash)
            with pytest.raises(OSError, match="disk full"):
                Calibration([9.0]).save(tmp_path)
        assert (tmp_path / "confidence_calibration.json").read_text() == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["confidence_calibration.json"]
    with pytest.raises(TypeError):                          # not serialisable: nothing is touched
        atomic_write.write_json_atomic(tmp_path / "confidence_calibration.json", {"t": object()})
    assert (tmp_path / "confidence_calibration.json").read_text() == before
    Calibration([9.0]).save(tmp_path)
    assert Calibration.load(tmp_path / "confidence_calibration.json").temperatures == [9.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["confidence_calibration.json"]
    assert os.stat(tmp_path / "confidence_calibration.json").st_size > 0
