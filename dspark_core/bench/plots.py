"""PNG plots of a benchmark: throughput and TPOT against concurrency, one line per policy."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402


def plot(rows: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    """Two panels (output tokens/s, mean TPOT) with concurrency on a log2 axis."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in mine]
        style = {"linewidth": 2.5} if policy == "adaptive" else {"linewidth": 1, "alpha": 0.8}
        left.plot(xs, [r["output_tokens_per_second"] for r in mine], marker="o", label=policy, **style)
        right.plot(xs, [r["tpot_ms_mean"] for r in mine], marker="o", label=policy, **style)
    for axis, label in ((left, "output tokens / s"), (right, "mean TPOT (ms)")):
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
