"""CPU products: ``F.linear`` (MKL) against packed oneDNN weights, side by side in one run.

Times, on SmolLM2's real weights and the shipped draft, (1) single products
of each weight shape for 1-64 rows and (2) whole target forwards of 1-8 rows
(one request at position 200: target-only is 1 row, a verify of k drafted
tokens is k + 1) and draft proposals, with ``dspark_core.models.cpu_linear``
switched off (``aten``) and on (``onednn``). Modes alternate inside every
round so a noisy machine hits both alike; medians over the rounds.

    python benchmarks/cpu_linear.py --output benchmarks/results/cpu-linear.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from common import load_models, set_threads

from dspark_core.engine.runner import ModelRunner
from dspark_core.models import cpu_linear
from dspark_core.models.base import ForwardBatch
from dspark_core.models.layers import linear

MODES = {"aten": False, "onednn": True}


def _ms(fn, reps: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps * 1e3


def _median_table(samples: dict) -> dict:
    return {name: {mode: round(statistics.median(v), 3) for mode, v in by_mode.items()} for name, by_mode in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft_model", default="default")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    set_threads(args.threads)
    target, draft = load_models(args.draft_model)
    runner = ModelRunner(target, draft, draft_width=7, num_slots=4, max_len=1024)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    layer = target.layers[0]
    weights = {"qkv": layer.qkv, "o_proj": layer.o_proj, "gate_up": layer.gate_up, "down": layer.down,
               "lm_head": target.lm_head}
    products, steps = {}, {}
    with torch.inference_mode():
        runner.prefill([list(range(100, 300))], [0])
        for _ in range(args.rounds):
            for mode, on in MODES.items():
                cpu_linear.set_enabled(on)
                for name, weight in weights.items():
                    for rows in (1, 2, 4, 8, 16, 64):
                        x = torch.randn(rows, weight.shape[1])
                        reps = 5 if name == "lm_head" else 40
                        products.setdefault(f"{name} {tuple(weight.shape)} x{rows}", {}).setdefault(mode, []).append(
                            _ms(lambda: linear(x, weight), reps))
                for rows in (1, 2, 4, 8):
                    batch = ForwardBatch(as_long([5] * rows), as_long(list(range(200, 200 + rows))), as_long([0]),
                                         as_long([0, rows]))
                    steps.setdefault(f"target forward, {rows} rows", {}).setdefault(mode, []).append(
                        _ms(lambda: runner.forward(batch), 10))
                for n in (1, 4):
                    anchors, positions, slots = as_long([5] * n), as_long([199] * n), as_long(list(range(n)))
                    steps.setdefault(f"draft proposal, {n} requests", {}).setdefault(mode, []).append(
                        _ms(lambda: runner.propose(anchors, positions, slots), 10))
    cpu_linear.set_enabled(None)
    result = {"threads": args.threads, "rounds": args.rounds, "torch": torch.__version__,
              "ms_products": _median_table(products), "ms_steps": _median_table(steps)}
    for table in (result["ms_products"], result["ms_steps"]):
        for row in table.values():
            row["aten/onednn"] = round(row["aten"] / row["onednn"], 2)
    text = json.dumps(result, indent=1)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
