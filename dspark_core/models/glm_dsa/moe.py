"""Feed-forward blocks of a GLM-DSA layer: a dense SwiGLU, or routed experts plus shared experts.

Routing follows the published DeepSeek-V3 / GLM gate (``topk_method`` "noaux_tc"):
scores are ``sigmoid`` (or ``softmax``) of the router logits; the *choice* adds
``e_score_correction_bias``, keeps the ``topk_group`` best expert groups (a
group is ranked by the sum of its two best scores) and then the
``num_experts_per_tok`` best experts; the *weights* are the unbiased scores of
the chosen experts, renormalised to sum to one when ``norm_topk_prob`` and
multiplied by ``routed_scaling_factor``. The shared experts (one SwiGLU of
width ``n_shared_experts * moe_intermediate_size``) see every row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark_core.models.glm_dsa.config import GlmDsaConfig
from dspark_core.models.glm_dsa.weights import Weights, score_dtype
from dspark_core.models.layers import swiglu


def _fused_gate_up(weights: Weights, prefix: str, width: int, d: int) -> torch.Tensor:
    return torch.cat([weights.tensor(prefix + "gate_proj.weight", (width, d)), weights.tensor(prefix + "up_proj.weight", (width, d))])


class DenseMlp(nn.Module):
    """SwiGLU with HF names ``gate_proj`` / ``up_proj`` / ``down_proj`` under ``prefix``."""

    def __init__(self, weights: Weights, prefix: str, width: int, d: int) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(_fused_gate_up(weights, prefix, width, d), requires_grad=False)
        self.down = weights.param(prefix + "down_proj.weight", (d, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.gate_up, self.down)


class MoeBlock(nn.Module):
    """Router + routed experts + shared experts of one layer (HF names under ``mlp.``).

    Experts load from per-expert weights (``experts.{e}.gate_proj.weight`` ...)
    or from the stacked layout (``experts.gate_up_proj`` ``[E, 2I, d]``,
    ``experts.down_proj`` ``[E, d, I]``).
    """

    def __init__(self, cfg: GlmDsaConfig, weights: Weights, prefix: str) -> None:
        super().__init__()
        self.cfg = cfg
        d, e, width = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        acc = score_dtype(weights.dtype)
        self.router = weights.param(prefix + "gate.weight", (e, d), acc)
        bias_name = prefix + "gate.e_score_correction_bias"
        bias = weights.tensor(bias_name, (e,), acc) if weights.has(bias_name) else torch.zeros(e, dtype=acc, device=weights.device)
        self.choice_bias = nn.Parameter(bias, requires_grad=False)
        if weights.has(prefix + "experts.gate_up_proj"):
            gate_up = weights.tensor(prefix + "experts.gate_up_proj", (e, 2 * width, d))
            down = weights.tensor(prefix + "experts.down_proj", (e, d, width))
        else:
            gate_up = torch.stack([_fused_gate_up(weights, f"{prefix}experts.{i}.", width, d) for i in range(e)])
            down = torch.stack([weights.tensor(f"{prefix}experts.{i}.down_proj.weight", (d, width)) for i in range(e)])
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)
        self.shared = DenseMlp(weights, prefix + "shared_experts.", cfg.n_shared_experts * width, d) if cfg.n_shared_experts else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Chosen experts ``[G, k]`` and their mixing weights ``[G, k]`` (score precision)."""
        c = self.cfg
        logits = F.linear(x.to(self.router.dtype), self.router)
        scores = logits.sigmoid() if c.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + self.choice_bias
        if c.n_group > 1:
            grouped = choice.view(x.shape[0], c.n_group, -1)
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(c.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(x.shape[0], -1)
        experts = choice.topk(c.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, experts)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * c.routed_scaling_factor

    def forward(self, x: torch.Tensor, *, dense: bool = False) -> torch.Tensor:
        """Routed plus shared experts. ``dense`` runs every expert (static shapes, for graph capture)."""
        experts, weights = self.route(x)
        out = self._all_experts(x, experts, weights) if dense else self._chosen_experts(x, experts, weights)
        return out if self.shared is None else out + self.shared(x)

    def _chosen_experts(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        # Only the experts some row chose run (ascending id: a row's sum order never depends on the batch).
        for e in torch.unique(experts).tolist():
            rows, which = (experts == e).nonzero(as_tuple=True)
            y = swiglu(x[rows], self.gate_up[e], self.down[e])
            out.index_add_(0, rows, y * weights[rows, which, None].to(x.dtype))
        return out

    def _all_experts(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        mix = torch.zeros(x.shape[0], self.gate_up.shape[0], dtype=weights.dtype, device=x.device)
        mix = mix.scatter(1, experts, weights).to(x.dtype)  # [G, E], zero where not chosen
        gate, up = torch.einsum("gd,efd->egf", x, self.gate_up).chunk(2, dim=-1)
        y = torch.einsum("egi,edi->egd", F.silu(gate) * up, self.down)
        return torch.einsum("egd,ge->gd", y, mix)
