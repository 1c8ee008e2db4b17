"""Captured execution geometry: draft width K, request buckets and target-row tiers.

A step with ``n`` live requests runs in the smallest request bucket ``Bcap >= n``.
Its verify forward has ``G`` target rows: each request contributes its anchor
row plus the drafted tokens it verifies, so ``Bcap <= G <= Bcap * (K + 1)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from attrs import field, frozen

from dspark_core.errors import ConfigError


def legal_tiers(request_bucket: int, draft_width: int) -> tuple[int, ...]:
    """Every target-row count a bucket can use, from no draft verified to full width."""
    return tuple(range(request_bucket, request_bucket * (draft_width + 1) + 1))


def full_width_rows(request_bucket: int, draft_width: int) -> int:
    """Rows of the full-width tier: every request verifies all K drafted tokens."""
    return request_bucket * (draft_width + 1)


#: Decode steps that may be launched ahead of the host's processing: the one
#: running and, with schedule overlap, the next one built while it runs.
LAUNCHED_STEPS = 2


def kv_reserve(draft_width: int) -> int:
    """Context positions kept free per request beyond its committed tokens.

    Every launched step may write ``draft_width + 1`` rows (the anchor and the
    drafted tokens) into the KV cache before the host sees its results, and up
    to :data:`LAUNCHED_STEPS` steps are in flight, so admission, KV sizing and
    the server's length check all leave this much room.
    """
    return LAUNCHED_STEPS * (draft_width + 1)


def default_request_buckets(max_seqs_per_batch: int, graph_batch_limit: int | None = None) -> tuple[int, ...]:
    """Powers of two up to the batch limit, plus the limit itself."""
    limit = max_seqs_per_batch if graph_batch_limit is None else min(max_seqs_per_batch, graph_batch_limit)
    if limit < 1:
        raise ConfigError(f"request bucket limit must be >= 1, got {limit}")
    buckets = []
    b = 1
    while b < limit:
        buckets.append(b)
        b *= 2
    buckets.append(limit)
    return tuple(buckets)


def _tiers_converter(value: Mapping[int, Iterable[int]]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    return tuple(sorted((int(b), tuple(sorted(set(int(g) for g in rows)))) for b, rows in dict(value).items()))


@frozen
class Geometry:
    """What the graph backend captured. Part of every binding key and table fingerprint."""

    draft_width: int
    request_buckets: tuple[int, ...] = field(converter=lambda v: tuple(sorted(set(int(x) for x in v))))
    # (bucket, rows captured for that bucket) pairs, sorted; a tuple keeps it hashable.
    tiers: tuple[tuple[int, tuple[int, ...]], ...] = field(converter=_tiers_converter)

    def __attrs_post_init__(self) -> None:
        if self.draft_width < 0:
            raise ConfigError(f"draft_width must be >= 0, got {self.draft_width}")
        tier_map = dict(self.tiers)
        for bucket in self.request_buckets:
            rows = tier_map.get(bucket)
            if not rows:
                raise ConfigError(f"request bucket {bucket} has no captured target tiers")
            legal = legal_tiers(bucket, self.draft_width)
            bad = [g for g in rows if g not in legal]
            if bad:
                raise ConfigError(f"request bucket {bucket}: target rows {bad} outside legal range {legal[0]}..{legal[-1]}")
            if full_width_rows(bucket, self.draft_width) not in rows:
                raise ConfigError(f"request bucket {bucket}: the full-width tier {full_width_rows(bucket, self.draft_width)} must be captured")
        extra = sorted(set(tier_map) - set(self.request_buckets))
        if extra:
            raise ConfigError(f"target tiers given for buckets {extra} that are not captured request buckets")

    @classmethod
    def all_tiers(cls, draft_width: int, request_buckets: Iterable[int]) -> Geometry:
        """Geometry capturing every legal tier of every bucket (the default)."""
        buckets = tuple(request_buckets)
        return cls(draft_width, buckets, {b: legal_tiers(b, draft_width) for b in buckets})

    @classmethod
    def bucket_multiples(cls, draft_width: int, request_buckets: Iterable[int]) -> Geometry:
        """Geometry capturing rows Bcap, 2·Bcap, ..., (K+1)·Bcap: one tier per average verify length."""
        buckets = tuple(request_buckets)
        return cls(draft_width, buckets, {b: tuple(b * j for j in range(1, draft_width + 2)) for b in buckets})

    def rows_for(self, request_bucket: int) -> tuple[int, ...]:
        """Captured target-row tiers of ``request_bucket`` (ascending)."""
        return dict(self.tiers)[request_bucket]

    def bucket_for(self, live_requests: int) -> int | None:
        """Smallest captured bucket holding ``live_requests``; None when none is big enough."""
        for bucket in self.request_buckets:
            if bucket >= live_requests:
                return bucket
        return None

    @property
    def max_bucket(self) -> int:
        return self.request_buckets[-1]


#: Shortest KV span a captured backend prepares keys for (``--captured_kv_spans=auto``); the
#: spans double from here while they stay below the cache length.
MIN_KV_SPAN = 256


def kv_spans(value: str, max_len: int, captured: bool) -> tuple[int, ...]:
    """The KV spans below ``max_len`` that keys reading the KV cache are prepared for, besides the
    whole cache, from ``--captured_kv_spans``: ``auto`` (doubling from :data:`MIN_KV_SPAN` on a
    backend that captures device graphs; none on one that runs eagerly, which reads only what a
    step needs anyway), ``off``, or a comma-separated list of positions."""
    value = value.strip()
    if value == "off" or (value == "auto" and not captured):
        return ()
    if value == "auto":
        spans, span = [], MIN_KV_SPAN
        while span < max_len:
            spans.append(span)
            span *= 2
        return tuple(spans)
    try:
        spans = sorted({int(x) for x in value.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--captured_kv_spans={value!r}: give auto, off or comma-separated positive integers") from None
    bad = [s for s in spans if not 0 < s < max_len]
    if not spans or bad:
        raise ConfigError(f"--captured_kv_spans={value!r}: each span must be between 1 and the cache length minus one "
                          f"({max_len - 1}); the whole cache is always prepared")
    return tuple(spans)


def span_for(spans: Iterable[int], kv_length: int) -> int:
    """The shortest span holding ``kv_length`` positions, or 0 (the whole cache) when none does."""
    return min((s for s in spans if s >= kv_length), default=0)
