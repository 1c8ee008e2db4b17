"""Sub-commands of the ``dspark-core`` CLI.

Each module listed in :data:`COMMANDS` defines ``NAME`` (the sub-command),
``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
"""

COMMANDS: tuple[str, ...] = (
    "serve",
    "plugins",
    "table",
    "generate", "fetch_model",
    "train_draft", "calibrate_confidence", "eval_draft", "shrink_draft",
    "bench",
)
