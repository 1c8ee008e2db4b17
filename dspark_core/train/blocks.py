"""Differentiable teacher-forced DSpark blocks over cached target features.

:meth:`DSparkDraft.forward_block` reads the draft's context cache, which
:meth:`~DSparkDraft.extend_context` fills without gradients — fine at serving
time, but training must also update ``fc``, ``hidden_norm`` and the K/V
projections that see the injected context. This module recomputes the same
maths with gradients on padded ``[B, L]`` sequences, many anchors per
sequence at once (each block attends to context positions ``< anchor`` and to
its own block, non-causally), using the draft's own parameters. A unit test
checks it against ``forward_block``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark_core.models.dspark_draft import BlockOutput, DSparkDraft
from dspark_core.models.layers import apply_rope, rope_cos_sin


def _rope(x: torch.Tensor, positions: torch.Tensor, draft: DSparkDraft) -> torch.Tensor:
    """Rotary on ``x [B, R, heads, hd]`` at ``positions [B, R]``."""
    b, r = positions.shape
    cos, sin = rope_cos_sin(positions.reshape(-1), draft.config.head_dim, draft.config.rope_theta, x.dtype)
    return apply_rope(x.reshape(b * r, *x.shape[2:]), cos, sin).view_as(x)


def train_blocks(draft: DSparkDraft, hidden: torch.Tensor, anchors: torch.Tensor, prev_tokens: torch.Tensor,
                 head: torch.Tensor | None = None) -> BlockOutput:
    """Block outputs for ``A`` anchors in each of ``B`` sequences.

    ``hidden [B, L, n_aux*d]`` are the target features of each (padded)
    sequence; ``anchors [B, A]`` the anchor positions; ``prev_tokens [B, A, K]``
    the true tokens at ``p .. p+K-1`` (column 0 is the anchor token). ``head``
    optionally replaces the (frozen) LM head, e.g. a bfloat16 copy: the head
    product dominates training cost and bf16 halves it on CPUs with AVX512-BF16;
    the logits are returned in float32 either way. Returns
    logits ``[B, A, K, V_draft]``, confidence logits ``[B, A, K]`` and hidden.
    """
    c = draft.config
    b, length, _ = hidden.shape
    a, s, k_out = anchors.shape[1], c.block_size, c.num_speculative_tokens
    dt = draft.fc.weight.dtype
    ctx = draft.hidden_norm(draft.fc(hidden.to(dt)))  # [B, L, d]
    ctx_pos = torch.arange(length, device=hidden.device).expand(b, length)
    ids = torch.full((b, a, s), c.mask_token_id, dtype=torch.long, device=hidden.device)
    ids[:, :, 0] = prev_tokens[:, :, 0]
    x = draft._embed[ids].to(dt).reshape(b, a * s, -1)
    blk_pos = (anchors[:, :, None] + torch.arange(s, device=hidden.device)).reshape(b, a * s)
    # query (anchor i, slot) sees context keys j < anchor_i and every slot of its own block
    sees_ctx = ctx_pos[:, None, :] < anchors.repeat_interleave(s, dim=1)[:, :, None]  # [B, A*S, L]
    group = torch.arange(a, device=hidden.device).repeat_interleave(s)
    same_block = (group[:, None] == group[None, :]).expand(b, a * s, a * s)
    mask = torch.cat([sees_ctx, same_block], dim=2)[:, None]
    for layer in draft.layers:
        att = layer.self_attn
        ck = _rope(att.k_norm(att.k_proj(ctx).view(b, length, c.num_kv_heads, c.head_dim)), ctx_pos, draft)
        cv = att.v_proj(ctx).view(b, length, c.num_kv_heads, c.head_dim)
        h = layer.input_layernorm(x)
        q = _rope(att.q_norm(att.q_proj(h).view(b, a * s, c.num_heads, c.head_dim)), blk_pos, draft)
        k = _rope(att.k_norm(att.k_proj(h).view(b, a * s, c.num_kv_heads, c.head_dim)), blk_pos, draft)
        v = att.v_proj(h).view(b, a * s, c.num_kv_heads, c.head_dim)
        keys = torch.cat([ck, k], dim=1).transpose(1, 2)
        values = torch.cat([cv, v], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                             enable_gqa=c.num_heads != c.num_kv_heads)
        x = x + att.o_proj(out.transpose(1, 2).reshape(b, a * s, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    first = c.first_proposal_slot
    hid = draft.norm(x).view(b, a, s, -1)[:, :, first : first + k_out]
    w = draft._head_weight() if head is None else head
    logits = F.linear(hid.to(w.dtype), w).float()
    prev_emb = None
    if draft.markov_head is not None:
        prev_emb = draft.markov_head.markov_w1(prev_tokens)
        flat = draft.markov_head.block_bias(prev_tokens.reshape(b * a, k_out), hid.reshape(b * a, k_out, -1))
        logits = logits + flat.view(b, a, k_out, -1).float()
    conf = draft._confidence_logit(hid, prev_emb) if draft.confidence_head is not None else None
    return BlockOutput(logits, conf, hid)
