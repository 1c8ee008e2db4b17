"""The ``dspark-core`` command line: one sub-command per module in ``commands``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from dspark_core import __version__
from dspark_core.commands import COMMANDS
from dspark_core.errors import DSparkError


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered sub-command."""
    parser = argparse.ArgumentParser(
        prog="dspark-core",
        description="Adaptive speculative decoding with DSpark drafts and calibrated full-step costs.",
    )
    parser.add_argument("--version", action="version", version=f"dspark-core {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMANDS:
        module = importlib.import_module(f"dspark_core.commands.{module_name}")
        command = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except DSparkError as exc:
        print(f"dspark-core {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
