"""Write a Triton model repository: ``<output>/<name>/config.pbtxt`` + ``<name>/1/model.py``.

Both files come from ``templates/``; config.pbtxt gets the model source and serving options as
string parameters, which ``triton_model.DSparkModel`` reads back.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from string import Template

from .source import ServedModel

TEMPLATES = Path(__file__).resolve().parent / "templates"
PROJECT_ROOT = Path(__file__).resolve().parents[2]      # the directory holding dspark_trt/


def pbtxt_string(s: str) -> str:
    """A protobuf text-format string literal."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def render_config(model_name: str, parameters: dict[str, str], instance_count: int = 1,
                  instance_kind: str = "KIND_CPU") -> str:
    if not model_name or not all(c.isalnum() or c in "-_." for c in model_name):
        raise ValueError(f"model name {model_name!r} must be non-empty and use only letters, digits, '-', '_', '.'")
    if instance_count < 1:
        raise ValueError(f"instance count must be >= 1, got {instance_count}")
    if instance_kind not in ("KIND_CPU", "KIND_GPU"):
        raise ValueError(f"instance kind must be KIND_CPU or KIND_GPU, got {instance_kind!r}")
    params = ",\n".join(f"  {{ key: {pbtxt_string(k)} value: {{ string_value: {pbtxt_string(v)} }} }}"
                        for k, v in parameters.items())
    return Template((TEMPLATES / "config.pbtxt").read_text()).substitute(
        model_name=model_name, instance_count=instance_count, instance_kind=instance_kind,
        parameters=params)


def write_repository(output: str | Path, source: ServedModel, *, model_name: str = "dspark",
                     instance_count: int = 1, default_max_tokens: int = 64, cpu_threads: int = 0,
                     project_path: str | Path | None = PROJECT_ROOT, python_env: str | None = None,
                     overwrite: bool = False) -> Path:
    """Write the repository; returns the model directory ``<output>/<model_name>``.

    ``project_path`` is put on the model's sys.path (None: dspark_trt must be importable in the
    server's Python). ``python_env``: a Python environment directory for EXECUTION_ENV_PATH.
    ``cpu_threads``: torch intra-op threads per instance (0: torch's default).
    """
    if default_max_tokens < 1:
        raise ValueError(f"default max tokens must be >= 1, got {default_max_tokens}")
    params = source.to_parameters()
    if cpu_threads < 0:
        raise ValueError(f"cpu threads must be >= 0, got {cpu_threads}")
    params["default_max_tokens"] = str(default_max_tokens)
    params["cpu_threads"] = str(cpu_threads)
    params["project_path"] = str(Path(project_path).resolve()) if project_path else ""
    if python_env:
        params["EXECUTION_ENV_PATH"] = str(Path(python_env).resolve())
    kind = "KIND_GPU" if (source.device or "").startswith("cuda") else "KIND_CPU"
    if source.tp_size > 1:                 # one instance leads the ranks on cuda:0..tp_size-1
        if instance_count != 1:
            raise ValueError(f"--tp-size {source.tp_size}: serve one instance (it starts the "
                             f"{source.tp_size} ranks), not --instance-count {instance_count}")
        kind = "KIND_CPU"
    text = render_config(model_name, params, instance_count, kind)     # validates before any write
    model_dir = Path(output) / model_name
    if model_dir.exists():
        if not overwrite:
            raise FileExistsError(f"{model_dir} exists; pass overwrite=True (--force) to replace it")
        shutil.rmtree(model_dir)
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(text)
    shutil.copyfile(TEMPLATES / "model.py", model_dir / "1" / "model.py")
    return model_dir
