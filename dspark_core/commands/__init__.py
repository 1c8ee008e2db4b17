"""Sub-commands of the ``dspark-core`` CLI.

Each module listed in :data:`COMMANDS` defines ``NAME`` (the sub-command),
``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
"""

import argparse

COMMANDS: tuple[str, ...] = (
    "serve",
    "plugins",
    "table",
    "generate", "fetch_model",
    "train_draft", "calibrate_confidence", "eval_draft", "shrink_draft",
    "bench",
)


def positive_ints(text: str) -> list[int]:
    """An argparse ``type``: comma-separated positive integers (``1,4,16``)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive_int(text: str) -> int:
    """An argparse ``type``: one integer >= 1 (a count, a size, an interval), refused at parse time so a
    zero never reaches the loop it would break after minutes of work."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value
