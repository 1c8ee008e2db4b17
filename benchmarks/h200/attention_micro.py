"""Decode-step attention alone: SDPA against the matmul form, at SmolLM2's head shapes (issue 17).

``attention.attend`` runs one layer's attention of a decode or verify step: ``requests`` requests of
``rows`` query rows each (1 for target-only, K + 1 for a full-width verify), over ``keys`` key
positions (a captured graph reads the whole cache: max_model_len). This times both kernels of
``attention.set_attention_kernel`` on the same inputs and reports microseconds per call (CUDA events
on a GPU, wall time elsewhere) and the largest difference between their outputs.

    python benchmarks/h200/attention_micro.py --device cuda --output OUT/attention-micro.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from dspark_core.models.attention import attend, grouped_mask, set_attention_kernel
from dspark_core.models.row_layout import RowLayout


def time_call(fn, device: str, iterations: int) -> float:
    """Microseconds per call of ``fn`` after a few untimed ones."""
    for _ in range(3):
        fn()
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iterations):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1000 / iterations
    started = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - started) * 1e6 / iterations


def case(requests: int, rows: int, keys: int, dtype: torch.dtype, device: str, iterations: int,
         heads: int = 9, kv_heads: int = 3, head_dim: int = 64) -> dict:
    g = torch.Generator(device="cpu").manual_seed(requests * 1000 + rows)
    # every request's rows sit at the end of a full context, as in a captured step late in a long answer
    positions = torch.tensor([keys - rows + j for _ in range(requests) for j in range(rows)], device=device)
    offsets = torch.arange(0, (requests + 1) * rows, rows, device=device)
    layout = RowLayout.build(positions, torch.arange(requests, device=device), offsets, max_rows=rows, kv_len=keys)
    q = torch.randn(requests * rows, heads, head_dim, generator=g).to(device, dtype)
    k = torch.randn(requests, kv_heads, keys, head_dim, generator=g).to(device, dtype)
    v = torch.randn(requests, kv_heads, keys, head_dim, generator=g).to(device, dtype)
    mask = grouped_mask(layout.causal_mask(), heads // kv_heads, dtype)
    out, us = {}, {}
    for kernel in ("sdpa", "matmul"):
        set_attention_kernel(kernel)
        try:
            us[kernel] = round(time_call(lambda: attend(q, k, v, layout, mask), device, iterations), 2)
            out[kernel] = attend(q, k, v, layout, mask).float()
        finally:
            set_attention_kernel("auto")
    return {"requests": requests, "rows": rows, "keys": keys, "dtype": str(dtype).removeprefix("torch."),
            "us_sdpa": us["sdpa"], "us_matmul": us["matmul"], "speedup": round(us["sdpa"] / us["matmul"], 2),
            "max_abs_diff": float((out["sdpa"] - out["matmul"]).abs().max())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", default="1,16,64")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--keys", default="512,2048")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    results = []
    for requests, rows, keys, dtype in itertools.product(ints(args.requests), ints(args.rows), ints(args.keys),
                                                         args.dtypes.split(",")):
        result = case(requests, rows, keys, getattr(torch, dtype), args.device, args.iterations)
        print(result, flush=True)
        results.append(result)
    report = {"meta": {"device": args.device, "torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
              "results": results}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
