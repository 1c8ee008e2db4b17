"""``dspark-core plugins``: list loaded plugins, their versions, hooks and components."""

from __future__ import annotations

import argparse
import json

from dspark_core.plugins import build_plugin_manager, plugin_report, Hooks

NAME = "plugins"
HELP = "List plugins with their versions, the hooks they implement and the components they provide."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plugin", action="append", default=[], metavar="NAME_OR_MODULE",
                        help="Extra plugin to load (repeatable); `no:NAME` blocks one.")
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of a table.")


def run(args: argparse.Namespace) -> int:
    pm = build_plugin_manager(tuple(args.plugin))
    report = plugin_report(pm)
    components = Hooks(pm).components()
    if args.json:
        print(json.dumps({
            "plugins": [{"name": p.name, "version": p.version, "hooks": list(p.hooks)} for p in report],
            "components": [{"kind": c.kind, "name": c.name, "summary": c.summary} for c in components],
        }, indent=2))
        return 0
    width = max((len(p.name) for p in report), default=4)
    for info in report:
        print(f"{info.name:<{width}}  {info.version:<8}  {', '.join(info.hooks)}")
    print()
    for component in sorted(components, key=lambda c: (c.kind, c.name)):
        print(f"{component.kind:<14} {component.name:<14} {component.summary}")
    return 0
