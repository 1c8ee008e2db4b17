"""``dspark-core table``: inspect, validate and plot saved cost tables.

``show FILE`` prints the width, model, fingerprint, settings, coverage and the
predicted cost grid. ``validate FILE [--against SERVE FLAGS...]`` exits 0 for
a valid (and, with ``--against``, compatible) table and 1 otherwise, listing
every mismatching field. ``plot FILE -o PNG`` draws measured points against
the fitted surface.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dspark_core.errors import ConfigError, DSparkError, TableError

NAME = "table"
HELP = "Show, validate or plot a saved cost table."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``show``, ``validate`` and ``plot`` actions."""
    actions = parser.add_subparsers(dest="table_action", metavar="ACTION", required=True)
    texts = {
        "show": "`show FILE`: print width, model, coverage, fingerprint and the predicted cost grid.",
        "validate": "`validate FILE [--against SERVE_FLAGS...]`: check a table strictly and, with --against, "
                    "against that launch; exit 1 listing every mismatching field.",
        "plot": "`plot FILE -o PNG`: plot measured points against the fitted surface.",
    }
    show, validate, plot = (actions.add_parser(name, help=text, description=text) for name, text in texts.items())
    for action in (show, validate, plot):
        action.add_argument("file", metavar="FILE", help="Cost table JSON (bundle, bare or legacy).")
        action.add_argument("--plugin", action="append", default=[], metavar="NAME_OR_MODULE",
                            help="Extra plugin providing the table's cost model (repeatable).")
    validate.add_argument("--against", nargs=argparse.REMAINDER, default=None, metavar="SERVE_FLAGS",
                          help="Every following argument is a serve flag (e.g. --model=... --num_speculative_tokens=7); "
                               "the table must be compatible with that launch.")
    plot.add_argument("-o", "--output", required=True, metavar="PNG", help="Where to write the plot.")


def _hooks(plugins: list[str]) -> Any:
    from dspark_core.plugins import load_hooks

    return load_hooks(plugins)


def _launch(argv: list[str], hooks: Any) -> tuple[Any, int]:
    """The fingerprint a launch with serve flags ``argv`` would record on this host, and its draft width.

    Resolution (device, graph backend, dtype, captured tiers) is the launch's
    own (``dspark_core.resolve``); only a device this host cannot use is
    tolerated here, since a table may be checked away from the machine it is for.
    """
    from dspark_core.config import parse_serve_args
    from dspark_core.resolve import fingerprint_for, pick_device

    config = parse_serve_args(argv)
    try:
        device = pick_device(hooks, config.device)
    except DSparkError:  # not usable here: the flags' own values stand in
        device = None
    paths: dict[str, str | Path] = {}
    for key, value in (("target_path", config.model), ("draft_path", config.draft_model)):
        if value:
            try:
                from dspark_core.models.fetch import resolve_model_path

                paths[key] = resolve_model_path(value)
            except ImportError:
                paths[key] = value
    return (fingerprint_for(config, device, target_path=paths.get("target_path"), draft_path=paths.get("draft_path")),
            config.num_speculative_tokens)


def run(args: argparse.Namespace) -> int:
    """Run the chosen action. ``validate``: load and compatibility problems exit 1, usage problems 2;
    ``show`` and ``plot``: any problem exits 2 with the CLI's error line."""
    from dspark_core.costs.report import describe_table, plot_table
    from dspark_core.table import check_compatible, load_table

    hooks = _hooks(args.plugin)
    if args.table_action == "show":
        print("\n".join(describe_table(load_table(args.file, hooks.cost_model))))
        return 0
    if args.table_action == "plot":
        out = plot_table(load_table(args.file, hooks.cost_model), args.output)
        print(f"wrote {out}")
        return 0
    try:
        table = load_table(args.file, hooks.cost_model)
        if args.against is None:
            print(f"valid: {args.file} ({table.origin}, model {table.model}, draft_width {table.draft_width}); "
                  "pass --against SERVE_FLAGS to check compatibility with a launch")
            return 0
        expected, k = _launch(list(args.against), hooks)
        note = check_compatible(table, expected, k)
    except TableError as exc:
        print(f"invalid: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        raise ConfigError(f"--against: {exc}") from None
    print(f"compatible: {args.file} ({table.origin}, model {table.model}, draft_width {table.draft_width})")
    if note:
        print(f"note: {note}")
    return 0
