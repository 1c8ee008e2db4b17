"""Draft proposals in float32 against bfloat16 (the CPU default where bfloat16 is native), side by side.

Times ``ModelRunner.propose`` of the shipped SmolLM2 draft for 1, 4 and 16
requests at context position 300, float32 and bfloat16 drafts alternating
inside every round (medians over rounds), and counts how often the two
propose the same tokens. Acceptance is measured separately with
``dspark-core eval-draft --draft_dtype`` (docs/models.md).

    python benchmarks/draft_dtype.py --output benchmarks/results/draft-dtype.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import load_models, set_threads, write_results

from dspark_core.engine.runner import ModelRunner
from dspark_core.models.drafts import resolve_draft_path
from dspark_core.models.speculators_io import load_draft

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    set_threads(args.threads)
    target, _ = load_models()
    counts = [int(n) for n in args.requests.split(",")]
    slots = max(counts)
    runners = {name: ModelRunner(target, load_draft(resolve_draft_path("default", "smollm2"), dtype=dtype),
                                 draft_width=7, num_slots=slots, max_len=1024) for name, dtype in DTYPES.items()}
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(200, 20000, (300,), generator=gen).tolist() for _ in range(slots)]
    as_long = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    samples: dict[tuple[str, int], list[float]] = {}
    same: dict[int, float] = {}
    with torch.inference_mode():
        for runner in runners.values():
            runner.prefill(prompts, list(range(slots)))
        for n in counts:
            anchors, positions, slot_ids = as_long([p[-1] for p in prompts[:n]]), as_long([299] * n), as_long(list(range(n)))
            proposals = {name: r.propose(anchors, positions, slot_ids)[0] for name, r in runners.items()}
            same[n] = float((proposals["float32"] == proposals["bfloat16"]).float().mean())
            for round_index in range(args.rounds):
                names = list(runners) if round_index % 2 == 0 else list(reversed(runners))
                for name in names:
                    started = time.perf_counter()
                    for _ in range(args.reps):
                        runners[name].propose(anchors, positions, slot_ids)
                    samples.setdefault((name, n), []).append((time.perf_counter() - started) / args.reps * 1e3)
    results = []
    for n in counts:
        row = {"requests": n, **{f"{name}_ms": round(statistics.median(samples[(name, n)]), 3) for name in DTYPES},
               "same_tokens": round(same[n], 3)}
        row["bfloat16_speedup"] = round(row["float32_ms"] / row["bfloat16_ms"], 3)
        print(row, flush=True)
        results.append(row)
    write_results(args.output, "draft_dtype.py", {"threads": args.threads, "rounds": args.rounds, "reps": args.reps},
                  results)


if __name__ == "__main__":
    main()
