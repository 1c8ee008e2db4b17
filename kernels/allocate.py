"""Kernel 1, budget/allocate: split a tier's draft rows among requests.

Inputs are the current confidences ``c[r, j]`` (chance drafted token j of
request r is accepted given tokens 1..j-1 were). Survival
``a[r, j] = c[r, 1] * ... * c[r, j]`` is non-increasing in j, so taking the
``m`` largest survivals over the whole batch always admits a prefix of each
request's draft. Ties are broken by position, then by request, which keeps the
prefix property when c = 1 and makes every rank pick the same split.

``caps[r]`` bounds request r's verify length (0 for padding slots of the
bucket); ``draft_rows`` is m, the tier's rows minus one anchor row per bucket
slot. When the caps cannot absorb m, the surplus rows stay unused.
"""

from __future__ import annotations

import torch


def survival(confidences: torch.Tensor) -> torch.Tensor:
    """Cumulative acceptance probability of each drafted position, [B, K]."""
    return torch.cumprod(confidences.float(), dim=1)


def _position_major(confidences: torch.Tensor, caps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Survivals flattened position-major (index j * B + r), capped positions at -1, and the [K, B]
    mask of the positions each request's cap allows."""
    positions = torch.arange(confidences.shape[1], device=confidences.device)
    allowed = positions.unsqueeze(1) < caps.unsqueeze(0)  # [K, B]
    # -1 sorts below every real survival (which is >= 0), so capped positions go last. The result takes
    # the layout of the mask, its first operand: [K, B] contiguous, so it flattens without a copy
    surv = torch.where(allowed, survival(confidences).t(), -1.0)
    return surv.reshape(-1), allowed


def allocate_reference(confidences: torch.Tensor, caps: torch.Tensor, draft_rows: int) -> torch.Tensor:
    """Portable reference: a stable sort over position-major order. Returns lengths [B] int64."""
    batch, width = confidences.shape
    # position-major flattening: index = j * B + r, so a stable sort breaks ties by (j, r)
    flat, _ = _position_major(confidences, caps)
    order = torch.sort(-flat, stable=True).indices
    take = min(max(int(draft_rows), 0), int(caps.clamp(min=0, max=width).sum()))
    chosen = order[:take]
    lengths = torch.zeros(batch, dtype=torch.int64, device=confidences.device)
    lengths.scatter_add_(0, chosen % batch, torch.ones_like(chosen))
    return lengths


def make_allocate(width: int):
    """Width-specialised allocate: rank by pairwise comparison over a static [B*K] grid.

    Avoids the data-dependent sort: each element's rank is the number of
    elements that precede it in (survival desc, position, request) order, so
    the whole kernel is fixed-shape tensor arithmetic for a given K (graph
    capture friendly on every backend). ``draft_rows`` may be a 0-dim tensor,
    so a captured graph can take it as an input.
    """

    def allocate(confidences: torch.Tensor, caps: torch.Tensor, draft_rows: int | torch.Tensor) -> torch.Tensor:
        if confidences.shape[1] != width:
            raise ValueError(f"allocate kernel for K={width} got confidences of width {confidences.shape[1]}")
        batch = confidences.shape[0]
        surv, allowed = _position_major(confidences, caps)
        index = torch.arange(batch * width, device=confidences.device)
        # f precedes e when its survival is higher, or equal and f comes first in position-major order
        earlier = index.unsqueeze(0) < index.unsqueeze(1)  # [e, f]: f < e
        before = torch.where(earlier, surv.unsqueeze(0) >= surv.unsqueeze(1), surv.unsqueeze(0) > surv.unsqueeze(1))
        rank = before.sum(dim=1)  # rank[e] = elements ordered before e
        # Allowed survivals (>= 0) all rank before the capped ones (-1), so the first min(room, m) ranks
        # are the m best allowed positions, room being the allowed count: rank < m, restricted to allowed
        # positions, picks them without summing the caps.
        if not isinstance(draft_rows, torch.Tensor):  # a graph input is read on the device; ranks are >= 0,
            draft_rows = max(int(draft_rows), 0)  # so a negative tensor count chooses nothing either
        chosen = (rank < draft_rows).reshape(width, batch) & allowed
        return chosen.sum(dim=0).to(torch.int64)

    allocate.__name__ = f"allocate_k{width}"
    return allocate
