"""`dspark-trt build --output`: nothing the builder did not write is ever deleted or changed.

The directory rules run through the real ``build_engine`` with the export + compile stage replaced
by a stub that writes one small file (the engine tests compile real packages); the refusals and
the interrupt run the real CLI in a subprocess.
"""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark_trt.builder import build as build_mod
from dspark_trt.builder.build import BuildOptions, build_engine
from dspark_trt.builder.output_dir import OutputError, holds_engine, stale_temp_dirs

ROOT = Path(__file__).resolve().parents[2]
TINY = "qwen3-tiny-dspark"


def snapshot(d: Path) -> dict:
    """Every entry under ``d`` (and ``d`` itself): mode, and contents for files."""
    out = {".": stat.S_IMODE(d.stat().st_mode)}
    for p in sorted(d.rglob("*")):
        out[str(p.relative_to(d))] = (stat.S_IMODE(p.stat().st_mode),
                                      p.read_bytes() if p.is_file() else None)
    return out


def user_dir(path: Path) -> Path:
    (path / "sub").mkdir(parents=True)
    (path / "important.txt").write_text("the user's notes")
    (path / "sub" / "data.bin").write_bytes(bytes(range(256)))
    os.chmod(path, 0o751)
    return path


def cli(*args, cwd=None, timeout=120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "dspark_trt.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def stub_compile(monkeypatch):
    """The export + compile stage writes one file per network instead of compiling."""
    def fake_build_aoti(o, specs, device, tmp, part, prog, report, sub=""):
        for spec in specs:
            (tmp / f"{sub}{spec.name}.pt2").write_bytes(b"stub package " + spec.name.encode())
            part["networks"][spec.name] = {"file": f"{sub}{spec.name}.pt2"}
    monkeypatch.setattr(build_mod, "_build_aoti", fake_build_aoti)


def build(out: Path, force: bool = False, seed: int = 0) -> list[str]:
    said = []
    build_engine(BuildOptions(model=TINY, output=str(out), random_weights=True, device="cpu",
                              backend="aoti", max_seq_len=64, page_size=8, max_batch_size=2,
                              check_toolchain=False, force=force, seed=seed), report=said.append)
    return said


@pytest.mark.parametrize("how", ["absolute", "dot"])
def test_build_into_a_directory_of_user_files_is_refused_up_front_and_touches_nothing(tmp_path, how):
    d = user_dir(tmp_path / "mine")
    before, siblings = snapshot(d), sorted(os.listdir(tmp_path))
    t0 = time.perf_counter()
    r = cli("build", "--model", TINY, "--random-weights", "--device", "cpu",
            "--output", str(d) if how == "absolute" else ".", cwd=d)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"error: --output {d}: refusing")
    assert "important.txt" in r.stderr and "--force" in r.stderr and "Traceback" not in r.stderr
    assert "[build] load" not in r.stdout                 # refused before any model loads
    assert time.perf_counter() - t0 < 60
    assert snapshot(d) == before and sorted(os.listdir(tmp_path)) == siblings


def test_force_builds_into_a_subdirectory_and_leaves_the_users_files(tmp_path, stub_compile):
    d = user_dir(tmp_path / "mine")
    before = snapshot(d)
    said = build(d, force=True)
    engine = d / TINY
    assert any("--force" in m and str(engine) in m for m in said)
    assert holds_engine(engine)
    assert json.loads((engine / "manifest.json").read_text())["build_options"]["output"] == str(engine)
    after = snapshot(d)
    assert {k: v for k, v in after.items() if not k.startswith(TINY)} == before
    build(d, force=True)                                   # the engine sub-directory is replaced
    assert holds_engine(engine) and sorted(os.listdir(d)) == sorted(["important.txt", "sub", TINY])
    assert {k: v for k, v in snapshot(d).items() if not k.startswith(TINY)} == before


def test_force_never_replaces_a_subdirectory_that_is_not_an_engine(tmp_path, stub_compile):
    d = user_dir(tmp_path / "mine")
    user_dir(d / TINY)
    before = snapshot(d)
    with pytest.raises(OutputError, match=f"refusing to build into {d / TINY}"):
        build(d, force=True)
    assert snapshot(d) == before


def test_an_existing_engine_is_replaced_unless_it_holds_other_files(tmp_path, stub_compile):
    out = tmp_path / "eng"
    build(out)
    build(out, seed=1)
    assert holds_engine(out)
    assert json.loads((out / "manifest.json").read_text())["build_options"]["seed"] == 1
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    with pytest.raises(OutputError, match="notes.txt"):
        build(out)
    assert snapshot(out) == before
    (out / "notes.txt").unlink()
    (out / "my-empty-dir").mkdir()                  # an empty directory of the user's counts too
    with pytest.raises(OutputError, match="my-empty-dir"):
        build(out)
    assert (out / "my-empty-dir").is_dir()
    assert sorted(os.listdir(tmp_path)) == ["eng"]


def test_an_empty_directory_is_used_and_keeps_its_mode(tmp_path, stub_compile):
    out = tmp_path / "empty"
    out.mkdir()
    os.chmod(out, 0o750)
    build(out)
    assert holds_engine(out) and stat.S_IMODE(out.stat().st_mode) == 0o750
    assert sorted(os.listdir(tmp_path)) == ["empty"]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temporary_directories_of_dead_builds_are_removed(tmp_path, stub_compile):
    from dspark_trt.builder.output_dir import _HOST
    out = tmp_path / "eng"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = tmp_path / f".eng.building-{_HOST}-{_dead_pid()}-abc12345"
        live = tmp_path / f".eng.building-{_HOST}-{sleeper.pid}-def45678"
        other_host = tmp_path / ".eng.building-otherhost-1-ghi78901"      # not ours to judge
        old_style = tmp_path / ".eng.building-jkl_0123"                    # older builds' names
        unrelated = tmp_path / ".engine2.building-x"
        users = tmp_path / ".eng.old-mystuff"                              # not our name pattern
        for d in (dead, live, other_host, old_style, unrelated, users):
            d.mkdir()
            (d / "target.pt2").write_bytes(b"partial")
        week_ago = time.time() - 7 * 24 * 3600
        for d in (old_style, live, users):         # age alone never removes a live build's directory
            os.utime(d, (week_ago, week_ago))
        assert stale_temp_dirs(out) == sorted([dead, old_style])
        said = build(out)
        assert not dead.exists() and not old_style.exists()
        assert live.exists() and other_host.exists() and unrelated.exists() and users.exists()
        assert sum("removed" in m for m in said) == 2
        assert holds_engine(out)
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_build_removes_everything_with_one_line(tmp_path, sig):
    """Real build in a subprocess; the signal arrives once its temporary directory exists."""
    out = tmp_path / "engines" / TINY
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dspark_trt.cli", "build", "--model", TINY,
                             "--random-weights", "--device", "cpu", "--max-seq-len", "64",
                             "--page-size", "8", "--skip-toolchain-check", "--output", str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (out.parent.is_dir() and any(".building-" in p for p in os.listdir(out.parent))):
            assert proc.poll() is None and time.time() < deadline, "the build never started writing"
            time.sleep(0.05)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, stderr
    assert "Traceback" not in stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith(f"interrupted by {signal.Signals(sig).name}: build stopped")
    assert [ln for ln in lines if "interrupted" in ln] == lines[-1:]
    assert os.listdir(out.parent) == []
