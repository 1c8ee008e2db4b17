"""Policies side by side on one workload, one engine step at a time.

Every policy gets its own engine (sharing the target's weights; each has its
own draft, whose context cache is per instance) and
its own copy of the same prompt queue; at most ``--concurrency`` requests run
in each, and a finished request is replaced by the next prompt, as in a
server. The engines take turns one ``step()`` at a time, in an order shuffled
every turn (``common.decode_in_turns``), without schedule overlap, so each step's
whole work, prefill included, lands inside its own call and a burst of machine
noise falls on every policy alike. Throughput is
output tokens over the summed wall time of the policy's own steps.

This answers "is policy A faster than B on this workload" far more steadily
than ``dspark-core bench`` on a shared CPU, whose rounds run policies one
after another (its figures move by ±8 % between rounds here). It does not
measure what overlap buys, and a policy's first token waits for the other
engines' turns, so it reports no latency.

    python benchmarks/lockstep.py --prompts /path/heldout.jsonl --concurrency 4 \\
        --table benchmarks/results/draft-long/k7/cost-table.json --output lockstep.json

Each row also splits the policy's step times by kind (draft-off or drafted, all ``--concurrency``
requests live or fewer, with or without a prefill in the same call), so a policy's draft-off steps can
be set against target-only's steps directly; ``--by_shape`` also names a drafted step's target rows and
whether its requests verified equal numbers of tokens. ``--tiers all_tiers`` captures every legal row count
instead of the bucket multiples ``make serve`` uses (its table must then be calibrated with
``--captured_target_rows=all``).

``--also_dtype bfloat16 --also_table PATH`` runs every policy a second time on a target in that dtype
(labels ``<policy>@bfloat16``, priced by its own table), in the same turns: which dtype serves faster,
measured side by side. Each policy's output is checked against target-only decoding in its own dtype;
``vs_target_only`` compares with the first dtype's target-only rate, ``vs_own_target_only`` with its own.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from common import (add_draft_dtype_argument, cpu_draft_dtype, decode_in_turns, load_models, mtbench_chats,
                    policy_specs, set_threads, side_by_side_engines, write_results)

from dspark_core.prompts import read_prompts_jsonl


def step_kind(new_reports: list, concurrency: int, admitted: bool, by_shape: bool = False) -> str:
    """Name one ``step()`` call by what it did, so step times can be compared kind by kind across policies.

    ``full`` means the decode ran with ``concurrency`` live requests (the steady state), ``partial`` with
    fewer; ``+prefill`` marks a call that also admitted prompts, whose prefill lands in the same call.
    With ``by_shape`` a drafted or copy step also names its target rows and whether its live requests
    verified equal numbers of tokens (``-32r-even``), so that steps of equal rows but another split
    can be set side by side."""
    if len(new_reports) != 1:
        kind = "no-decode" if not new_reports else "several"
    else:
        report = new_reports[0]
        size = "full" if report.live_requests == concurrency else "partial"
        kind = f"{'draft-off' if report.draft_off else 'drafted'}-{size}"
        if by_shape and not report.draft_off:
            lengths = [max(n, 0) for n in report.verify_lengths[: report.live_requests]]
            kind += f"-{report.target_rows}r-{'even' if len(set(lengths)) <= 1 else 'uneven'}"
    return kind + ("+prefill" if admitted else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default=None, help="JSONL prompts (`prompt` or `messages`); default MT-Bench first turns.")
    parser.add_argument("--limit", type=int, default=None, help="Use only the first N prompts.")
    parser.add_argument("--concurrency", type=int, default=4, help="Requests running at once in every engine.")
    parser.add_argument("--max_tokens", type=int, default=128, help="Output tokens per request (greedy).")
    parser.add_argument("--width", type=int, default=7, help="Draft width K.")
    parser.add_argument("--widths", default="1,3", help="Fixed widths k to run beside target-only.")
    parser.add_argument("--table", default=None, help="A saved cost table (a bench's cost-table.json): adds `adaptive`.")
    parser.add_argument("--variants", default="{}",
                        help='JSON {"label": ["adaptive", {options}]}: more priced policies beside `adaptive`.')
    parser.add_argument("--other_tables", default="{}",
                        help='JSON {"label": "path"}: more `adaptive` engines, each priced by its own saved table.')
    parser.add_argument("--draft_depths", default="full",
                        help="Tokens the draft proposes per bucket in every engine: `full` or bucket:depth pairs (as the "
                             "serve flag; its `auto` is the CPU's 4:4,8:4,16:2).")
    parser.add_argument("--label_depths", default="{}",
                        help='JSON {"label": "bucket:depth,..."}: a label\'s engine proposes that many tokens instead.')
    add_draft_dtype_argument(parser)
    parser.add_argument("--tiers", default="bucket_multiples", choices=("bucket_multiples", "all_tiers"),
                        help="Captured target-row tiers of every engine (`all_tiers`: every legal row count).")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="Target dtype (a bfloat16 target runs batch-invariant forwards on the CPU); price it with a "
                             "--table calibrated in the same dtype.")
    parser.add_argument("--also_dtype", default=None, choices=("float32", "bfloat16"),
                        help="Run every policy on a second target in this dtype too (labels `<policy>@<dtype>`).")
    parser.add_argument("--also_table", default=None, help="The --also_dtype target's cost table (same dtype).")
    parser.add_argument("--max_model_len", type=int, default=2048,
                        help="Longest prompt + output of a request; every engine zero-fills a KV cache this long per slot.")
    parser.add_argument("--by_shape", action="store_true",
                        help="Split drafted step kinds further by target rows and even or uneven split.")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if args.also_dtype is not None and args.also_dtype == args.dtype:
        parser.error(f"--also_dtype must differ from --dtype ({args.dtype})")
    if (args.also_table is not None) != (args.also_dtype is not None and args.table is not None):
        parser.error("--also_table goes with --also_dtype and --table (each dtype priced by a table of its own)")
    if args.concurrency < 1:
        parser.error(f"--concurrency must be at least 1, got {args.concurrency}")
    if args.max_model_len < 1:
        parser.error(f"--max_model_len must be at least 1, got {args.max_model_len}")
    try:
        variants = json.loads(args.variants)
    except json.JSONDecodeError as exc:
        parser.error(f"--variants is not JSON: {exc}")
    try:
        other_tables = json.loads(args.other_tables)
    except json.JSONDecodeError as exc:
        parser.error(f"--other_tables is not JSON: {exc}")
    try:
        label_depths = json.loads(args.label_depths)
    except json.JSONDecodeError as exc:
        parser.error(f"--label_depths is not JSON: {exc}")
    if other_tables and args.table is None:
        parser.error("--other_tables needs --table (the tables are compared with `adaptive`'s)")
    set_threads(args.threads)
    args.draft_dtype = cpu_draft_dtype(args.draft_dtype)
    specs = policy_specs([int(k) for k in args.widths.split(",") if k], args.table is not None, variants)
    specs.update({label: ("adaptive", {}) for label in other_tables})
    prompts = read_prompts_jsonl(args.prompts) if args.prompts else mtbench_chats(80)
    prompts = prompts[: args.limit] if args.limit else prompts

    target, _ = load_models(None, target_dtype=getattr(torch, args.dtype))
    engines = side_by_side_engines(target, specs, table_path=args.table, draft_dtype=getattr(torch, args.draft_dtype),
                                   label_tables=other_tables, label_depths=label_depths, width=args.width,
                                   max_model_len=args.max_model_len, tiers=args.tiers, draft_depths=args.draft_depths)
    own_reference = {label: "none" for label in engines}  # the target-only run of the label's own dtype
    if args.also_dtype is not None:
        also_target, _ = load_models(None, target_dtype=getattr(torch, args.also_dtype))
        also = side_by_side_engines(also_target, specs, table_path=args.also_table,
                                    draft_dtype=getattr(torch, args.draft_dtype), width=args.width,
                                    max_model_len=args.max_model_len, tiers=args.tiers, draft_depths=args.draft_depths)
        for label, engine in also.items():
            engines[f"{label}@{args.also_dtype}"] = engine
            own_reference[f"{label}@{args.also_dtype}"] = f"none@{args.also_dtype}"
    specs = {label: specs[label.split("@")[0]] for label in engines}
    reports: dict[str, list] = {label: [] for label in specs}  # every step's report, the first-call ones too
    measured: dict[str, list] = {label: [] for label in specs}  # the reports of the measured steps
    step_times: dict[str, dict[str, list[float]]] = {label: {} for label in specs}  # kind → seconds per step()
    for label, engine in engines.items():
        engine.add_observer(reports[label].append)
    cursor = dict.fromkeys(engines, 0)

    def before_step(label: str) -> None:
        cursor[label] = len(reports[label])

    def after_step(label: str, elapsed: float, admitted: bool) -> None:
        new_reports = reports[label][cursor[label]:]
        measured[label].extend(new_reports)
        kind = step_kind(new_reports, args.concurrency, admitted, args.by_shape)
        step_times[label].setdefault(kind, []).append(elapsed)

    token_ids, seconds = decode_in_turns(engines, prompts, args.concurrency, args.max_tokens, before_step, after_step)

    def rate(label: str) -> float:
        return sum(len(ids) for ids in token_ids[label]) / seconds[label]

    results = []
    for label in engines:
        tokens = sum(len(ids) for ids in token_ids[label])
        steps = measured[label]
        row = {"policy": label, "tokens": tokens, "seconds": round(seconds[label], 2),
               "tokens_per_s": round(tokens / seconds[label], 2),
               "vs_target_only": round(rate(label) / rate("none"), 3),
               "vs_own_target_only": round(rate(label) / rate(own_reference[label]), 3),
               "decode_steps": len(steps),
               "rows_per_request": round(sum(r.target_rows for r in steps) / max(1, sum(r.live_requests for r in steps)), 2),
               "identical": token_ids[label] == token_ids[own_reference[label]],
               "step_ms": {kind: {"steps": len(times), "median": round(1000 * statistics.median(times), 2),
                                  "mean": round(1000 * statistics.fmean(times), 2)}
                           for kind, times in sorted(step_times[label].items())}}
        results.append(row)
        print(row, flush=True)
    write_results(args.output, "lockstep.py", {
        "prompts": args.prompts or "mt-bench", "count": len(prompts), "concurrency": args.concurrency,
        "max_tokens": args.max_tokens, "width": args.width, "table": args.table, "variants": variants, "other_tables": other_tables,
        "threads": args.threads, "by_shape": args.by_shape, "tiers": args.tiers, "draft_depths": args.draft_depths, "label_depths": label_depths, "max_model_len": args.max_model_len, "draft_dtype": args.draft_dtype,
        "dtype": args.dtype, "also_dtype": args.also_dtype, "also_table": args.also_table}, results)


if __name__ == "__main__":
    main()
