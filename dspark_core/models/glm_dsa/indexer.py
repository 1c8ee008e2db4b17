"""The lightning indexer of DeepSeek sparse attention: which cached positions each query reads.

For query row ``t`` and cached position ``s`` of the same request the index
score is ``sum_h w[t, h] * relu(q[t, h] . k[s] / sqrt(D))`` with per-head
weights ``w = weights_proj(x) / sqrt(H_index)``. Queries come from the low-rank
query latent (``wq_b``), keys from the normalised hidden state (``wk`` then a
LayerNorm); both carry rotate-half rope on their first ``qk_rope_head_dim``
features. Each row keeps the ``index_topk`` best positions at or before its own
position. Everything is plain torch (einsum, relu, sort): no device kernels.
The published reference also applies a Hadamard rotation and FP8 quantisation
before scoring; the rotation is orthogonal (it preserves the dot products) and
FP8 is a precision choice, so neither appears here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark_core.models.glm_dsa.config import GlmDsaConfig
from dspark_core.models.glm_dsa.static import PerRow
from dspark_core.models.glm_dsa.weights import Weights, rope_on_prefix, score_dtype
from dspark_core.models.row_layout import RowLayout

INDEXER_NORM_EPS = 1e-6


class LightningIndexer(nn.Module):
    """Indexer parameters of one layer (HF names under ``self_attn.indexer.``)."""

    def __init__(self, cfg: GlmDsaConfig, weights: Weights, prefix: str) -> None:
        super().__init__()
        self.heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        d, dim = cfg.hidden_size, cfg.index_head_dim
        self.wq_b = weights.param(prefix + "wq_b.weight", (self.heads * dim, cfg.q_lora_rank))
        self.wk = weights.param(prefix + "wk.weight", (dim, d))
        self.k_norm = weights.param(prefix + "k_norm.weight", (dim,))
        self.k_norm_bias = weights.param(prefix + "k_norm.bias", (dim,))
        self.weights_proj = weights.param(prefix + "weights_proj.weight", (self.heads, d))

    def keys(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The indexer key of each row ``[G, D]`` (what the cache stores)."""
        acc = score_dtype(h.dtype)
        k = F.layer_norm(F.linear(h, self.wk).to(acc), (self.head_dim,), self.k_norm.to(acc), self.k_norm_bias.to(acc),
                         INDEXER_NORM_EPS).to(h.dtype)
        return rope_on_prefix(k[:, None, :], cos, sin, self.rope_dim)[:, 0]

    def scores(self, h: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               keys: torch.Tensor, grouping: RowLayout | PerRow) -> torch.Tensor:
        """Index scores ``[B, R, L]`` of the grouped query rows against ``keys [B, L, D]`` (unmasked).

        Eagerly a group is one request (``RowLayout``: rows padded to ``R_max``);
        in static mode each row is its own group (``PerRow``: ``R = 1``).
        """
        acc = score_dtype(h.dtype)
        q = F.linear(q_latent, self.wq_b).view(-1, self.heads, self.head_dim)
        q = rope_on_prefix(q, cos, sin, self.rope_dim)
        head_weights = F.linear(h, self.weights_proj).to(acc) * self.heads**-0.5  # [G, H]
        logits = torch.einsum("brhd,bld->brhl", grouping.pad(q).to(acc), keys.to(acc)) * self.head_dim**-0.5
        return torch.einsum("brhl,brh->brl", logits.relu(), grouping.pad(head_weights))

    def select(self, h: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               keys: torch.Tensor, grouping: RowLayout | PerRow, visible: torch.Tensor) -> torch.Tensor:
        """Positions ``[G, k]`` each row attends to, ``k = min(index_topk, L)``, best first.

        ``visible [B, R, L]`` marks positions at or before the row's own; they
        always outrank hidden ones, so when fewer than ``k`` are visible the tail
        of a row's selection holds hidden positions (the attention masks them).
        """
        scores = self.scores(h, q_latent, cos, sin, keys, grouping).masked_fill(~visible, float("-inf"))
        return grouping.unpad(top_positions(scores, self.topk))


def top_positions(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``min(k, L)`` best scores along the last axis; ties go to the earlier position.

    The relu in the score makes exact ties common (every head negative gives
    0). ``topk`` breaks them in an unspecified, length-dependent way, which
    would let a verify forward and a one-token decode pick different
    positions; a stable descending sort makes the choice depend only on the
    visible scores.
    """
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., : min(k, scores.shape[-1])]
