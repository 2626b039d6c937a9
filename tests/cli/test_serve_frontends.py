"""`dspark-trt serve` picks its front end: the OpenAI-compatible server by default, Triton with
--triton (`--openai` stays an accepted alias of the default)."""
from __future__ import annotations

import pytest

from dspark_trt import cli
from dspark_trt.commands import serve


def parse(*argv):
    return cli.build_parser().parse_args(["serve", *argv])


def test_default_is_the_openai_server(monkeypatch):
    called = []
    import dspark_trt.openai_server.launch as launch
    monkeypatch.setattr(launch, "serve_from_args", lambda a: called.append(a) or 0)
    for argv in ((), ("--openai",), ("--port", "9001", "--api-key", "k")):
        args = parse(*argv)
        assert not args.triton and serve.run(args) == 0
    assert [a.port for a in called] == [8000, 8000, 9001]


def test_triton_flag_takes_the_triton_path(monkeypatch):
    import dspark_trt.openai_server.launch as launch
    monkeypatch.setattr(launch, "serve_from_args", lambda a: pytest.fail("the OpenAI server started"))
    monkeypatch.setenv("DSPARK_TRITON_ENV", "/nonexistent/triton-env")
    with pytest.raises(SystemExit, match="error:"):          # no Triton install here: its own error
        serve.run(parse("--triton", "--triton-env", "/nonexistent/triton-env"))
    with pytest.raises(SystemExit, match="--api-key is for the OpenAI-compatible server"):
        serve.run(parse("--triton", "--api-key", "k"))


def test_gpu_memory_utilization_reaches_the_llm(monkeypatch):
    from dspark_trt.runtime.llm import LLM
    seen = {}

    class Stop(Exception):
        pass

    def from_source(src, **kw):
        seen.update(kw)
        raise Stop
    monkeypatch.setattr(LLM, "from_source", staticmethod(from_source))
    with pytest.raises(Stop):
        serve.run(parse("--gpu-memory-utilization", "0.85"))
    assert seen.pop("say") is not None                 # load notes go to stderr
    assert seen == {"gpu_memory_utilization": 0.85}
    seen.clear()
    with pytest.raises(Stop):
        serve.run(parse())
    seen.pop("say")
    assert seen == {}
    with pytest.raises(SystemExit, match="--gpu-memory-utilization is for the OpenAI"):
        serve.run(parse("--triton", "--gpu-memory-utilization", "0.5"))


def test_triton_and_openai_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        parse("--triton", "--openai")
    assert "not allowed with argument" in capsys.readouterr().err
