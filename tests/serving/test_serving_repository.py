"""The repository generator: config.pbtxt from the template, model.py, the CLI."""
from __future__ import annotations

import re
import subprocess

import pytest

from dspark_trt.cli import main
from dspark_trt.serving.repository import PROJECT_ROOT, pbtxt_string, render_config, write_repository
from dspark_trt.serving.server import ServingEnvError, TritonInstall
from dspark_trt.serving.source import ServedModel

PARAM = re.compile(r'\{ key: "((?:[^"\\]|\\.)*)" value: \{ string_value: "((?:[^"\\]|\\.)*)" \} \}')


def parameters(text: str) -> dict[str, str]:
    unescape = lambda s: s.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")  # noqa: E731
    return {unescape(k): unescape(v) for k, v in PARAM.findall(text)}


def io_names(text: str, section: str) -> list[tuple[str, str, str]]:
    block = re.search(section + r" \[(.*?)\n\]", text, re.S).group(1)
    return re.findall(r'name: "(\w+)" data_type: (TYPE_\w+) dims: \[ (-?1) \]', block)


def preset_source(**kw) -> ServedModel:
    return ServedModel(model="qwen3-tiny-dspark", random_weights=True, **kw)


def test_write_repository_layout_and_config(tmp_path):
    src = preset_source(max_batch_size=16, max_seq_len=256, num_spec_tokens=3)
    model_dir = write_repository(tmp_path / "repo", src, model_name="tiny", instance_count=2,
                                 default_max_tokens=32)
    assert model_dir == tmp_path / "repo" / "tiny"
    text = (model_dir / "config.pbtxt").read_text()
    assert "${" not in text and 'name: "tiny"' in text and 'backend: "python"' in text
    assert "model_transaction_policy { decoupled: true }" in text
    assert "max_batch_size: 0" in text                       # batching is the runtime's, not Triton's
    assert "instance_group [ { count: 2 kind: KIND_CPU } ]" in text
    assert io_names(text, "input") == [
        ("text_input", "TYPE_STRING", "1"), ("input_ids", "TYPE_INT32", "-1"), ("max_tokens", "TYPE_INT32", "1"),
        ("temperature", "TYPE_FP32", "1"), ("top_p", "TYPE_FP32", "1"), ("seed", "TYPE_UINT64", "1"),
        ("stream", "TYPE_BOOL", "1"), ("stop", "TYPE_STRING", "-1"), ("stop_ids", "TYPE_INT32", "-1")]
    assert [n for n, _, _ in io_names(text, "output")] == [
        "text_output", "output_ids", "finish_reason", "tau", "acceptance_per_position", "rounds"]
    params = parameters(text)
    assert params["default_max_tokens"] == "32" and params["project_path"] == str(PROJECT_ROOT)
    assert ServedModel.from_parameters(params) == src         # the model reads back what was written
    model_py = (model_dir / "1" / "model.py").read_text()
    assert "class TritonPythonModel" in model_py and "dspark_trt.serving.triton_model" in model_py


def test_gpu_device_gives_gpu_instances_and_env_path(tmp_path):
    d = write_repository(tmp_path, preset_source(device="cuda"), python_env=str(tmp_path / "env"))
    text = (d / "config.pbtxt").read_text()
    assert "kind: KIND_GPU" in text
    assert parameters(text)["EXECUTION_ENV_PATH"] == str((tmp_path / "env").resolve())


def test_parameter_strings_are_escaped():
    tricky = 'a "quoted" \\ path\nnext'
    assert parameters(render_config("m", {"k": tricky})) == {"k": tricky}
    assert pbtxt_string('x"y') == '"x\\"y"'


@pytest.mark.parametrize("kw, message", [
    ({"model_name": "bad name"}, "model name"), ({"model_name": ""}, "model name"),
    ({"instance_count": 0}, "instance count"), ({"default_max_tokens": 0}, "default max tokens")])
