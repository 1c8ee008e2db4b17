"""Copy proposals (prompt lookup): what followed the latest earlier occurrence of the last n tokens.

A small target repeats itself and its prompt: names, code, list markup. Where
the request's last n tokens (the anchor included) already occurred earlier in
its prompt or output, the tokens that followed that occurrence are a strong
guess for what comes next, stronger than a one-layer draft's. This kernel
finds them for a batch of slots, inside the proposal key: a masked compare
over each slot's token history, the latest match by a max, and a gather of K
following tokens. Fixed shapes, no host read, so it is captured with the
draft and replays identically on every rank. On a device every op is a kernel
of its own, so the orders share their gathers and their final reduction
(46 kernels at orders 6..2, against 107 with one reduction and key gather
per order).

Several orders are tried, longest first: a longer match is rarer but more
often right, and where it exists its latest occurrence can differ from the
shorter one's. The copy repeats with the period of the match when it reaches
the anchor (``a b c a b`` with anchor ``b`` proposes ``c a b c a ...``), so
only tokens already committed are ever copied.
"""

from __future__ import annotations

import torch


def copy_lookup(history: torch.Tensor, slots: torch.Tensor, seq_len: torch.Tensor, orders: tuple[int, ...],
                width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copied tokens ``[B, width]``, how many are real ``[B]`` and which order matched ``[B]``.

    ``history`` [S, L] holds each slot's tokens by position and ``seq_len`` [S]
    how many are committed, the last one being the anchor. ``orders`` are tried
    longest first (descending). For slot s with n = seq_len[s] and the first
    order o whose key history[s, n-o : n] occurred before, ending at j < n-1
    (the latest such j), the copy is history[s, j+1 + (i mod (n-1-j))] for
    i < width. Slots without a match get length 0, order index len(orders) and
    zeros.
    """
    rows = history[slots]  # [B, L]
    n = seq_len[slots].unsqueeze(1)  # [B, 1]
    length, deepest = rows.shape[1], max(orders)
    position = torch.arange(length, device=rows.device)  # [L]
    # the key tokens, keys[:, back] = the token `back` before the anchor, in one gather
    keys = rows.gather(1, (n - 1 - position[:deepest]).clamp(min=0, max=length - 1))  # [B, deepest]
    # the rows padded on the left with a value no token has: the rows shifted by `back` are a view of it
    padded = torch.nn.functional.pad(rows, (deepest - 1, 0), value=-1)
    # an occurrence of the last (back + 1) tokens ends at j <= n - 2 (strictly before the key itself)
    match = position <= n - 2  # [B, L]
    ends: dict[int, torch.Tensor] = {}  # order -> where an occurrence of the last `order` tokens ends
    for back in range(deepest):
        earlier = padded[:, deepest - 1 - back : deepest - 1 - back + length]  # rows[:, j - back], a view
        match = match & (earlier == keys[:, back : back + 1])
        ends[back + 1] = match
    # the latest end of every order at once (one reduction, not one per order), longest first; -1: none
    latest = torch.where(torch.stack([ends[order] for order in orders], dim=1), position.to(torch.int32), -1)
    latest = latest.amax(dim=2).long()  # [B, len(orders)]
    hit = latest >= 0
    first = hit.to(torch.int8).argmax(dim=1, keepdim=True)  # the first (longest) order that matched
    any_hit = hit.any(dim=1, keepdim=True)
    last = torch.where(any_hit, latest.gather(1, first), -1)  # [B, 1]
    chosen = torch.where(any_hit, first, len(orders))
    found = last >= 0
    period = (n - 1 - last).clamp(min=1)
    column = torch.arange(width, device=rows.device).unsqueeze(0)
    tokens = rows.gather(1, (last + 1 + column % period).clamp(min=0, max=length - 1))
    return torch.where(found, tokens, 0), torch.where(found, width, 0).squeeze(1), chosen.squeeze(1)


def copy_lookup_reference(tokens: list[int], orders: tuple[int, ...], width: int) -> tuple[list[int], int | None]:
    """Loop reference for one sequence (its last token is the anchor): the copied tokens and the
    order that matched (None: no match)."""
    p = len(tokens) - 1
    for order in orders:
        if p < order:
            continue
        key = tokens[p - order + 1 : p + 1]
        for j in range(p - 1, order - 2, -1):
            if tokens[j - order + 1 : j + 1] == key:
                period = p - j
                return [tokens[j + 1 + i % period] for i in range(width)], order
    return [], None
