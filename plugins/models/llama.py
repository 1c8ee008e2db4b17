"""Default model-family plugin: Llama-architecture targets (SmolLM2, Llama, Qwen2/3 dense)."""

from __future__ import annotations

import os

import torch

from dspark_core.components import Component
from dspark_core.hookspecs import hookimpl
from dspark_core.models.llama import LlamaTarget
from dspark_core.models.loading import read_llama_checkpoint

#: Architecture strings (GGUF general.architecture / HF model_type) this family serves.
ARCHITECTURES = frozenset({"llama", "qwen2", "qwen3", "mistral", "smollm", "smollm2"})


class LlamaFamily:
    """Loads Llama-family checkpoints from GGUF files or Hugging Face directories."""

    name = "llama"
    architectures = ARCHITECTURES

    def load_target(self, path: str | os.PathLike, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> LlamaTarget:
        """The target model; its tokenizer is ``model.tokenizer``."""
        return read_llama_checkpoint(path, device=device, dtype=dtype)

    def shard_target(self, target: LlamaTarget, rank: int, world_size: int, group=None) -> LlamaTarget:
        """Cut ``target`` in place to rank ``rank``'s tensor-parallel shard (KV heads and MLP columns)."""
        from dspark_core.distributed.tp import shard_llama  # torch.distributed only when sharding

        return shard_llama(target, rank, world_size, group)


@hookimpl
def dspark_components():
    return [Component("model_family", "llama", "Llama-architecture targets (SmolLM2, Llama, Qwen2/3 dense) from GGUF or HF safetensors")]


@hookimpl
def dspark_model_family(architecture: str):
    return LlamaFamily() if architecture.lower() in ARCHITECTURES else None
