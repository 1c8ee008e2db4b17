"""What steps really cost in serving, against what the cost table prices them at.

Runs policies on one engine with schedule overlap (as `dspark-core bench` does)
and stamps the host clock whenever a decode step's results are processed.
While the device thread is busy the whole time (the host thread of this
pipeline sat idle 99 % of the wall time at sixteen requests on a 2-core CPU),
the interval between two processed steps is the later step's cost. Only
*steady* intervals count: the bucket full on both sides and no prefill
finished between them (a finished request's slot is refilled while the batch
still reports the bucket full, so prefills are counted, :func:`count_prefills`).
Medians are reported per kind of step (draft-off, or the target rows verified)
beside the table's price, so an uneven split that the table prices as an even
one shows up as a gap.

Policies run one after another, and whole runs drift (by up to 13 % between
rounds on the development CPU), so each drafted kind of step is also set
against steps of its own run or round (:func:`paired_ratios`): ``over_own_off``
(the same run's draft-off steps; adaptive has both), ``over_target_only`` (the
same round's target-only steps) and ``table_over_off`` (the table's ratio of
the two prices). ``--overlap both`` runs an engine with schedule overlap and one
without, cell by cell (without it an interval also holds the host's work).
Small differences between policies are better judged in lock-step
(``benchmarks/lockstep.py``).

    python benchmarks/step_intervals.py --table cost-table.json --concurrency 16 --limit 48 --rounds 2 \\
        --output step-intervals.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import load_draft_model, load_models, make_engine, mtbench_chats, policy_labels, set_threads, write_results

from dspark_core.bench.run import CellRecord, run_cell
from dspark_core.plugins import default_hooks
from dspark_core.prompts import read_prompts_jsonl
from dspark_core.table import load_table

POLICIES = {"none": ("none", {}), "fixed-k1": ("fixed", {"k": 1}), "adaptive": ("adaptive", {})}


def steady_intervals(stamps: list[tuple[float, int, int, bool, int]], bucket: int) -> dict[str, list[float]]:
    """Milliseconds between consecutive processed steps with ``bucket`` requests live on both sides and no
    prefill run between them, keyed by the later step's kind (``off``, or ``G<rows>``).
    ``stamps``: (time, live, rows, draft_off, prefills run so far)."""
    out: dict[str, list[float]] = {}
    for before, after in zip(stamps, stamps[1:]):
        if before[1] == bucket and after[1] == bucket and before[4] == after[4]:
            out.setdefault("off" if after[3] else f"G{after[2]}", []).append(1e3 * (after[0] - before[0]))
    return out


def count_prefills(engine) -> list[int]:
    """Count the engine's prefills as they finish (``[n]``, updated in place): a finished request's slot
    is refilled while the batch still reports the bucket full, so live counts alone miss them."""
    done = [0]
    plain = engine.prefill_on_device

    def counted(*args):
        result = plain(*args)
        done[0] += 1
        return result

    engine.prefill_on_device = counted
    return done


def paired_ratios(rows: list[dict]) -> None:
    """Add to every drafted kind of step in ``rows`` (results of :func:`main`) its median over the draft-off
    median of the same row (``over_own_off``, where the row has draft-off steps) and of the same round's
    target-only row (``over_target_only``, where the round ran target-only), and the table's ratio of
    its price to the draft-off price (``table_over_off``)."""
    target_only = {(row["round"], row.get("overlap")): row["steps"].get("off") for row in rows if row["policy"] == "none"}
    for row in rows:
        own_off = row["steps"].get("off")
        same_round = target_only.get((row["round"], row.get("overlap")))
        for kind, step in row["steps"].items():
            if kind == "off":
                continue
            for key, off in (("over_own_off", own_off), ("over_target_only", same_round)):
                if off is not None:
                    step[key] = round(step["median_ms"] / off["median_ms"], 3)
            priced_off = own_off or same_round  # the draft-off price is the bucket's, either way
            if priced_off is not None and step["table_ms"] and priced_off["table_ms"]:
                step["table_over_off"] = round(step["table_ms"] / priced_off["table_ms"], 3)


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
    parser.add_argument("--overlap", default="on", choices=("on", "off", "both"),
                        help="Schedule overlap (as serving runs); `both`: an engine of each, taking turns by cell.")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    names = policy_labels(parser, args.policies, POLICIES)
    if args.threads:
        set_threads(args.threads)
    prompts = (read_prompts_jsonl(args.prompts) if args.prompts else mtbench_chats(args.limit))[:args.limit]
    target, draft = load_models()
    table = load_table(args.table)
    modes = ["on", "off"] if args.overlap == "both" else [args.overlap]
    engines = {}
    for index, mode in enumerate(modes):  # a draft holds the context of the engine built with it: one each
        engines[mode] = make_engine(target, draft if index == 0 else load_draft_model(), table=table,
                                    max_model_len=args.max_model_len, overlap=mode == "on")
        engines[mode].warmup()
    prefills = {mode: count_prefills(engine) for mode, engine in engines.items()}
    hooks = default_hooks()
    fit = table.fit_for(args.max_tokens)
    results = []
    for round_index in range(args.rounds):
        for mode, name in [(mode, name) for mode in modes for name in names]:
            engine = engines[mode]
            policy_name, options = POLICIES[name]
            stamps: list[tuple[float, int, int, bool, int]] = []

            def observe(report, stamps=stamps, done=prefills[mode]) -> None:
                stamps.append((time.perf_counter(), report.live_requests, report.target_rows, report.draft_off, done[0]))

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
            row = {"policy": name, "round": round_index, "overlap": mode,
                   "tokens_per_s": round(tokens / cell.wall_seconds, 2), "steps": steps}
            results.append(row)
            print(row, flush=True)
    for engine in engines.values():
        engine.close()
    paired_ratios(results)
    write_results(args.output, "step_intervals.py", {"table": args.table, "concurrency": args.concurrency,
                  "count": len(prompts), "max_tokens": args.max_tokens, "rounds": args.rounds,
                  "threads": args.threads, "overlap": args.overlap}, results)


if __name__ == "__main__":
    main()
