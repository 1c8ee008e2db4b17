"""How steeply saved cost tables price extra rows, against what their probes measured.

For each ``cost-table.json`` (a bench output directory or the file itself) and
each of request buckets 1, 2 and 4, prints the least-squares slope of the
measured drafting step time over the bucket's probed rows (bucket 1 from 2 rows
on: one row verifies no drafted token) and the fitted price at the bucket's
smallest and largest of those rows. Used to compare calibrations probed
sequentially and interleaved (``probe_order``), see
``benchmarks/results/avx2/README.md``.

    python benchmarks/table_slopes.py benchmarks/results/avx2/probe-order/bench-mtbench
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

BUCKET_ROWS = {1: range(2, 9), 2: range(2, 17, 2), 4: range(4, 33, 4)}


def slopes(path: Path) -> dict[str, dict[str, float]]:
    """Per bucket: measured ms per extra row, and the fitted first and last price (ms)."""
    table = json.loads((path / "cost-table.json" if path.is_dir() else path).read_text())
    fit = table["fits"][0]
    params = fit["params"]
    theta = dict(zip(params["target_rows"], params["theta_seconds"]))
    out = {}
    for bucket, rows in BUCKET_ROWS.items():
        measured = {m["target_rows"]: 1000 * m["step_seconds"] for m in fit["measurements"]
                    if m["request_bucket"] == bucket and not m["draft_off"]}
        probed = [g for g in rows if g in measured]
        if len(probed) < 2 or bucket not in params["request_buckets"]:
            continue
        alpha = params["alpha_seconds"][params["request_buckets"].index(bucket)]
        first, last = (1000 * (params["bias_seconds"] + alpha + theta[g]) for g in (probed[0], probed[-1]))
        out[str(bucket)] = {"ms_per_row": float(np.polyfit(probed, [measured[g] for g in probed], 1)[0]),
                            "priced_first_ms": first, "priced_last_ms": last}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tables", nargs="+", type=Path, help="cost-table.json files or directories holding one")
    args = parser.parse_args()
    for path in args.tables:
        cells = [f"bucket {b}: {s['ms_per_row']:.2f} ms/row measured, priced {s['priced_first_ms']:.1f} -> "
                 f"{s['priced_last_ms']:.1f} ms" for b, s in slopes(path).items()]
        print(f"{path}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