def test_bad_repository_options(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        write_repository(tmp_path, preset_source(), **kw)


def test_existing_model_dir_needs_overwrite(tmp_path):
    write_repository(tmp_path, preset_source())
    with pytest.raises(FileExistsError, match="overwrite"):
        write_repository(tmp_path, preset_source())
    write_repository(tmp_path, preset_source(max_seq_len=99), overwrite=True)
    assert parameters((tmp_path / "dspark" / "config.pbtxt").read_text())["max_seq_len"] == "99"


@pytest.mark.parametrize("argv, message", [
    (["--model", "qwen3-tiny-dspark"], "--random-weights"),
    (["--checkpoint", "."], "go together"),
    (["--model", "qwen3-tiny-dspark", "--random-weights", "--engine", "."], "exactly one model source"),
    (["--engine", "/nonexistent/engine"], "is not a directory")])
def test_cli_rejects_bad_model_source(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["triton-repo", "--output", str(tmp_path), *argv])


def test_cli_without_a_model_source_uses_the_default_pair(tmp_path, capsys):
    """Like `dspark-trt generate`: no --engine/--checkpoint/--model means the built-in pair."""
    from dspark_trt.commands.common import default_pair_dirs
    pair = default_pair_dirs()
    if pair is None:
        pytest.skip("the built-in default pair is not in this checkout")
    assert main(["triton-repo", "--output", str(tmp_path)]) == 0
    params = parameters((tmp_path / "dspark" / "config.pbtxt").read_text())
    assert (params["checkpoint"], params["draft_checkpoint"]) == tuple(str(p.resolve()) for p in pair)
    assert "default pair" in capsys.readouterr().out


def test_cli_writes_checkpoint_repository_with_absolute_paths(tmp_path, monkeypatch):
    (tmp_path / "t").mkdir()
    (tmp_path / "d").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["triton-repo", "--checkpoint", "t", "--draft-checkpoint", "d", "--output", "repo",
                 "--max-batch-size", "4", "--no-speculative"]) == 0
    params = parameters((tmp_path / "repo" / "dspark" / "config.pbtxt").read_text())
    assert params["checkpoint"] == str(tmp_path / "t") and params["draft_checkpoint"] == str(tmp_path / "d")
    assert params["max_batch_size"] == "4" and params["speculative"] == "false"


def test_config_parses_as_triton_model_config(tmp_path):
    """Strict check with Triton's own protobuf schema, from the serving venv when it exists."""
    try:
        install = TritonInstall.find()
    except ServingEnvError as e:
        pytest.skip(f"serving venv unavailable: {e}")
    d = write_repository(tmp_path, preset_source(), instance_count=3)
    code = ("import sys; from google.protobuf import text_format; "
            "from tritonclient.grpc import model_config_pb2 as m; "
            "c = text_format.Parse(open(sys.argv[1]).read(), m.ModelConfig()); "
            "print(c.name, c.backend, c.model_transaction_policy.decoupled, c.instance_group[0].count, "
            "len(c.input), len(c.output), c.parameters['model'].string_value)")
    out = subprocess.run([str(install.python), "-c", code, str(d / "config.pbtxt")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["dspark", "python", "True", "3", "9", "6", "qwen3-tiny-dspark"]


def test_draft_vocab_is_written_as_an_absolute_path(tmp_path, monkeypatch):
    """The repository is loaded from Triton's working directory: a relative --draft-vocab is resolved."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "v.json").write_text("{}")
    assert main(["triton-repo", "--model", "qwen3-tiny-dspark", "--random-weights", "--draft-vocab", "v.json",
                 "--output", str(tmp_path / "repo")]) == 0
    params = parameters((tmp_path / "repo" / "dspark" / "config.pbtxt").read_text())
    assert params["draft_vocab"] == str((tmp_path / "v.json").resolve())
    assert ServedModel.from_parameters(params).draft_vocab == params["draft_vocab"]
