"""Static per-slot cache of a GLM-DSA target.

MLA keeps one compressed entry per position instead of per-head keys and
values: the normalised latent ``c_kv`` (``kv_lora_rank`` wide, shared by all
heads, expanded on the fly through ``kv_b_proj``) and the single rotary key
``k_pe`` (``qk_rope_head_dim``). Layers that run their own lightning indexer
also keep the indexer's key (``index_head_dim``) per position. As with the
Llama cache, nothing here tracks lengths: the engine owns committed lengths
and a later forward overwrites positions a rejected speculative row wrote.
"""

from __future__ import annotations

import torch
from attrs import define

from dspark_core.errors import ModelError


@define
class GlmDsaCache:
    latent: torch.Tensor  # [num_layers, num_slots, max_len, kv_lora_rank]
    rope_keys: torch.Tensor  # [num_layers, num_slots, max_len, qk_rope_head_dim]
    index_keys: torch.Tensor  # [num_indexer_layers, num_slots, max_len, index_head_dim]

    @classmethod
    def allocate(cls, num_layers: int, num_indexer_layers: int, num_slots: int, max_len: int, *, kv_lora_rank: int,
                 rope_dim: int, index_head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> GlmDsaCache:
        """Zero-filled; allocated once at startup, never during a step."""
        def zeros(layers: int, width: int) -> torch.Tensor:
            return torch.zeros((layers, num_slots, max_len, width), dtype=dtype, device=device)

        return cls(zeros(num_layers, kv_lora_rank), zeros(num_layers, rope_dim), zeros(num_indexer_layers, index_head_dim))

    @property
    def num_slots(self) -> int:
        return int(self.latent.shape[1])

    @property
    def max_len(self) -> int:
        return int(self.latent.shape[2])

    def write(self, layer: int, slot_of_row: torch.Tensor, positions: torch.Tensor, latent: torch.Tensor,
              rope_key: torch.Tensor) -> None:
        """Store each row's latent ``[G, C]`` and rotary key ``[G, R]`` at (slot, position)."""
        self.latent[layer][slot_of_row, positions] = latent.to(self.latent.dtype)
        self.rope_keys[layer][slot_of_row, positions] = rope_key.to(self.rope_keys.dtype)

    def write_index(self, index_layer: int, slot_of_row: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor) -> None:
        """Store each row's indexer key ``[G, D]`` at (slot, position)."""
        self.index_keys[index_layer][slot_of_row, positions] = keys.to(self.index_keys.dtype)

    def read_index(self, index_layer: int, slot_ids: torch.Tensor, length: int) -> torch.Tensor:
        """Indexer keys of positions ``0..length-1`` of each slot in ``slot_ids``: ``[len(slot_ids), length, D]``."""
        return self.index_keys[index_layer][slot_ids, :length]

    def gather(self, layer: int, slot_of_row: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents and rotary keys at ``positions [G, k]`` of each row's slot: ``[G, k, C]``, ``[G, k, R]``."""
        flat = slot_of_row[:, None] * self.max_len + positions
        latent = self.latent[layer].flatten(0, 1)[flat]
        rope = self.rope_keys[layer].flatten(0, 1)[flat]
        return latent, rope

    def check_fits(self, max_position: int, num_slots_needed: int | None = None) -> None:
        """Raise a clear error when a position or slot does not fit this cache."""
        if max_position >= self.max_len:
            raise ModelError(f"KV cache holds {self.max_len} positions per slot; position {max_position} does not fit")
        if num_slots_needed is not None and num_slots_needed > self.num_slots:
            raise ModelError(f"KV cache has {self.num_slots} slots; slot {num_slots_needed - 1} does not exist")
