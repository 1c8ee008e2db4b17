"""What a verified row costs: target-only against fixed widths, step by step.

One engine per policy (target-only and fixed k for each ``--widths`` entry),
all serving the same MT-Bench prompts (one per ``--concurrency``) with
``ignore_eos``, so every measured step is a pure decode step over the same
batch; the engines take
turns one decode step at a time, so machine noise falls on all of them
alike. Per policy it reports the median full step and the median time of
its parts: the target forward (1 row target-only, k + 1 rows at width k),
the draft proposal and the draft context write. A flat target column up to
some k says those rows cost nothing at one request, which is what the
calibrated table's ``theta`` should show. With ``--table`` (a bench's saved
``cost-table.json``) an ``adaptive`` engine pricing steps by it takes its turn
too, and its rows show what its own choices cost against the fixed widths.

    python benchmarks/row_costs.py --output benchmarks/results/row-costs.json
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
from common import (add_draft_dtype_argument, cpu_draft_dtype, load_models, mtbench_chats, policy_specs,
                    set_threads, side_by_side_engines, write_results)

from dspark_core.engine.request import SamplingParams
from dspark_core.prompts import read_prompts_jsonl


def _timed(obj, name: str, key: str, spent: dict[str, float]) -> None:
    """Wrap ``obj.name`` so its wall time adds up in ``spent[key]`` (this script's instances only)."""
    inner = getattr(obj, name)

    @functools.wraps(inner)  # keeps the signature the engine inspects (a draft's propose takes ``depth``)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - started

    setattr(obj, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="1,3,5,7", help="Fixed widths k to compare with target-only (K = 7).")
    parser.add_argument("--concurrency", type=int, default=1, help="Requests decoding together in every engine.")
    parser.add_argument("--steps", type=int, default=120, help="Decode steps per policy (taken in turns).")
    add_draft_dtype_argument(parser)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--table", default=None, help="A saved cost table: also step an adaptive engine priced by it.")
    parser.add_argument("--prompts", default=None,
                        help="JSONL prompts (`prompt` or `messages`; held-out ShareGPT, say); default MT-Bench first turns.")
    parser.add_argument("--draft_depths", default="full",
                        help="Tokens the draft proposes per request bucket, as the CLI's --draft_depths (bucket:depth pairs).")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if args.concurrency < 1:
        parser.error(f"--concurrency must be at least 1, got {args.concurrency}")
    set_threads(args.threads)
    args.draft_dtype = cpu_draft_dtype(args.draft_dtype)
    widths = [int(k) for k in args.widths.split(",")]
    draft_dtype = getattr(torch, args.draft_dtype)
    target, _ = load_models(None)
    spent: dict[str, float] = {}
    _timed(target, "forward", "target_ms", spent)
    policies = policy_specs(widths, args.table is not None)

    def timed_draft(draft) -> None:
        _timed(draft, "propose", "propose_ms", spent)
        _timed(draft, "extend_context", "context_ms", spent)

    engines = side_by_side_engines(target, policies, table_path=args.table, draft_dtype=draft_dtype,
                                   on_draft=timed_draft, max_model_len=2048, draft_depths=args.draft_depths)
    chats = read_prompts_jsonl(args.prompts)[: args.concurrency] if args.prompts else mtbench_chats(args.concurrency)
    if len(chats) < args.concurrency:
        parser.error(f"--prompts {args.prompts} holds {len(chats)} prompts; --concurrency {args.concurrency} needs as many")
    reports: dict[str, list] = {label: [] for label in policies}
    for label, engine in engines.items():
        for chat in chats:
            engine.add_request(chat, SamplingParams(max_tokens=args.steps * 8, ignore_eos=True))
        warm: list = []  # prefill and three decode steps over the whole batch, not measured
        engine.add_observer(warm.append)
        while sum(r.live_requests == args.concurrency for r in warm) < 3:
            engine.step()
        engine.remove_observer(warm.append)
        engine.add_observer(reports[label].append)
    samples: dict[str, dict[str, list[float]]] = {label: {} for label in policies}
    for _ in range(args.steps):
        for label, engine in engines.items():
            spent.clear()
            started = time.perf_counter()
            engine.step()
            for key, seconds in {"step_ms": time.perf_counter() - started, **spent}.items():
                samples[label].setdefault(key, []).append(1e3 * seconds)
    results = []
    for label, parts in samples.items():
        done = reports[label]  # every measured step, processed inside its own engine.step() (no overlap)
        row = {"policy": label, **{key: round(statistics.median(values), 2) for key, values in parts.items()},
               "step_ms_mean": round(statistics.fmean(parts["step_ms"]), 2),
               "rows_mean": round(statistics.fmean(r.target_rows for r in done), 2),
               "tokens_per_step": round(statistics.fmean(r.committed_tokens for r in done), 3),
               # committed tokens over the wall time of the same steps: the policies' throughput side by side
               "tokens_per_s": round(sum(r.committed_tokens for r in done) / (1e-3 * sum(parts["step_ms"][:len(done)])), 2)}
        results.append(row)
        print(row)
    write_results(args.output, "row_costs.py", {"threads": args.threads, "steps": args.steps, "concurrency": args.concurrency,
                                                "table": args.table, "draft_dtype": args.draft_dtype,
                                                "prompts": args.prompts, "draft_depths": args.draft_depths}, results)


if __name__ == "__main__":
    main()
