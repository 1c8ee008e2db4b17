"""Target attention keys read in place (slot window) against gathered per request, side by side.

Runs real engine decode steps (SmolLM2 + the shipped draft, MT-Bench prompts,
``concurrency`` requests in flight) and times blocks of steps with the slot
window switched on and off (``dspark_core.models.layers``), alternating the
two inside every round on the same engine so both see the same requests and
context lengths. Both give bit-identical logits; only the time differs.

    python benchmarks/kv_window.py --output benchmarks/results/kv-window.json
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import load_models, make_engine, mtbench_chats, set_threads, write_results

from dspark_core.engine.request import SamplingParams
from dspark_core.models import layers, row_layout

MODES = {"gathered": 0, "window": row_layout._MAX_WINDOW_SLOTS_PER_REQUEST}


def _step_ms(engine, steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - started) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--policies", default="none,fixed-k3")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    set_threads(args.threads)
    target, draft = load_models()
    results = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        for policy in args.policies.split(","):
            # fixed widths and target-only need no cost table
            engine = make_engine(target, draft, policy="fixed" if policy.startswith("fixed") else policy, overlap=False)
            if policy.startswith("fixed-k"):
                engine.set_policy(engine.hooks.budget_policy("fixed", {"k": int(policy.removeprefix("fixed-k"))}))
            for chat in mtbench_chats(concurrency):
                engine.add_request(chat, SamplingParams(max_tokens=700, ignore_eos=True))
            _step_ms(engine, 3)
            samples: dict[str, list[float]] = {mode: [] for mode in MODES}
            for round_index in range(args.rounds):
                order = list(MODES) if round_index % 2 == 0 else list(reversed(MODES))
                for mode in order:
                    row_layout._MAX_WINDOW_SLOTS_PER_REQUEST = MODES[mode]
                    samples[mode].append(_step_ms(engine, args.steps))
            row_layout._MAX_WINDOW_SLOTS_PER_REQUEST = MODES["window"]
            engine.close()
            row = {"policy": policy, "concurrency": concurrency,
                   **{f"{mode}_step_ms": round(statistics.median(v), 2) for mode, v in samples.items()}}
            row["window_speedup"] = round(row["gathered_step_ms"] / row["window_step_ms"], 3)
            print(row, flush=True)
            results.append(row)
    write_results(args.output, "kv_window.py",
                  {"threads": args.threads, "rounds": args.rounds, "steps_per_block": args.steps}, results)


if __name__ == "__main__":
    main()
