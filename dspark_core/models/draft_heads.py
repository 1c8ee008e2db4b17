"""The DSpark heads: Markov logit bias over the previous block token, and confidence.

Parameter names follow the speculators checkpoint (``markov_w1``, ``markov_w2``,
``gate_proj``, ``joint_proj``, ``proj``) so state dicts load without renaming.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark_core.models.layers import linear


class MarkovHead(nn.Module):
    """Low-rank bias ``W2(f(W1[prev]))`` added to the draft logits of each block position.

    ``W1`` embeds the previous token (target vocabulary) into ``rank`` dims,
    ``W2`` maps back to the draft vocabulary. ``gated`` scales the embedding by
    a sigmoid gate computed from [hidden; embedding]; ``rnn`` carries a state
    across the block positions.
    """

    def __init__(self, target_vocab: int, draft_vocab: int, rank: int, hidden_size: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.rank = rank
        self.markov_w1 = nn.Embedding(target_vocab, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def initial_state(self, n: int, like: torch.Tensor) -> torch.Tensor | None:
        """Recurrent state before the first block position (rnn only)."""
        return like.new_zeros(n, self.rank) if self.kind == "rnn" else None

    def step(self, prev_emb: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Bias ``[..., draft_vocab]`` for one position and the next recurrent state."""
        if self.kind == "vanilla":
            return linear(prev_emb, self.markov_w2.weight), state
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], dim=-1)))
            return linear(gate * prev_emb, self.markov_w2.weight), state
        gate_raw, cand_raw, out_raw = self.joint_proj(torch.cat([state, prev_emb, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        state = gate * state + (1.0 - gate) * torch.tanh(cand_raw)
        return linear(torch.tanh(out_raw), self.markov_w2.weight), state

    def block_bias(self, prev_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced bias for whole blocks: ``prev_ids [N, S]``, ``hidden [N, S, d]`` -> ``[N, S, V_draft]``."""
        prev_emb = self.markov_w1(prev_ids)
        if self.kind != "rnn":  # no recurrence: every position at once
            return self.step(prev_emb, hidden, None)[0]
        state = self.initial_state(prev_ids.shape[0], prev_emb)
        out = []
        for s in range(prev_ids.shape[1]):
            bias, state = self.step(prev_emb[:, s], hidden[:, s], state)
            out.append(bias)
        return torch.stack(out, dim=1)


class ConfidenceHead(nn.Module):
    """Linear map of [hidden; W1[prev]] (or hidden alone) to one acceptance logit per position."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)
