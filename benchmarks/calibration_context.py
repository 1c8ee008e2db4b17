"""How much a calibration's prices depend on the context length it probes at.

The demo calibrations prefill 32 random tokens per request, while serving
contexts (prompt + answer) run to a few hundred tokens. This script probes the
same (bucket, rows) points at several prefill lengths with the calibration's
own ``probe_point`` (real pipeline, forced tier), interleaving the lengths in
rounds so that the machine's drift falls on all of them alike, and reports each
point's step time and its ratio to the bucket's draft-off step.

    python benchmarks/calibration_context.py --prefills 32,192 --rounds 2 --output calibration-context.json
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import numpy as np
import torch
from common import write_results

from dspark_core.calibration.install import bring_up
from dspark_core.calibration.plan import ProbePoint
from dspark_core.calibration.probe import probe_point
from dspark_core.config import parse_serve_args
from dspark_core.startup import build_engine, resolve_launch

DEFAULT_POINTS = {7: "1:off,1:4,1:8,4:off,4:8,4:16,4:32,16:off,16:32",
                  5: "1:off,1:2,1:6,4:off,4:8,4:12,4:24,16:off,16:32"}


def parse_points(text: str) -> list[tuple[int, int | None]]:
    """``bucket:rows`` items, ``rows`` = ``off`` for the bucket's draft-off step."""
    points = []
    for item in text.split(","):
        bucket, rows = item.split(":")
        points.append((int(bucket), None if rows == "off" else int(rows)))
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=7, choices=[5, 7])
    parser.add_argument("--prefills", default="32,192", help="Prefill lengths to compare (comma-separated).")
    parser.add_argument("--points", default=None, help="bucket:rows items (rows 'off' = draft off).")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window_steps", type=int, default=8)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--table", default=None, help="Saved cost table matching this launch "
                        "(skips the ~2-minute demo calibration at startup).")
    parser.add_argument("--output", default=None, help="JSON file for the results.")
    args = parser.parse_args()
    prefills = [int(x) for x in args.prefills.split(",")]
    points = parse_points(args.points or DEFAULT_POINTS[args.width])
    # only the engine and its warmed graphs are needed: a saved table skips the demo calibration
    source = f"--adaptive_dspark_cost_table={args.table}" if args.table else "--adaptive_dspark_calibration=demo"
    config = parse_serve_args(["--model=smollm2", "--draft_model=default", f"--num_speculative_tokens={args.width}",
                               "--max_model_len=2048", "--captured_target_rows=bucket_multiples", source])
    launch = resolve_launch(config)
    engine = build_engine(launch)
    started = time.perf_counter()
    bring_up(engine, launch, progress=False)
    startup_seconds = time.perf_counter() - started
    settings = SimpleNamespace(warmup_steps=2, window_steps=args.window_steps, windows_per_point=args.windows,
                               draft_width=args.width)
    plan = SimpleNamespace(settings=settings)
    generator = torch.Generator().manual_seed(3)
    step_ms: dict[tuple[int, int | None, int], list[float]] = {}
    point_seconds: dict[int, float] = {p: 0.0 for p in prefills}
    for _ in range(args.rounds):
        # each point at every length back to back: the machine's drift falls within a point's pair
        for bucket, rows in points:
            for prefill in prefills:
                point = ProbePoint(bucket, rows if rows is not None else bucket, 0, prefill, draft_off=rows is None)
                t0 = time.perf_counter()
                samples = probe_point(engine, point, plan, generator)
                point_seconds[prefill] += time.perf_counter() - t0
                ms = 1e3 * sum(s.seconds for s in samples) / sum(s.steps for s in samples)
                step_ms.setdefault((bucket, rows, prefill), []).append(ms)
    engine.close()
    results = []
    for bucket, rows in points:
        row = {"bucket": bucket, "rows": "off" if rows is None else rows}
        for prefill in prefills:
            mean = float(np.mean(step_ms[(bucket, rows, prefill)]))
            off = float(np.mean(step_ms[(bucket, None, prefill)])) if (bucket, None, prefill) in step_ms else float("nan")
            row[f"ms@{prefill}"] = round(mean, 2)
            row[f"over_off@{prefill}"] = round(mean / off, 3)
        results.append(row)
        print(json.dumps(row))
    meta = {"width": args.width, "prefills": prefills, "rounds": args.rounds, "window_steps": args.window_steps,
            "windows": args.windows, "startup_seconds": round(startup_seconds, 1),
            "probe_seconds_per_round": {p: round(s / args.rounds, 1) for p, s in point_seconds.items()}}
    print(json.dumps(meta))
    write_results(args.output, "calibration_context.py", meta, results)


if __name__ == "__main__":
    main()
