"""Naive full recompute of a GLM-DSA target (no cache), the exactness reference for tests.

It shares the target's weights but not its code path: keys and values are
expanded per position and head (no latent folding), interleaved rope is done
with complex numbers, the indexer scores the whole sequence at once and the
sparse selection becomes a dense boolean mask, and experts run densely.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from dspark_core.models.glm_dsa.model import GlmDsaTarget
from dspark_core.models.glm_dsa.weights import score_dtype
from dspark_core.models.layers import apply_rope, rms_norm, rope_cos_sin, swiglu


def _interleaved_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rope on consecutive pairs of ``x [T, heads, R]`` as complex rotations."""
    r = x.shape[-1]
    # angles, cos and sin in float32, exactly as the shared rope tables compute them
    inv_freq = 1.0 / (theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
    angles = positions.float()[:, None] * inv_freq[None, :]
    rot = torch.complex(angles.cos().double(), angles.sin().double())[:, None, :]
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], r // 2, 2).contiguous())
    return torch.view_as_real(pairs * rot).reshape(x.shape).to(x.dtype)


def _dense_moe(mlp, x: torch.Tensor) -> torch.Tensor:
    experts, weights = mlp.route(x)
    mix = torch.zeros(x.shape[0], mlp.gate_up.shape[0], dtype=weights.dtype).scatter(1, experts, weights)
    out = sum(swiglu(x, mlp.gate_up[e], mlp.down[e]) * mix[:, e, None].to(x.dtype) for e in range(mlp.gate_up.shape[0]))
    return out if mlp.shared is None else out + mlp.shared(x)


@torch.no_grad()
def full_forward(model: GlmDsaTarget, tokens: Sequence[int], hidden_layers: tuple[int, ...] = (), *,
                 index_topk: int | None = None):
    """Logits ``[T, V]`` (float32) and requested hidden states of one sequence, from scratch.

    ``index_topk`` overrides the model's; a value >= ``len(tokens)`` gives dense attention.
    """
    c = model.config
    ids = torch.tensor(list(tokens), dtype=torch.long, device=model.device)
    t = ids.shape[0]
    pos = torch.arange(t, device=ids.device)
    cos, sin = rope_cos_sin(pos, c.qk_rope_head_dim, c.rope_theta, model.dtype)
    causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
    acc = score_dtype(model.dtype)
    x = model.embed[ids]
    saved = {0: x}
    allowed = causal
    for i, layer in enumerate(model.layers):
        a = layer.attn
        h = rms_norm(x, layer.input_norm, c.rms_eps)
        q_latent = rms_norm(F.linear(h, a.q_a, a.q_a_bias), a.q_a_norm, c.rms_eps)
        q = F.linear(q_latent, a.q_b).view(t, c.num_heads, c.qk_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        kv = F.linear(h, a.kv_a, a.kv_a_bias)
        latent = rms_norm(kv[:, : c.kv_lora_rank], a.kv_a_norm, c.rms_eps)
        k_pe = kv[:, None, c.kv_lora_rank :]
        if c.rope_interleave:
            q_pe, k_pe = _interleaved_rope(q_pe, pos, c.rope_theta), _interleaved_rope(k_pe, pos, c.rope_theta)
        else:
            q_pe, k_pe = apply_rope(q_pe, cos, sin), apply_rope(k_pe, cos, sin)
        keys = torch.cat([torch.einsum("tc,hnc->thn", latent, a.w_uk), k_pe.expand(t, c.num_heads, -1)], dim=-1)
        values = torch.einsum("tc,hvc->thv", latent, a.w_uv)
        queries = torch.cat([q_nope, q_pe], dim=-1)
        if a.indexer is not None:
            ix = a.indexer
            iq = apply_rope_prefix(F.linear(q_latent, ix.wq_b).view(t, ix.heads, ix.head_dim), cos, sin, ix.rope_dim)
            ik = F.layer_norm(F.linear(h, ix.wk).to(acc), (ix.head_dim,), ix.k_norm.to(acc), ix.k_norm_bias.to(acc), 1e-6)
            ik = apply_rope_prefix(ik.to(model.dtype)[:, None, :], cos, sin, ix.rope_dim)[:, 0]
            w = F.linear(h, ix.weights_proj).to(acc) / ix.heads**0.5
            score = torch.einsum("thd,sd->ths", iq.to(acc), ik.to(acc)).div(ix.head_dim**0.5).relu()
            score = torch.einsum("ths,th->ts", score, w).masked_fill(~causal, float("-inf"))
            top = score.sort(dim=-1, descending=True, stable=True).indices[:, : min(index_topk or ix.topk, t)]
            allowed = torch.zeros_like(causal).scatter(1, top, True) & causal
        logits = torch.einsum("thd,shd->hts", queries.to(acc), keys.to(acc)) / c.qk_head_dim**0.5
        probs = logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out = torch.einsum("hts,shv->thv", probs, values.to(acc)).reshape(t, -1).to(x.dtype)
        x = x + F.linear(out, a.o_proj, a.o_bias)
        h = rms_norm(x, layer.post_norm, c.rms_eps)
        x = x + (_dense_moe(layer.mlp, h) if hasattr(layer.mlp, "route") else layer.mlp(h))
        saved[i + 1] = x
    hidden = torch.cat([saved[i] for i in hidden_layers], dim=-1) if hidden_layers else None
    return model.logits_from_hidden(x), hidden


def apply_rope_prefix(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Rotate-half rope on the first ``rope_dim`` features of ``x [T, heads, D]``."""
    return torch.cat([apply_rope(x[..., :rope_dim], cos, sin), x[..., rope_dim:]], dim=-1)
