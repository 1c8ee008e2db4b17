"""Short last key blocks against whole ones: the same policies, side by side in one process.

A batch-invariant CPU forward reads whole blocks of 512 keys, or a shorter last block where this
CPU's check accepts its length (``attention.invariant_key_tails``). The check runs once per
process, so this script runs every policy twice, once reading whole blocks only (``@whole``) and
once with the tails this CPU accepts (``@tails``), the engines taking turns one ``step()`` at a
time as in ``lockstep.py``. Outputs must be identical across all of them (greedy, batch-invariant).

    python benchmarks/key_tails.py --prompts /tmp/sharegpt-heldout.jsonl --limit 48 --concurrency 16 \\
        --table benchmarks/results/amx/k7/cost-table.json --draft_depths 4:4,8:4,16:2 --output key-tails.json
"""

from __future__ import annotations

import argparse

import torch
from common import (cpu_draft_dtype, decode_in_turns, load_models, paired_rows, set_threads, side_by_side_engines,
                    write_results)

from dspark_core.models import attention
from dspark_core.prompts import read_prompts_jsonl

POLICIES = {"none": ("none", {}), "fixed-k1": ("fixed", {"k": 1}), "adaptive": ("adaptive", {})}


def pair_arguments(description: str) -> argparse.ArgumentParser:
    """The options this script shares with ``padding_rows.py``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--prompts", required=True, help="JSONL prompts (held-out ShareGPT, not MT-Bench).")
    parser.add_argument("--limit", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--table", required=True, help="A saved cost table (prices the adaptive engines).")
    parser.add_argument("--draft_depths", default="full")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None)
    return parser


def paired_engines(args: argparse.Namespace, variants: tuple[str, str], policies: dict | None = None):
    """Every policy of ``policies`` (default :data:`POLICIES`) once per variant (labels ``policy@variant``),
    on one target."""
    target, _ = load_models(None)
    specs = {f"{label}@{variant}": spec for label, spec in (policies or POLICIES).items() for variant in variants}
    return side_by_side_engines(target, specs, table_path=args.table, draft_dtype=getattr(torch, cpu_draft_dtype("auto")),
                                max_model_len=2048, draft_depths=args.draft_depths)


def main() -> None:
    args = pair_arguments(__doc__.splitlines()[0]).parse_args()
    set_threads(args.threads)
    accepted = attention.invariant_key_tails()
    in_use = [accepted]
    # invariant_kv_length asks for the tails at every forward: switch them per engine turn
    attention.invariant_key_tails = lambda: in_use[0]  # type: ignore[assignment]
    engines = paired_engines(args, ("whole", "tails"))
    prompts = read_prompts_jsonl(args.prompts)[: args.limit]

    def reads_for(label: str) -> None:
        in_use[0] = () if label.endswith("@whole") else accepted

    outputs, seconds = decode_in_turns(engines, prompts, args.concurrency, args.max_tokens, reads_for)
    results = paired_rows(outputs, seconds, "whole", "none@whole")
    write_results(args.output, "key_tails.py", {
        "prompts": args.prompts, "count": len(prompts), "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "table": args.table, "draft_depths": args.draft_depths, "threads": args.threads, "key_tails": list(accepted)},
        results)


if __name__ == "__main__":
    main()
