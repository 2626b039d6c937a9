"""``dspark-trt`` command line: one module per sub-command in ``dspark_trt/commands``.

A user error (a bad option, request, checkpoint, engine or output path; the project's error
types) ends the command with one ``error: <message>`` line on stderr and exit code 2; any other
exception is a bug and keeps its traceback. SIGINT / SIGTERM end it with one line and exit code
130 / 143.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# sub-command name -> module in dspark_trt.commands (each has add_parser(subparsers) and run(args))
COMMANDS = ["build", "generate", "bench", "info", "triton_repo", "serve", "train", "calibrate", "draft_vocab"]
USAGE_ERROR = 2


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every option's default, except flags (False), options whose default is
    decided later (None) and help texts that already state it."""

    def _get_help_string(self, action):
        d, text = action.default, action.help or ""
        if d is None or d is False or d is argparse.SUPPRESS or "default" in text.lower():
            return text
        return super()._get_help_string(action)


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Use ``DefaultsHelpFormatter``; options without a help text get one with their default."""
    parser.formatter_class = DefaultsHelpFormatter
    for a in parser._actions:
        if a.help is None and a.option_strings and not (a.default is None or a.default is False):
            a.help = "default: %(default)s"


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types whose message is meant for the user (no traceback)."""
    from .builder.backends import BuildError
    from .checkpoints.files import CheckpointError
    from .checkpoints.quant import QuantFormatError
    from .engine.manifest import EngineError
    from .config import ConfigError
    from .runtime.kv_manager import KVBudgetError
    from .runtime.sampling_params import RequestError
    return (ConfigError, CheckpointError, RequestError, EngineError, BuildError, KVBudgetError,
            QuantFormatError)


def build_parser() -> argparse.ArgumentParser:
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
    for p in (parser, *sub.choices.values()):
        show_defaults(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)     # to start more ranks (build --tp-size)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        rc = int(args.func(args) or 0)
        _leave_process_group(barrier=True)
        return rc
    except user_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_ERROR
    except SystemExit as e:                          # raise SystemExit("error: ...") in a command:
        if isinstance(e.code, str):                  # the message once, exit code 2 (str(e) keeps it)
            print(e.code if e.code.startswith("error:") else f"error: {e.code}", file=sys.stderr)
            e.code = USAGE_ERROR
        raise
    except KeyboardInterrupt as e:                   # interrupts.Interrupted says which signal
        print(f"interrupted by {getattr(e, 'signal_name', 'SIGINT')}", file=sys.stderr)
        return getattr(e, "exit_code", 130)
    finally:
        _leave_process_group(barrier=False)


def _leave_process_group(barrier: bool) -> None:
    """Under torchrun: leave the process group before the interpreter exits (a gloo group left
    to the exit handlers sometimes aborts a rank with 'terminate called without an active
    exception'); after a normal run, wait for the other ranks first."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
