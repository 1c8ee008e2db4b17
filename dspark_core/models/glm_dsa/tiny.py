"""Tiny random GLM-DSA models for tests (no files needed), and a writer for HF-style checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark_core.models.base import TargetConfig
from dspark_core.models.glm_dsa.config import GlmDsaConfig
from dspark_core.models.glm_dsa.model import GlmDsaTarget


def tiny_glm_dsa_config(**overrides) -> GlmDsaConfig:
    """Three layers (dense, MoE, MoE; the middle one reuses the first layer's selection); any field can change."""
    values = dict(
        architecture="glm_moe_dsa", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
        q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, index_n_heads=2,
        index_head_dim=8, index_topk=8, moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, max_position=512,
        mlp_layer_types=("dense", "sparse", "sparse"), indexer_types=("full", "shared", "full"),
        rope_theta=10000.0, rms_eps=1e-5, tie_embeddings=False,
    )
    values.update(overrides)
    return GlmDsaConfig(**values)


def random_glm_dsa_tensors(cfg: GlmDsaConfig, seed: int = 0, scale: float = 0.2, *,
                           stacked_experts: bool = False) -> dict[str, torch.Tensor]:
    """Random weights under the published Hugging Face names (per-expert or stacked expert layout)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    d, h = cfg.hidden_size, cfg.num_heads
    t = {"model.embed_tokens.weight": rnd(cfg.vocab_size, d) * 5, "model.norm.weight": norm(d)}
    if not cfg.tie_embeddings:
        t["lm_head.weight"] = rnd(cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        t[p + "input_layernorm.weight"] = norm(d)
        t[p + "post_attention_layernorm.weight"] = norm(d)
        t[a + "q_a_proj.weight"] = rnd(cfg.q_lora_rank, d)
        t[a + "q_a_layernorm.weight"] = norm(cfg.q_lora_rank)
        t[a + "q_b_proj.weight"] = rnd(h * cfg.qk_head_dim, cfg.q_lora_rank)
        t[a + "kv_a_proj_with_mqa.weight"] = rnd(cfg.kv_lora_rank + cfg.qk_rope_head_dim, d)
        t[a + "kv_a_layernorm.weight"] = norm(cfg.kv_lora_rank)
        t[a + "kv_b_proj.weight"] = rnd(h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        t[a + "o_proj.weight"] = rnd(d, h * cfg.v_head_dim)
        if cfg.attention_bias:
            t[a + "q_a_proj.bias"] = rnd(cfg.q_lora_rank)
            t[a + "kv_a_proj_with_mqa.bias"] = rnd(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            t[a + "o_proj.bias"] = rnd(d)
        if cfg.indexer_types[i] == "full":
            ix = a + "indexer."
            t[ix + "wq_b.weight"] = rnd(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank) * 3
            t[ix + "wk.weight"] = rnd(cfg.index_head_dim, d) * 3
            t[ix + "k_norm.weight"] = norm(cfg.index_head_dim)
            t[ix + "k_norm.bias"] = rnd(cfg.index_head_dim)
            t[ix + "weights_proj.weight"] = rnd(cfg.index_n_heads, d) * 3
        m = p + "mlp."
        if cfg.mlp_layer_types[i] == "dense":
            for name, shape in (("gate_proj", (cfg.intermediate_size, d)), ("up_proj", (cfg.intermediate_size, d)),
                                ("down_proj", (d, cfg.intermediate_size))):
                t[m + name + ".weight"] = rnd(*shape)
            continue
        e, w = cfg.n_routed_experts, cfg.moe_intermediate_size
        t[m + "gate.weight"] = rnd(e, d) * 3
        t[m + "gate.e_score_correction_bias"] = rnd(e)
        gate, up, down = rnd(e, w, d), rnd(e, w, d), rnd(e, d, w)
        if stacked_experts:
            t[m + "experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
            t[m + "experts.down_proj"] = down
        else:
            for k in range(e):
                t[m + f"experts.{k}.gate_proj.weight"] = gate[k]
                t[m + f"experts.{k}.up_proj.weight"] = up[k]
                t[m + f"experts.{k}.down_proj.weight"] = down[k]
        if cfg.n_shared_experts:
            sw = cfg.n_shared_experts * w
            t[m + "shared_experts.gate_proj.weight"] = rnd(sw, d)
            t[m + "shared_experts.up_proj.weight"] = rnd(sw, d)
            t[m + "shared_experts.down_proj.weight"] = rnd(d, sw)
    return t


def random_glm_dsa_target(cfg: GlmDsaConfig | None = None, seed: int = 0, *, dtype: torch.dtype = torch.float32,
                          device: str = "cpu") -> GlmDsaTarget:
    """A :class:`GlmDsaTarget` with random weights."""
    cfg = cfg or tiny_glm_dsa_config()
    return GlmDsaTarget(cfg, random_glm_dsa_tensors(cfg, seed), dtype=dtype, device=device)


def draft_shape_config(cfg: GlmDsaConfig, *, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 8) -> TargetConfig:
    """A Llama-shaped config with the GLM target's width, vocabulary and depth, for ``random_draft``.

    A DSpark draft is a small Llama-style stack of its own; only the hidden size,
    vocabulary and the layer count (for its aux hidden-state ids) must match the target.
    """
    return TargetConfig(architecture="llama", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                        intermediate_size=cfg.intermediate_size or 4 * cfg.hidden_size, num_layers=cfg.num_layers,
                        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, max_position=cfg.max_position,
                        rope_theta=cfg.rope_theta, rms_eps=cfg.rms_eps)


def hf_config_dict(cfg: GlmDsaConfig) -> dict:
    """The ``config.json`` content a Hugging Face GLM-DSA checkpoint of this shape would carry."""
    return {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": cfg.architecture, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_heads, "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim, "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk,
        "moe_intermediate_size": cfg.moe_intermediate_size, "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_group": cfg.n_group, "topk_group": cfg.topk_group, "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor, "scoring_func": cfg.scoring_func,
        "first_k_dense_replace": cfg.mlp_layer_types.index("sparse") if "sparse" in cfg.mlp_layer_types else cfg.num_layers,
        "mlp_layer_types": list(cfg.mlp_layer_types), "indexer_types": list(cfg.indexer_types),
        "max_position_embeddings": cfg.max_position, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_interleave": cfg.rope_interleave, "rms_norm_eps": cfg.rms_eps, "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.attention_bias,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids),
    }


def save_hf_checkpoint(cfg: GlmDsaConfig, tensors: dict[str, torch.Tensor], directory: str | Path, *,
                       shards: int = 2) -> Path:
    """Write ``config.json`` and the weights split over ``shards`` safetensors files."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config_dict(cfg), indent=1), encoding="utf-8")
    names = sorted(tensors)
    for s in range(shards):
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        save_file(part, str(directory / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"))
    return directory
