"""PNG plots of a benchmark: throughput, TPOT and the throughput ratio vs the best fixed k against
concurrency, one line per policy; the ratio panel shows its spread over the rounds."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402


def plot(rows: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    """Three panels (output tokens/s, mean TPOT, tokens/s vs the best fixed k) with concurrency on a
    log2 axis. In the ratio panel each point is the median over rounds and its bar spans min to max."""
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(17, 4.5))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    for i, policy in enumerate(policies):
        mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in mine]
        style = {"linewidth": 2.5} if policy == "adaptive" else {"linewidth": 1, "alpha": 0.8}
        left.plot(xs, [r["output_tokens_per_second"] for r in mine], marker="o", label=policy, **style)
        middle.plot(xs, [r["tpot_ms_mean"] for r in mine], marker="o", label=policy, **style)
        spreads = [r.get("spread", {}).get("vs_best_fixed") or {} for r in mine]
        med = np.array([s.get("median", np.nan) for s in spreads], dtype=float)
        low = np.array([s.get("min", np.nan) for s in spreads], dtype=float)
        high = np.array([s.get("max", np.nan) for s in spreads], dtype=float)
        if np.isfinite(med).any():
            # a small horizontal offset per policy keeps the bars of one concurrency apart
            shifted = [x * 2 ** (0.04 * (i - len(policies) / 2)) for x in xs]
            right.errorbar(shifted, med, yerr=[med - low, high - med], marker="o", capsize=2, label=policy, **style)
    right.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    for axis, label in ((left, "output tokens / s"), (middle, "mean TPOT (ms)"),
                        (right, "tok/s vs best fixed k (median, min-max over rounds)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrency")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    left.legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
