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


def random_target(cfg: TargetConfig | None = None, seed: int = 0, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                  batch_invariant: bool | None = None) -> LlamaTarget:
    """A :class:`LlamaTarget` with random weights (``batch_invariant``: as :class:`LlamaTarget` takes it)."""
    cfg = cfg or tiny_target_config()
    return LlamaTarget(cfg, random_target_tensors(cfg, seed), dtype=dtype, device=device, batch_invariant=batch_invariant)


def random_draft(
    target_config: TargetConfig,
    *,
    seed: int = 0,
    num_layers: int = 1,
    block_size: int = 4,
    aux_layer_ids: tuple[int, ...] | None = None,
    draft_vocab_size: int | None = None,
    markov_rank: int = 8,
    markov_head_type: str = "vanilla",
    sample_from_anchor: bool = True,
    **overrides,
):
    """A randomly initialised DSpark draft shaped for ``target_config`` (not yet bound).

    With ``draft_vocab_size`` below the target vocabulary the draft keeps a
    random sorted subset of target ids (d2t offsets / t2d mask filled in).
    """
    from dspark_core.models.draft_config import DraftConfig
    from dspark_core.models.dspark_draft import DSparkDraft

    t = target_config
    n = t.num_layers
    values = dict(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_layers=num_layers,
        num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
        target_vocab_size=t.vocab_size, draft_vocab_size=draft_vocab_size or t.vocab_size,
        block_size=block_size, aux_layer_ids=aux_layer_ids or tuple(sorted({1, max(1, n // 2), n})),
        mask_token_id=t.vocab_size - 1, target_hidden_size=t.hidden_size, rms_eps=t.rms_eps,
        rope_theta=t.rope_theta, max_position=t.max_position, markov_rank=markov_rank,
        markov_head_type=markov_head_type, confidence_head_with_markov=markov_rank > 0,
        sample_from_anchor=sample_from_anchor,
    )
    values.update(overrides)
    torch.manual_seed(seed)
    draft = DSparkDraft(DraftConfig(**values))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        if draft.d2t is not None:
            keep = torch.randperm(t.vocab_size, generator=g)[: draft.config.draft_vocab_size].sort().values
            draft.d2t.copy_(keep - torch.arange(keep.numel()))
            draft.t2d.zero_()
            draft.t2d[keep] = True
    return draft
