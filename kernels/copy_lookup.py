"""Copy proposals (prompt lookup): what followed the latest earlier occurrence of the last n tokens.

A small target repeats itself and its prompt: names, code, list markup. Where
the request's last ``order`` tokens (the anchor included) already occurred
earlier in its prompt or output, the tokens that followed that occurrence are
a strong guess for what comes next, stronger than a one-layer draft's. This
kernel finds them for a batch of slots, inside the proposal key: a masked
compare over each slot's token history, the latest match by a max, and a
gather of up to K following tokens. Fixed shapes, no host read, so it is
captured with the draft and replays identically on every rank.

Only tokens already committed are copied (a continuation never runs past the
anchor), so the lookup needs nothing the engine does not know.
"""

from __future__ import annotations

import torch


def copy_lookup(history: torch.Tensor, slots: torch.Tensor, seq_len: torch.Tensor, order: int,
                width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copied tokens ``[B, width]`` and how many of them are real ``[B]`` for each slot.

    ``history`` [S, L] holds each slot's tokens by position and ``seq_len`` [S]
    how many are committed, the last one being the anchor. For slot s with
    n = seq_len[s], the key is history[s, n-order : n]; the latest end j < n-1
    of an earlier occurrence gives the tokens history[s, j+1 : min(j+1+width, n)].
    Slots without an occurrence (or shorter than order + 1) get length 0; cells
    past a slot's length are 0.
    """
    rows = history[slots]  # [B, L]
    n = seq_len[slots].unsqueeze(1)  # [B, 1]
    length = rows.shape[1]
    position = torch.arange(length, device=rows.device).unsqueeze(0)  # [1, L]
    # an occurrence ends at j with order - 1 <= j <= n - 2 (strictly before the key itself)
    match = (position >= order - 1) & (position <= n - 2)
    for back in range(order):
        key = rows.gather(1, (n - 1 - back).clamp(min=0, max=length - 1))  # [B, 1]
        earlier = rows if back == 0 else torch.nn.functional.pad(rows[:, : length - back], (back, 0))
        match &= earlier == key
    last = torch.where(match, position, -1).amax(dim=1, keepdim=True)  # [B, 1], -1: none
    count = torch.where(last >= 0, (n - 1 - last).clamp(max=width), 0)  # [B, 1]
    column = torch.arange(width, device=rows.device).unsqueeze(0)
    tokens = rows.gather(1, (last + 1 + column).clamp(min=0, max=length - 1))
    return torch.where(column < count, tokens, 0), count.squeeze(1)


def copy_lookup_reference(tokens: list[int], order: int, width: int) -> list[int]:
    """Loop reference for one sequence (its last token is the anchor): the copied tokens."""
    p = len(tokens) - 1
    if p < order:
        return []
    key = tokens[p - order + 1 : p + 1]
    for j in range(p - 1, order - 2, -1):
        if tokens[j - order + 1 : j + 1] == key:
            return tokens[j + 1 : min(j + 1 + width, p + 1)]
    return []
