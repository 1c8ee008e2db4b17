"""What the shape of a split costs: the same target rows spread evenly or unevenly over the requests.

A cost table prices a step by its request bucket and target rows only. On the CPU the batch-invariant
attention runs in row bands (dspark_core/models/row_bands.py), so a step whose requests verify very
different numbers of rows makes more attention calls than an even step of the same rows. This script
steps one engine (the real target and the shipped draft, no schedule overlap) with host-fixed
per-request verify lengths, one shape after another and round after round (the order reversed every
other round, the lengths shuffled over the requests), and reports each shape's median step time.

    python benchmarks/split_shapes.py --prompts heldout.jsonl --rounds 4 --output split-shapes.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from common import add_draft_dtype_argument, cpu_draft_dtype, load_models, make_engine, mtbench_chats, set_threads, write_results

from dspark_core.engine.request import SamplingParams
from dspark_core.policy import StepPlan, TierChoice, allocate_split, smallest_tier
from dspark_core.prompts import read_prompts_jsonl

# draft rows per request at 16 requests: even ones and uneven ones of the same totals (32 and 16 draft rows)
DEFAULT_SHAPES = {
    "even-2": [2] * 16,
    "uneven-32a": [7, 7, 5, 3, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0],
    "uneven-32b": [7, 6, 4, 3, 3, 2, 2, 2, 1, 1, 1, 0, 0, 0, 0, 0],
    "even-1": [1] * 16,
    "uneven-16": [7, 3, 2, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],
}


class FixedLengths:
    """A budget policy that verifies exactly ``lengths[b]`` drafted tokens of request ``b``."""

    name = "fixed-lengths"
    uses_draft = True
    tier_lag = 0
    reads_confidences = False

    def __init__(self, lengths: list[int], width: int) -> None:
        self.lengths = tuple(lengths)
        self.width = width

    def plan(self, ctx, confidences, caps) -> StepPlan:
        return StepPlan(draft=True)

    def choose_tier(self, ctx, confidences, caps) -> TierChoice:
        if ctx.live_requests != len(self.lengths):  # requests still being admitted: their own smallest tier
            return TierChoice(min(ctx.tiers))
        tier = smallest_tier(ctx, ctx.request_bucket + sum(self.lengths))
        return TierChoice(tier, lengths=self.lengths + (0,) * (ctx.request_bucket - len(self.lengths)))

    split = staticmethod(allocate_split)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default=None, help="JSONL prompts (`prompt` or `messages`); default MT-Bench first turns.")
    parser.add_argument("--shapes", default=json.dumps(DEFAULT_SHAPES),
                        help='JSON {"label": [draft rows of each request]}; every shape has one entry per request.')
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12, help="Timed decode steps per shape and round (after 5 untimed).")
    parser.add_argument("--width", type=int, default=7)
    add_draft_dtype_argument(parser)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max_model_len", type=int, default=2048, help="KV cache positions per slot (zero-filled at start).")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    try:
        shapes = json.loads(args.shapes)
    except json.JSONDecodeError as exc:
        parser.error(f"--shapes is not JSON: {exc}")
    counts = {len(v) for v in shapes.values()} if isinstance(shapes, dict) and shapes else set()
    if len(counts) != 1:
        parser.error("--shapes: a non-empty JSON object whose lists all have one entry per request (the same length)")
    for label, lengths in shapes.items():
        if not all(isinstance(n, int) and 0 <= n <= args.width for n in lengths):
            parser.error(f"--shapes: {label!r} needs draft rows in 0..{args.width} per request, got {lengths}")
    concurrency = counts.pop()
    if concurrency > 16:
        parser.error(f"--shapes: at most 16 requests (the largest captured bucket), got {concurrency}")
    set_threads(args.threads)
    target, draft = load_models(draft_dtype=getattr(torch, cpu_draft_dtype(args.draft_dtype)))
    engine = make_engine(target, draft, width=args.width, policy="fixed", overlap=False,
                         max_model_len=args.max_model_len)
    prompts = read_prompts_jsonl(args.prompts) if args.prompts else mtbench_chats(80)
    # room for every step to commit a full block: no request finishes (and shrinks the batch) mid-measurement
    params = SamplingParams(max_tokens=(5 + args.steps) * (args.width + 1) + 1, ignore_eos=True)
    times: dict[str, list[float]] = {label: [] for label in shapes}
    observed: dict[str, set[int]] = {label: set() for label in shapes}  # target rows the timed steps really ran
    reports: list = []
    engine.add_observer(reports.append)
    for rnd in range(args.rounds):
        order = list(shapes) if rnd % 2 == 0 else list(shapes)[::-1]
        for label in order:
            lengths = list(shapes[label])
            random.Random(rnd).shuffle(lengths)
            with engine.use_policy(FixedLengths(lengths, args.width)):
                requests = [engine.add_request(prompts[(i + rnd * concurrency) % len(prompts)], params)
                            for i in range(concurrency)]
                for _ in range(5):
                    engine.step()
                reports.clear()
                started = time.perf_counter()
                for _ in range(args.steps):
                    engine.step()
                times[label].append((time.perf_counter() - started) / args.steps)
                observed[label].update(report.target_rows for report in reports)
                for request in requests:
                    engine.cancel(request)
                while engine.has_work:
                    engine.step()
        print(rnd, {label: round(1e3 * v[-1], 1) for label, v in times.items()}, flush=True)
    results = [{"shape": label, "draft_rows": sum(shapes[label]), "target_rows": concurrency + sum(shapes[label]),
                "observed_target_rows": sorted(observed[label]),
                "step_ms_median": round(1e3 * statistics.median(v), 1), "step_ms": [round(1e3 * t, 1) for t in v]}
               for label, v in times.items()]
    for row in results:
        print(row)
    write_results(args.output, "split_shapes.py", {"prompts": args.prompts or "mt-bench", "rounds": args.rounds,
                                                    "steps": args.steps, "width": args.width, "threads": args.threads,
                                                    "shapes": shapes}, results)


if __name__ == "__main__":
    main()
