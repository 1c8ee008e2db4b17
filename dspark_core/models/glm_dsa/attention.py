"""Multi-head latent attention (MLA) over the top-k positions the indexer selected.

Per row: ``q_latent = RMSNorm(q_a_proj(x))`` and ``q = q_b_proj(q_latent)``
split per head into a no-rope part and a rope part; ``kv_a_proj_with_mqa(x)``
gives the compressed ``c_kv`` (RMS-normalised, cached) and one shared rotary
key ``k_pe`` (cached). ``kv_b_proj`` maps ``c_kv`` to per-head no-rope keys and
values. Instead of expanding every cached position, the no-rope query is
folded into latent space (``q_nope @ W_uk``) and the attention output is
expanded once per row (``W_uv``): the same maths with far less work per key.

Attention itself reads only the ``k`` selected positions of the row's slot
(gathered from the cache) and masks any selected position after the row's
own, so it is plain torch: gather, einsum, softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark_core.models.glm_dsa.cache import GlmDsaCache
from dspark_core.models.glm_dsa.config import GlmDsaConfig
from dspark_core.models.glm_dsa.indexer import LightningIndexer
from dspark_core.models.glm_dsa.weights import Weights, deinterleave, score_dtype
from dspark_core.models.layers import apply_rope, rms_norm


class LatentAttention(nn.Module):
    """MLA parameters of one layer (HF names under ``self_attn.``) and its sparse attention."""

    def __init__(self, cfg: GlmDsaConfig, weights: Weights, prefix: str, *, with_indexer: bool) -> None:
        super().__init__()
        self.cfg = cfg
        d, h = cfg.hidden_size, cfg.num_heads
        bias = cfg.attention_bias
        self.q_a = weights.param(prefix + "q_a_proj.weight", (cfg.q_lora_rank, d))
        self.q_a_bias = weights.optional(prefix + "q_a_proj.bias", (cfg.q_lora_rank,), bias)
        self.q_a_norm = weights.param(prefix + "q_a_layernorm.weight", (cfg.q_lora_rank,))
        self.q_b = weights.param(prefix + "q_b_proj.weight", (h * cfg.qk_head_dim, cfg.q_lora_rank))
        self.kv_a = weights.param(prefix + "kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, d))
        self.kv_a_bias = weights.optional(prefix + "kv_a_proj_with_mqa.bias", (cfg.kv_lora_rank + cfg.qk_rope_head_dim,), bias)
        self.kv_a_norm = weights.param(prefix + "kv_a_layernorm.weight", (cfg.kv_lora_rank,))
        kv_b = weights.tensor(prefix + "kv_b_proj.weight", (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank))
        kv_b = kv_b.view(h, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        # kv_b_proj split per head: no-rope key map [H, nope, C] and value map [H, v, C].
        self.w_uk = nn.Parameter(kv_b[:, : cfg.qk_nope_head_dim].contiguous(), requires_grad=False)
        self.w_uv = nn.Parameter(kv_b[:, cfg.qk_nope_head_dim :].contiguous(), requires_grad=False)
        self.o_proj = weights.param(prefix + "o_proj.weight", (d, h * cfg.v_head_dim))
        self.o_bias = weights.optional(prefix + "o_proj.bias", (d,), bias)
        self.indexer = LightningIndexer(cfg, weights, prefix + "indexer.") if with_indexer else None
        self.scale = cfg.qk_head_dim**-0.5

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(deinterleave(x) if self.cfg.rope_interleave else x, cos, sin)

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Per-row projections: query latent, per-head no-rope/rope queries, cache latent and rotary key."""
        c = self.cfg
        q_latent = rms_norm(F.linear(h, self.q_a, self.q_a_bias), self.q_a_norm, c.rms_eps)
        q = F.linear(q_latent, self.q_b).view(-1, c.num_heads, c.qk_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        kv = F.linear(h, self.kv_a, self.kv_a_bias)
        latent = rms_norm(kv[:, : c.kv_lora_rank], self.kv_a_norm, c.rms_eps)
        k_pe = self._rope(kv[:, None, c.kv_lora_rank :], cos, sin)[:, 0]
        return q_latent, q_nope, self._rope(q_pe, cos, sin), latent, k_pe

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: GlmDsaCache, layer: int,
               slot_of_row: torch.Tensor, positions: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        """Attention of each row over its ``selected [G, k]`` positions; returns ``[G, d]``."""
        acc = score_dtype(q_nope.dtype)
        latent, rope = cache.gather(layer, slot_of_row, selected)  # [G, k, C], [G, k, R]
        q_lat = torch.einsum("ghn,hnc->ghc", q_nope, self.w_uk)
        logits = torch.einsum("ghc,gkc->ghk", q_lat, latent) + torch.einsum("ghr,gkr->ghk", q_pe, rope)
        hidden = selected > positions[:, None]  # selected only because too few positions were visible
        logits = logits.to(acc).mul(self.scale).masked_fill(hidden[:, None, :], float("-inf"))
        probs = logits.softmax(dim=-1).to(latent.dtype)
        out = torch.einsum("ghk,gkc->ghc", probs, latent)
        out = torch.einsum("ghc,hvc->ghv", out, self.w_uv).reshape(q_nope.shape[0], -1)
        return F.linear(out, self.o_proj, self.o_bias)
