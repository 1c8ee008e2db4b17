"""Per-tier step costs from the installed table, looked up once per (bucket, KV interval).

The table prices full buckets: calibration times steps whose every bucket entry is live and
whose every tier row is verified. A forward that leaves out the rows no live request uses (every
eager step since 2026-12-07; captured ones keep static shapes) costs less than that at partial
occupancy, by about the same seconds on every tier: priced as padded, a narrow tier (or no draft)
looks relatively dearer than it is. :meth:`TierCosts.for_live` prices such a step by the rows it
forwards (docs/cost-tables.md, "Steps below full occupancy").
"""

from __future__ import annotations

import numpy as np

from dspark_core.geometry import Geometry, full_width_rows


class TierCosts:
    """Caches the cost vector over a bucket's captured tiers so a step pays one dict lookup."""

    def __init__(self, geometry: Geometry) -> None:
        self.geometry = geometry
        self.table = None
        self._cache: dict[tuple[int, int], np.ndarray | None] = {}
        self._live_cache: dict[tuple[int, int, int, int], tuple[np.ndarray | None, float | None]] = {}

    def install(self, table) -> None:
        """Install an immutable table (None removes it: every step then uses full width)."""
        self.table = table
        self._cache.clear()
        self._live_cache.clear()

    def for_step(self, bucket: int, kv_length: int) -> np.ndarray | None:
        """Seconds per captured tier of ``bucket`` (NaN: tier not covered); None without a profile."""
        if self.table is None:
            return None
        fit = self.table.fit_for(kv_length)
        if fit is None:
            return None
        key = (bucket, self.table.fits.index(fit))
        if key not in self._cache:
            costs = [fit.cost.predict_seconds(bucket, rows) for rows in self.geometry.rows_for(bucket)]
            values = np.array([np.nan if c is None else c for c in costs], dtype=np.float64)
            off = self.draft_off_for_step(bucket, kv_length)
            if off is not None and np.isfinite(values).any():
                # A drafted step runs at least the draft-off step's rows plus a proposal, so it never
                # costs less. A fit can still price the cheapest drafted tier below draft-off (the
                # two are a few percent apart and fitted from different points): a policy then sees
                # a proposal as free and may draft on every step only to verify nothing drafted
                # (benchmarks/results/tier-floor). Such a drafted curve is lifted to start at the
                # draft-off price, its steps between tiers kept as fitted.
                values = values + max(0.0, off - float(np.nanmin(values)))
            self._cache[key] = None if np.isnan(values).all() else values
        return self._cache[key]

    def draft_off_for_step(self, bucket: int, kv_length: int) -> float | None:
        """Seconds of a draft-off step of ``bucket``; None when the table has no such cost."""
        if self.table is None:
            return None
        fit = self.table.fit_for(kv_length)
        if fit is None:
            return None
        # fits from cost models that predate draft-off steps simply lack the method
        predict = getattr(fit.cost, "predict_draft_off_seconds", None)
        return None if predict is None else predict(bucket)

    def for_live(self, bucket: int, kv_length: int, live: int, spendable: int) -> tuple[np.ndarray | None, float | None]:
        """Per-tier seconds and the draft-off seconds of a step of ``bucket`` that forwards only the rows
        its ``live`` requests use: their anchors, and of a tier's drafted rows no more than the
        ``spendable`` their caps allow. Each price is the full-bucket one less what the table's rows
        term charges for the rows left out; where the table cannot say (rows outside its probed
        span), the full-bucket price stands."""
        fit = None if self.table is None else self.table.fit_for(kv_length)
        if fit is None:
            return None, None
        spendable = min(spendable, full_width_rows(bucket, self.geometry.draft_width) - bucket)
        key = (bucket, self.table.fits.index(fit), live, spendable)  # (one lookup per step once cached)
        if key not in self._live_cache:
            self._live_cache[key] = self._price_live(fit, bucket, kv_length, live, spendable)
        return self._live_cache[key]

    def _price_live(self, fit, bucket: int, kv_length: int, live: int,
                    spendable: int) -> tuple[np.ndarray | None, float | None]:
        """What :meth:`for_live` returns for one (bucket, fit, live, spendable), computed once."""
        full, off = self.for_step(bucket, kv_length), self.draft_off_for_step(bucket, kv_length)
        if full is None:
            return None, off
        values = full.copy()
        for index, tier in enumerate(self.geometry.rows_for(bucket)):
            saved = self._rows_seconds(fit, live + min(tier - bucket, spendable), tier)
            if saved is not None:
                values[index] -= saved
        saved = None if off is None else self._rows_seconds(fit, live, bucket)
        live_off = off if off is None or saved is None else off - saved
        if live_off is not None and np.isfinite(values).any():
            # the same floor as for_step: a drafted step forwards at least the draft-off rows
            values = values + max(0.0, live_off - float(np.nanmin(values)))
        return values, live_off

    def _rows_seconds(self, fit, low: int, high: int) -> float | None:
        """What the fitted cost adds from ``low`` to ``high`` target rows (0 when they are equal), or None
        where the fit does not cover them. A bucket prices only the rows it can run (its own count up to
        its full width), so the span is walked in pieces, each priced in the largest bucket that runs
        its lower end."""
        total, rows = 0.0, low
        while rows < high:
            bucket = max((b for b in self.geometry.request_buckets if b <= rows), default=None)
            if bucket is None:
                return None
            top = min(high, full_width_rows(bucket, self.geometry.draft_width))
            if top <= rows:  # no bucket runs this many rows (buckets far apart)
                return None
            start, end = fit.cost.predict_seconds(bucket, rows), fit.cost.predict_seconds(bucket, top)
            if start is None or end is None:
                return None
            total += end - start
            rows = top
        return total
