"""Drafts shipped with dspark-core, resolvable as ``--draft_model=default``.

The package directory ``dspark_core/drafts/<name>/`` holds speculators-format
checkpoints (``config.json`` + ``model.safetensors``) trained by
``dspark-core train-draft`` (see docs/draft-training.md).
"""

from __future__ import annotations

import os
from pathlib import Path

from dspark_core.errors import ModelError

DRAFTS_DIR = Path(__file__).resolve().parent.parent / "drafts"
# target alias (or GGUF file stem, lower case) -> shipped draft directory name
_DEFAULTS = {"smollm2": "smollm2", "smollm2-135m-instruct.q4_1": "smollm2", "smollm2-135m-instruct": "smollm2"}


def default_draft_path(target_name_or_path: str | os.PathLike) -> Path:
    """Directory of the shipped default draft for a target alias or checkpoint path."""
    key = str(target_name_or_path)
    name = _DEFAULTS.get(key.lower()) or _DEFAULTS.get(Path(key).stem.lower()) or _DEFAULTS.get(Path(key).name.lower())
    if name is None:
        raise ModelError(f"no default draft is shipped for target {key!r}; pass --draft_model=DIR (known: {sorted(set(_DEFAULTS.values()))})")
    path = DRAFTS_DIR / name
    if not (path / "config.json").is_file():
        raise ModelError(f"the default draft for {key!r} is missing from the installation ({path})")
    return path


def resolve_draft_path(draft: str | os.PathLike, target: str | os.PathLike) -> Path:
    """``default`` -> the shipped draft for ``target``; anything else is a checkpoint directory."""
    return default_draft_path(target) if str(draft) == "default" else Path(draft)
