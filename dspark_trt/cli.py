"""``dspark-trt`` command line: one module per sub-command in ``dspark_trt/commands``."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# sub-command name -> module in dspark_trt.commands (each has add_parser(subparsers) and run(args))
COMMANDS = ["build", "generate", "bench", "info", "triton_repo", "serve", "train"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dspark-trt", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"dspark_trt.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"dspark_trt.commands.{name}":
                continue
            raise
        mod.add_parser(sub)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)     # to start more ranks (build --tp-size)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    from .config import ConfigError
    from .builder.checkpoint import CheckpointError
    from .runtime.sampling_params import RequestError
    from .builder.engine_dir import EngineError
    try:
        return int(args.func(args) or 0)
    except (ConfigError, CheckpointError, RequestError, EngineError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
