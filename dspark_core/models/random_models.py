"""Small random models for tests and benchmarks (no files needed)."""

from __future__ import annotations

import torch

from dspark_core.models.base import TargetConfig
from dspark_core.models.llama import LlamaTarget


def tiny_target_config(**overrides) -> TargetConfig:
    """A few-layer Llama config; any field can be overridden."""
    values = dict(
        architecture="llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=3,
        num_heads=4, num_kv_heads=2, head_dim=8, max_position=256, rope_theta=10000.0,
        rms_eps=1e-5, tie_embeddings=True, eos_token_ids=(),
    )
    values.update(overrides)
    return TargetConfig(**values)


def random_target_tensors(cfg: TargetConfig, seed: int = 0, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """Random weights with Hugging Face names, as a loader would produce them."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    d, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    t = {"model.embed_tokens.weight": rnd(cfg.vocab_size, d) * 5, "model.norm.weight": norm(d)}
    if not cfg.tie_embeddings:
        t["lm_head.weight"] = rnd(cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(d)
        t[p + "post_attention_layernorm.weight"] = norm(d)
        for name, rows in (("q", cfg.num_heads * hd), ("k", cfg.num_kv_heads * hd), ("v", cfg.num_kv_heads * hd)):
            t[p + f"self_attn.{name}_proj.weight"] = rnd(rows, d)
            if cfg.qkv_bias:
                t[p + f"self_attn.{name}_proj.bias"] = rnd(rows)
        t[p + "self_attn.o_proj.weight"] = rnd(d, cfg.num_heads * hd)
        if cfg.qk_norm:
            t[p + "self_attn.q_norm.weight"] = norm(hd)
            t[p + "self_attn.k_norm.weight"] = norm(hd)
        t[p + "mlp.gate_proj.weight"] = rnd(inter, d)
        t[p + "mlp.up_proj.weight"] = rnd(inter, d)
        t[p + "mlp.down_proj.weight"] = rnd(d, inter)
    return t


def random_target(cfg: TargetConfig | None = None, seed: int = 0, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> LlamaTarget:
    """A :class:`LlamaTarget` with random weights."""
    cfg = cfg or tiny_target_config()
    return LlamaTarget(cfg, random_target_tensors(cfg, seed), dtype=dtype, device=device)
