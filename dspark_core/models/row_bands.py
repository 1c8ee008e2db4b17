"""Batch-invariant attention in row bands: a request pays for the query rows it has.

Attention runs on a padded ``[requests, R_max]`` view of the packed rows, so every request costs
as much as the one with the most rows. A verify step of the adaptive policy gives a few requests
many rows and the rest one or two (the largest survivals win), and a prefill packs prompts of many
lengths: padding then dominates attention. A band past the first still costs its own attention
calls, a copy of its members' keys and values and the scatter of its output: with the chunked kernel
this replaced, an uneven 32-row float32 step at 16 requests cost 1.14x the even one (48 rows:
1.08-1.10x; benchmarks/split_shapes.py, benchmarks/results/amx/c16-r3/split-shapes.json), and the
flash kernel's calls cost less (benchmarks/attention_kernel.py). Cost tables price steps by their
row count only, so this part of an uneven step is not in them.

A band is a range of padded row indices ``[lo, hi)`` computed only for the requests that have a
row at ``lo`` (the first band: every request, so its keys are read in place). Batch-invariant
attention (:func:`~dspark_core.models.attention.invariant_attention`) computes every query row on its
own, whatever the other rows, so splitting rows into bands leaves every row's bits as they were;
``tests/test_batch_invariance.py`` checks it. The bands are planned once per forward from the row
counts (a small dynamic programme over the distinct counts) and reused by every layer.
"""

from __future__ import annotations

import torch
from attrs import frozen

# A band costs one more round of attention calls per layer (about one padded row per request of
# the batch) and, past the first band, a copy of its requests' keys and values: about as long as
# GATHER_ROWS padded query rows of those requests take on the development CPU (the copy moves
# 1.5 kB per key per request; a padded row only adds arithmetic over keys already being read).
# Checked again for the flash kernel (benchmarks/attention_kernel.py shapes, 100-700 keys): no
# other setting tried (0:0, 1:4, 2:8, 1:24, 4:48, never split) was faster across shapes.
BAND_OVERHEAD_ROWS = 1
GATHER_ROWS = 12


@frozen
class RowBand:
    """Padded rows ``lo .. hi-1`` of the requests in ``members`` (None: every request, keys in place)."""

    lo: int
    hi: int
    members: torch.Tensor | None
    # additive, [len(members) or B, 1, groups * (hi - lo), keys]: a band past the first reads only its
    # members' own keys, up to the last whole chunk any of them sees. The keys past it are masked for
    # every member, and masked keys add exact zeros, so reading fewer leaves the bits as they are
    # while copying less
    mask: torch.Tensor


def plan_cuts(counts: list[int], overhead_rows: int = BAND_OVERHEAD_ROWS, gather_rows: int | None = None) -> list[int]:
    """Band boundaries ``[0, c1, ..., R_max]`` minimising padded rows, plus ``overhead_rows`` times
    the request count per extra band and ``gather_rows`` per request whose keys an extra band copies.
    The first band always covers every request (its keys are read in place)."""
    gather_rows = GATHER_ROWS if gather_rows is None else gather_rows
    requests, top = len(counts), max(counts, default=0)
    points = sorted({c for c in counts if 0 < c < top}) + [top]
    if top == 0:
        return [0]  # no rows: no band
    if len(points) == 1:
        return [0, top]

    def rows_beyond(lo: int) -> int:  # requests that need a band starting at padded row lo
        return requests if lo == 0 else sum(1 for c in counts if c > lo)

    starts = [0] + points[:-1]
    # best[i]: cheapest cost of covering rows 0 .. ends[i] with a band ending there
    best: dict[int, tuple[float, int]] = {}
    for end in points:
        options = []
        for start in starts:
            if start >= end:
                break
            members = rows_beyond(start)
            before = 0.0 if start == 0 else best[start][0] + overhead_rows * requests + gather_rows * members
            options.append((before + members * (end - start), start))
        best[end] = min(options)
    cuts, end = [top], top
    while end != 0:
        end = best[end][1]
        cuts.append(end)
    return cuts[::-1]


def plan_bands(causal: torch.Tensor, counts: list[int], groups: int, dtype: torch.dtype,
               extents: list[int] | None = None) -> list[RowBand]:
    """Bands of a forward: ``causal`` is the boolean ``[B, 1, R_max, L]`` mask, ``counts`` the rows
    of each padded request and ``extents`` the keys each one reads (its last position + 1; None:
    all ``L``); every band's additive mask is built here, once."""
    from dspark_core.models.attention import grouped_mask, invariant_kv_length

    cuts = plan_cuts(counts)
    length = causal.shape[-1]
    bands = []
    for lo, hi in zip(cuts, cuts[1:]):
        if lo == 0:
            bands.append(RowBand(lo, hi, None, grouped_mask(causal[:, :, lo:hi], groups, dtype)))
            continue
        chosen = [i for i, c in enumerate(counts) if c > lo]
        keys = length
        if extents is not None:  # whole key blocks, as invariant attention reads them
            keys = invariant_kv_length(max(extents[i] for i in chosen), length)
        members = torch.tensor(chosen, device=causal.device)
        bands.append(RowBand(lo, hi, members, grouped_mask(causal[members, :, lo:hi, :keys], groups, dtype)))
    return bands


def banded_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bands: list[RowBand]) -> torch.Tensor:
    """:func:`~dspark_core.models.attention.invariant_attention` of padded queries ``q`` ``[B, R, H, d]``
    band by band; returns ``[B, R, H, d]`` (rows outside every band are zeros, never read)."""
    from dspark_core.models.attention import folded_attention, invariant_attention

    if len(bands) == 1 and bands[0].members is None and bands[0].hi == q.shape[1]:
        return folded_attention(q, keys, values, bands[0].mask, invariant_attention)
    out = q.new_zeros(q.shape)
    for band in bands:
        if band.members is None:
            part = folded_attention(q[:, band.lo : band.hi], keys, values, band.mask, invariant_attention)
            out[:, band.lo : band.hi] = part
        else:
            length = band.mask.shape[-1]  # slice, then gather: copy only the keys the band reads
            part = folded_attention(q[band.members, band.lo : band.hi], keys[:, :, :length][band.members],
                                    values[:, :, :length][band.members], band.mask, invariant_attention)
            out[band.members, band.lo : band.hi] = part
    return out
