"""Host overhead of budget selection + packing as a fraction of decode-step time (batch 16).

Times the policy's tier choice, the split (allocate kernel) and the pack kernel
inside real decode steps of SmolLM2 + draft at 16 concurrent requests, with
wrappers installed only in this script.

    python benchmarks/step_overhead.py [--draft_model DIR] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import time

from common import load_models, make_engine, mtbench_chats, set_threads

from dspark_core.engine import step as step_module
from dspark_core.engine.request import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--draft_model", default="default")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    set_threads(args.threads)
    import sys

    sys.path.insert(0, "tests")
    from engine_support import synthetic_table

    target, draft = load_models(args.draft_model)
    engine = make_engine(target, draft, policy="adaptive", overlap=False, table=synthetic_table(7, (1, 2, 4, 8, 16)))
    spent = {"budget": 0.0, "pack": 0.0}
    original_select, original_pack = step_module.select_budget, engine.runner.kernels.pack

    def timed_select(step, proposal):
        t = time.perf_counter()
        try:
            return original_select(step, proposal)
        finally:
            spent["budget"] += time.perf_counter() - t

    def timed_pack(*a, **k):
        t = time.perf_counter()
        try:
            return original_pack(*a, **k)
        finally:
            spent["pack"] += time.perf_counter() - t

    step_module.select_budget = timed_select
    object.__setattr__(engine.runner.kernels, "pack", timed_pack)
    for prompt in mtbench_chats(16):
        engine.add_request(prompt, SamplingParams(max_tokens=args.steps * 8 + 8, ignore_eos=True))
    while engine.counters.steps < 3:  # prefill and a couple of steps before measuring
        engine.step()
    spent.update(budget=0.0, pack=0.0)
    before = engine.counters.steps
    started = time.perf_counter()
    while engine.counters.steps - before < args.steps:
        engine.step()
    total = time.perf_counter() - started
    steps = engine.counters.steps - before
    print(json.dumps({"steps": steps, "step_ms": round(1e3 * total / steps, 2),
                      "budget_ms": round(1e3 * spent["budget"] / steps, 3), "pack_ms": round(1e3 * spent["pack"] / steps, 3),
                      "overhead_fraction": round((spent["budget"] + spent["pack"]) / total, 4)}, indent=2))


if __name__ == "__main__":
    main()
