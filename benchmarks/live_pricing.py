"""Partial buckets priced by the table's full-bucket costs or by the rows they forward, side by side.

An eager verify forwards only its live requests' rows, so below full occupancy a step costs less
than the table (fitted on full buckets) says, and a draft-off step relatively less than a drafted
one. Since 2026-12-07 the planner prices such steps by the rows they forward
(``TierCosts.for_live``). This script runs the cost-reading policies twice, once priced as before
(``@padded``: the table's full-bucket prices) and once by live rows (``@live``), the engines taking
turns one ``step()`` at a time. Target-only runs twice as well: it reads no price, so its two
variants show the noise floor. Outputs must be identical.

    python benchmarks/live_pricing.py --prompts /tmp/sharegpt-heldout.jsonl --limit 36 --concurrency 12 \\
        --table benchmarks/results/amx/k7/cost-table.json --draft_depths 4:4,8:4,16:2
"""

from __future__ import annotations

from common import decode_in_turns, paired_rows, set_threads, write_results
from key_tails import pair_arguments, paired_engines

from dspark_core.prompts import read_prompts_jsonl

POLICIES = {"none": ("none", {}), "adaptive": ("adaptive", {}), "min-gain": ("min-gain", {})}


def main() -> None:
    parser = pair_arguments(__doc__.splitlines()[0])
    parser.add_argument("--policies", default="none,adaptive", help=f"Comma-separated, from {sorted(POLICIES)}.")
    args = parser.parse_args()
    set_threads(args.threads)
    names = args.policies.split(",")
    if "none" not in names or any(name not in POLICIES for name in names):
        parser.error(f"--policies: choose from {sorted(POLICIES)}, target-only (none) included")
    engines = paired_engines(args, ("padded", "live"), {name: POLICIES[name] for name in names})
    for label, engine in engines.items():
        if label.endswith("@padded"):  # the prices of 118ec90..c100131: full buckets whatever runs
            costs = engine.costs
            costs.for_live = lambda bucket, kv, live, spendable, costs=costs: (  # type: ignore[method-assign]
                costs.for_step(bucket, kv), costs.draft_off_for_step(bucket, kv))
    prompts = read_prompts_jsonl(args.prompts)[: args.limit]
    outputs, seconds = decode_in_turns(engines, prompts, args.concurrency, args.max_tokens)
    results = paired_rows(outputs, seconds, "padded", "none@padded")
    for row in results:
        counters = engines[row["policy"]].counters
        row["draft_off_steps"], row["steps"] = counters.draft_off_steps, counters.steps
        print(row["policy"], "draft-off steps", counters.draft_off_steps, "of", counters.steps, flush=True)
    write_results(args.output, "live_pricing.py", {
        "prompts": args.prompts, "count": len(prompts), "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "table": args.table, "draft_depths": args.draft_depths, "threads": args.threads}, results)


if __name__ == "__main__":
    main()
