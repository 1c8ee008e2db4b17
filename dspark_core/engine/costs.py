"""Per-tier step costs from the installed table, looked up once per (bucket, KV interval)."""

from __future__ import annotations

import numpy as np

from dspark_core.geometry import Geometry


class TierCosts:
    """Caches the cost vector over a bucket's captured tiers so a step pays one dict lookup."""

    def __init__(self, geometry: Geometry) -> None:
        self.geometry = geometry
        self.table = None
        self._cache: dict[tuple[int, int], np.ndarray | None] = {}

    def install(self, table) -> None:
        """Install an immutable table (None removes it: every step then uses full width)."""
        self.table = table
        self._cache.clear()

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
