"""Exactness references: naive full-recompute forward and target-only greedy decoding.

Everything speculative must reproduce :func:`greedy_generate` token for token.
:func:`full_forward` shares the weights of a :class:`LlamaTarget` but not its
attention code path (no cache, explicit softmax), so comparing the two tests
the cache and the packed-row bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from dspark_core.models.base import make_forward_batch
from dspark_core.models.llama import LlamaTarget


@torch.no_grad()
def full_forward(model: LlamaTarget, tokens: Sequence[int], hidden_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits ``[T, V]`` (float32) of one sequence, recomputed from scratch without a cache."""
    c = model.config
    ids = torch.tensor(list(tokens), dtype=torch.long, device=model.device)
    t = ids.shape[0]
    cos, sin = model.rope_tables(torch.arange(t, device=ids.device))
    causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
    groups = c.num_heads // c.num_kv_heads
    x = model.embed[ids]
    saved = {0: x}
    for i, layer in enumerate(model.layers):
        q, kv_rows = model._qkv(layer, x, cos, sin)
        k, v = kv_rows[:, 0], kv_rows[:, 1]
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) / c.head_dim**0.5
        scores = scores.masked_fill(~causal, float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).reshape(t, -1).to(x.dtype)
        x = x + F.linear(attn, layer.o_proj)
        x = model._mlp(layer, x)
        saved[i + 1] = x
    hidden = torch.cat([saved[i] for i in hidden_layers], dim=-1) if hidden_layers else None
    return model.logits_from_hidden(x), hidden


@torch.no_grad()
def greedy_generate(model: LlamaTarget, prompt: Sequence[int], max_tokens: int, *, eos_token_ids: Sequence[int] | None = None, cache=None, slot: int = 0) -> list[int]:
    """Target-only greedy decoding: one prefill, then one token per forward.

    Stops after ``max_tokens`` new tokens or right after emitting an EOS token
    (the EOS token is included in the result). Uses ``cache`` slot ``slot`` if
    given, else a private one-slot cache sized for the prompt plus the output.
    """
    if not prompt:
        raise ValueError("greedy_generate needs a non-empty prompt")
    eos = set(model.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
    if cache is None:
        cache = model.new_cache(1, len(prompt) + max_tokens)
        slot = 0
    out: list[int] = []
    step_tokens, start = list(prompt), 0
    while len(out) < max_tokens:
        batch = make_forward_batch([step_tokens], [start], [slot], device=model.device)
        logits = model.forward(batch, cache).logits
        token = int(logits[-1].argmax().item())
        out.append(token)
        if token in eos:
            break
        start += len(step_tokens)
        step_tokens = [token]
    return out


@torch.no_grad()
def greedy_generate_batch(model: LlamaTarget, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Greedy decoding of several prompts together (one packed forward per step).

    Ignores EOS (every request produces exactly ``max_tokens``); meant for
    throughput measurement and batch-versus-single equivalence tests.
    """
    n = len(prompts)
    cache = model.new_cache(n, max(len(p) for p in prompts) + max_tokens)
    outs: list[list[int]] = [[] for _ in range(n)]
    step = [list(p) for p in prompts]
    starts = [0] * n
    for _ in range(max_tokens):
        batch = make_forward_batch(step, starts, list(range(n)), device=model.device)
        logits = model.forward(batch, cache).logits
        last_rows = batch.row_offsets[1:] - 1
        tokens = logits[last_rows].argmax(-1).tolist()
        for b in range(n):
            outs[b].append(tokens[b])
            starts[b] += len(step[b])
            step[b] = [tokens[b]]
    return outs
