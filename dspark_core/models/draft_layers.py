"""Parameter containers of the draft's decoder layers (Qwen3-style, with q/k norms).

Attribute names mirror the speculators checkpoint (``layers.N.self_attn.q_proj``
...); the attention maths lives in :mod:`dspark_core.models.dspark_draft`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark_core.models.draft_config import DraftConfig
from dspark_core.models.layers import linear, rms_norm


def project(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` through :func:`dspark_core.models.layers.linear` (the packed CPU path when not training)."""
    return linear(x, layer.weight, layer.bias)


class RMSNorm(nn.Module):
    """RMSNorm with a learnable scale named ``weight``."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class DraftAttention(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_eps)


class DraftMLP(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(self.down_proj, F.silu(project(self.gate_proj, x)) * project(self.up_proj, x))


class DraftLayer(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.self_attn = DraftAttention(c)
        self.mlp = DraftMLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_eps)
