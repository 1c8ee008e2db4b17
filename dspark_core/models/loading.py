"""``load_target``: from a path or alias to a ready target model, via the model-family plugins."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from dspark_core.errors import ModelError, PluginError
from dspark_core.models.fetch import resolve_model_path
from dspark_core.models.gguf_loader import gguf_architecture, read_gguf
from dspark_core.models.hf_loader import hf_architecture, read_hf_dir
from dspark_core.models.llama import LlamaTarget


def checkpoint_format(path: Path) -> str:
    """"gguf" for a GGUF file, "hf" for a directory with config.json; else a ModelError."""
    if path.is_file():
        with path.open("rb") as f:
            if f.read(4) == b"GGUF":
                return "gguf"
        raise ModelError(f"{path}: not a GGUF file (bad magic) and not a model directory")
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf"
        raise ModelError(f"{path}: directory has no config.json")
    raise ModelError(f"{path}: no such model file or directory")


def checkpoint_architecture(path: str | os.PathLike) -> str:
    """Lower-case architecture of a checkpoint (GGUF general.architecture or HF model_type)."""
    p = Path(path)
    return gguf_architecture(p) if checkpoint_format(p) == "gguf" else hf_architecture(p)


def read_llama_checkpoint(path: str | os.PathLike, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> LlamaTarget:
    """Build a :class:`LlamaTarget` (tokenizer attached) from a GGUF file or HF directory."""
    p = Path(path)
    reader = read_gguf if checkpoint_format(p) == "gguf" else read_hf_dir
    cfg, tensors, tokenizer = reader(p)
    return LlamaTarget(cfg, tensors, dtype=dtype, device=device, tokenizer=tokenizer)


def target_family(path: str | os.PathLike, hooks: Any) -> Any:
    """The model-family plugin for the checkpoint at ``path``: its architecture picks it.

    ``hooks`` is anything with ``model_family(architecture)`` (normally the
    launch's :class:`dspark_core.plugins.Hooks`, so a ``--plugin`` family can
    serve new architectures). The family loads the target
    (``load_target``) and, optionally, cuts it into tensor-parallel shards
    (``shard_target``).
    """
    arch = checkpoint_architecture(path)
    try:
        return hooks.model_family(arch)
    except PluginError as exc:
        raise ModelError(f"{path}: architecture {arch!r} is not supported ({exc})") from None


def load_target(path_or_alias: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, *, hooks: Any = None):
    """Load a target model; the checkpoint's architecture picks the model-family plugin.

    ``path_or_alias`` is a GGUF file, a Hugging Face directory, or an alias
    such as ``smollm2`` (fetched into the cache on first use). ``hooks``: see
    :func:`target_family`; the engine's callers always pass theirs.
    """
    path = resolve_model_path(path_or_alias)
    family = target_family(path, _entry_point_hooks() if hooks is None else hooks)
    return family.load_target(path, device=device, dtype=dtype)


def _entry_point_hooks() -> Any:
    # Kept only for callers that predate the ``hooks`` argument (the draft-training
    # commands, tools and tests): the entry-point plugins alone. It is the one place
    # the models layer reaches up to the plugin manager; tests/test_layering.py lists
    # it as an allowed exception, to be removed once every caller passes its hooks.
    from dspark_core.plugins import default_hooks

    return default_hooks()
