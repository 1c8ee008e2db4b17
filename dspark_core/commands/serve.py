"""``dspark-core serve``: validate the launch, then serve (engine lands in a later issue)."""

from __future__ import annotations

import argparse

from dspark_core.config import add_serve_arguments, config_from_args
from dspark_core.errors import DSparkError
from dspark_core.plugins import load_hooks
from dspark_core.validate import check_config

NAME = "serve"
HELP = "Serve a target model with a DSpark draft over an OpenAI-compatible HTTP API."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_serve_arguments(parser)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    check_config(config)
    load_hooks(config.plugin)
    raise DSparkError(
        "the serving engine is not built yet: the configuration is valid, "
        "but `serve` arrives with the engine and server issues"
    )
