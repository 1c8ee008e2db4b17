"""What steps really cost in serving, against what the cost table prices them at.

Runs policies on one engine with schedule overlap (as `dspark-core bench` does)
and stamps the host clock whenever a decode step's results are processed.
While the device thread is busy the whole time (the host thread of this
pipeline sat idle 99 % of the wall time at sixteen requests on a 2-core CPU),
the interval between two processed steps is the later step's cost. Only
*steady* intervals count: the bucket full on both sides, so no request was
admitted and no prefill ran between. Medians are reported per kind of step
(draft-off, or the target rows verified) beside the table's price, so an
uneven split that the table prices as an even one shows up as a gap.

    python benchmarks/step_intervals.py --table cost-table.json --concurrency 16 --limit 48 --rounds 2 \\
        --output step-intervals.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import load_models, make_engine, mtbench_chats, policy_labels, set_threads, write_results

from dspark_core.bench.run import CellRecord, run_cell
from dspark_core.plugins import default_hooks
from dspark_core.prompts import read_prompts_jsonl
from dspark_core.table import load_table

POLICIES = {"none": ("none", {}), "fixed-k1": ("fixed", {"k": 1}), "adaptive": ("adaptive", {})}


def steady_intervals(stamps: list[tuple[float, int, int, bool]], bucket: int) -> dict[str, list[float]]:
    """Milliseconds between consecutive processed steps with ``bucket`` requests live on both sides,
    keyed by the later step's kind (``off``, or ``G<rows>``). ``stamps``: (time, live, rows, draft_off)."""
    out: dict[str, list[float]] = {}
    for before, after in zip(stamps, stamps[1:]):
        if before[1] == bucket and after[1] == bucket:
            out.setdefault("off" if after[3] else f"G{after[2]}", []).append(1e3 * (after[0] - before[0]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", required=True, help="Cost table measured on this machine and thread count.")
    parser.add_argument("--prompts", default=None, help="JSONL prompts (default: MT-Bench first turns).")
    parser.add_argument("--limit", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16, help="A captured request bucket.")
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--policies", default="none,fixed-k1,adaptive", help=f"Comma-separated, of {sorted(POLICIES)}.")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="Intra-op threads (0: PyTorch's default).")
    parser.add_argument("--max_model_len", type=int, default=1024)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    names = policy_labels(parser, args.policies, POLICIES)
    if args.threads:
        set_threads(args.threads)
    prompts = (read_prompts_jsonl(args.prompts) if args.prompts else mtbench_chats(args.limit))[:args.limit]
    target, draft = load_models()
    table = load_table(args.table)
    engine = make_engine(target, draft, table=table, max_model_len=args.max_model_len)
    engine.warmup()
    hooks = default_hooks()
    fit = table.fit_for(args.max_tokens)
    results = []
    for round_index in range(args.rounds):
        for name in names:
            policy_name, options = POLICIES[name]
            stamps: list[tuple[float, int, int, bool]] = []

            def observe(report, stamps=stamps) -> None:
                stamps.append((time.perf_counter(), report.live_requests, report.target_rows, report.draft_off))

            engine.add_observer(observe)
            cell = CellRecord(name, args.concurrency)
            try:
                run_cell(engine, hooks.budget_policy(policy_name, options), prompts, range(len(prompts)),
                         args.concurrency, args.max_tokens, cell)
            finally:
                engine.remove_observer(observe)
            tokens = sum(len(r.token_ids) for r in cell.requests)
            steps = {}
            for kind, values in sorted(steady_intervals(stamps, args.concurrency).items()):
                price = (fit.cost.predict_draft_off_seconds(args.concurrency) if kind == "off"
                         else fit.cost.predict_seconds(args.concurrency, int(kind[1:]))) if fit is not None else None
                median = float(np.median(values))
                steps[kind] = {"steps": len(values), "median_ms": round(median, 2),
                               "table_ms": None if price is None else round(1e3 * price, 2),
                               "over_table": None if not price else round(median / (1e3 * price), 3)}
            row = {"policy": name, "round": round_index, "tokens_per_s": round(tokens / cell.wall_seconds, 2),
                   "steps": steps}
            results.append(row)
            print(row, flush=True)
    engine.close()
    write_results(args.output, "step_intervals.py", {"table": args.table, "concurrency": args.concurrency,
                  "count": len(prompts), "max_tokens": args.max_tokens, "rounds": args.rounds,
                  "threads": args.threads}, results)


if __name__ == "__main__":
    main()
