"""``dspark-trt triton-repo``: write a Triton model repository that serves the model as is."""
from __future__ import annotations

from .common import add_model_args, add_source_args


def add_repo_args(p) -> None:
    """Model source and repository options shared with ``dspark-trt serve --triton``."""
    add_model_args(p)
    add_source_args(p, ("random_weights",),
                    random_weights=dict(help="with --model PRESET: serve random weights (text is noise)"))
    p.add_argument("--no-speculative", action="store_true", help="plain autoregressive decoding")
    g = p.add_argument_group("repository")
    g.add_argument("--model-name", default="dspark", help="Triton model name (default: dspark)")
    g.add_argument("--instance-count", type=int, default=1,
                   help="model instances; each loads its own copy and batches its own requests")
    g.add_argument("--default-max-tokens", type=int, default=64,
                   help="max_tokens when a request does not give it")
    g.add_argument("--cpu-threads", type=int, default=0,
                   help="torch CPU threads per instance (0: torch's default)")
    g.add_argument("--python-env", help="Python environment directory for the model "
                   "(EXECUTION_ENV_PATH; not needed with `dspark-trt serve --triton`)")


def add_parser(sub) -> None:
    p = sub.add_parser("triton-repo", help="write a Triton Inference Server model repository")
    add_repo_args(p)
    p.add_argument("--output", default="model_repository", help="repository directory")
    p.add_argument("--force", action="store_true", help="replace an existing model directory")
    p.set_defaults(func=run)


def write_from_args(args, output) -> "object":
    from ..serving.repository import write_repository
    from ..serving.source import ServedModel
    try:
        return write_repository(output, ServedModel.from_args(args), model_name=args.model_name,
                                instance_count=args.instance_count,
                                default_max_tokens=args.default_max_tokens, cpu_threads=args.cpu_threads,
                                python_env=args.python_env, overwrite=getattr(args, "force", False))
    except (ValueError, FileExistsError) as e:
        raise SystemExit(f"error: {e}") from None


def run(args) -> int:
    model_dir = write_from_args(args, args.output)
    print(f"[dspark-trt] wrote {model_dir}/config.pbtxt and {model_dir}/1/model.py")
    print(f"[dspark-trt] serve it with: dspark-trt serve --triton ... or tritonserver --model-repository={model_dir.parent}")
    return 0
