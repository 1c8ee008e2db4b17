"""The ``dspark-core`` command line: one sub-command per module in ``commands``."""

from __future__ import annotations

import argparse
import difflib
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
        command.set_defaults(_run=module.run, _parser=command)
    return parser


def unknown_flags_message(command: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """``unrecognized arguments`` with, for each unknown flag, the command's closest flag when one is
    close (``--num-speculative-tokens`` → ``--num_speculative_tokens``: flags are spelled with underscores)."""
    known = [o for action in command._actions for o in action.option_strings if o.startswith("--")]
    hints = []
    for extra in extras:
        flag = extra.split("=", 1)[0]
        if not flag.startswith("--"):
            continue
        underscored = "--" + flag[2:].replace("-", "_")
        close = [underscored] if underscored in known else difflib.get_close_matches(underscored, known, n=1, cutoff=0.75)
        if close:
            hints.append(f"{flag}: did you mean {close[0]}?")
    return f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else "")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if not getattr(args, "_run", None):
        if extras:
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        parser.print_help()
        return 2
    if extras:  # the command's own usage, not the top level's, and the flag that was probably meant
        args._parser.error(unknown_flags_message(args._parser, extras))
    try:
        return int(args._run(args) or 0)
    except DSparkError as exc:
        print(f"dspark-core {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
