"""Fit quality and startup time of calibration on the real default model.

Runs the real startup path (warmup + probing + fit) with a calibration file,
then probes extra held-out points (target rows between the probed ones) the
same way and reports the cost model's prediction error on them (MAPE), plus
the error on the fitted points' own windows.

    python benchmarks/calibration_fit.py --calibration configs/demo-calibration.json --draft_model default
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from dspark_core.calibration.install import bring_up
from dspark_core.calibration.plan import CalibrationPlan, ProbePoint
from dspark_core.calibration.probe import probe_point
from dspark_core.config import parse_serve_args
from dspark_core.startup import build_engine, resolve_launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibration", default="configs/demo-calibration.json")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--draft_model", default="default")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--captured_target_rows", default="bucket_multiples", choices=["all", "bucket_multiples"])
    parser.add_argument("--held_out", default="1:4,2:6,4:12,8:24,8:48,16:32,16:96",
                        help="bucket:rows points (captured, not in the calibration grid)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = parse_serve_args([f"--model={args.model}", f"--draft_model={args.draft_model}",
                               f"--adaptive_dspark_calibration={args.calibration}", "--max_model_len=2048",
                               f"--captured_target_rows={args.captured_target_rows}"])
    started = time.perf_counter()
    launch = resolve_launch(config)
    engine = build_engine(launch)
    loaded = time.perf_counter()
    table = bring_up(engine, launch, progress=True)
    ready = time.perf_counter()
    plan: CalibrationPlan = launch.plan
    fit = table.fits[0]
    in_grid = [abs(fit.cost.predict_seconds(m.request_bucket, m.target_rows) - m.step_seconds) / m.step_seconds
               for m in fit.measurements]
    held = []
    generator = torch.Generator().manual_seed(7)
    for item in args.held_out.split(","):
        bucket, rows = (int(x) for x in item.split(":"))
        point = ProbePoint(bucket, rows, 0, plan.settings.contexts[0].prefill_tokens)
        samples = probe_point(engine, point, plan, generator)
        measured = sum(s.seconds for s in samples) / sum(s.steps for s in samples)
        predicted = fit.cost.predict_seconds(bucket, rows)
        held.append({"bucket": bucket, "rows": rows, "measured_ms": round(measured * 1e3, 2),
                     "predicted_ms": round(predicted * 1e3, 2), "error": round(abs(predicted - measured) / measured, 4)})
    engine.close()
    print(json.dumps({
        "load_seconds": round(loaded - started, 1), "warmup_and_calibration_seconds": round(ready - loaded, 1),
        "probe_points": len(plan.points), "fitted_points_mape": round(float(np.mean(in_grid)), 4),
        "held_out_mape": round(float(np.mean([h["error"] for h in held])), 4), "held_out": held,
        "fitted_points": [{"bucket": m.request_bucket, "rows": m.target_rows, "measured_ms": round(m.step_seconds * 1e3, 2),
                           "predicted_ms": round(fit.cost.predict_seconds(m.request_bucket, m.target_rows) * 1e3, 2)}
                          for m in fit.measurements],
    }, indent=2))


if __name__ == "__main__":
    main()
