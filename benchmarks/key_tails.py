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
import time

import torch
from common import cpu_draft_dtype, load_models, set_threads, side_by_side_engines, write_results

from dspark_core.engine.request import SamplingParams
from dspark_core.models import attention
from dspark_core.prompts import read_prompts_jsonl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", required=True, help="JSONL prompts (held-out ShareGPT, not MT-Bench).")
    parser.add_argument("--limit", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--table", required=True, help="A saved cost table (prices the adaptive engines).")
    parser.add_argument("--draft_depths", default="full")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    set_threads(args.threads)
    accepted = attention.invariant_key_tails()
    in_use = [accepted]
    # invariant_kv_length asks for the tails at every forward: switch them per engine turn
    attention.invariant_key_tails = lambda: in_use[0]  # type: ignore[assignment]
    target, _ = load_models(None)
    policies = {"none": ("none", {}), "fixed-k1": ("fixed", {"k": 1}), "adaptive": ("adaptive", {})}
    specs = {f"{label}@{reads}": spec for label, spec in policies.items() for reads in ("whole", "tails")}
    engines = side_by_side_engines(target, specs, table_path=args.table, draft_dtype=getattr(torch, cpu_draft_dtype("auto")),
                                   max_model_len=2048, draft_depths=args.draft_depths)
    prompts = read_prompts_jsonl(args.prompts)[: args.limit]
    params = SamplingParams(max_tokens=args.max_tokens)
    queues = {label: list(enumerate(prompts)) for label in engines}
    live, seconds = dict.fromkeys(engines, 0), dict.fromkeys(engines, 0.0)
    order: dict[str, dict[str, int]] = {label: {} for label in engines}
    outputs: dict[str, dict[int, tuple[int, ...]]] = {label: {} for label in engines}
    for label, engine in engines.items():
        in_use[0] = () if label.endswith("@whole") else accepted
        engine.generate(prompts[:1], SamplingParams(max_tokens=4))  # first-call costs, not measured
    while any(queues[label] or live[label] for label in engines):
        for label, engine in engines.items():
            if not (queues[label] or live[label]):
                continue
            in_use[0] = () if label.endswith("@whole") else accepted
            while live[label] < args.concurrency and queues[label]:
                index, prompt = queues[label].pop(0)
                order[label][engine.add_request(prompt, params).request_id] = index
                live[label] += 1
            started = time.perf_counter()
            finished = engine.step()
            seconds[label] += time.perf_counter() - started
            for output in finished:
                outputs[label][order[label][output.request_id]] = output.token_ids
                live[label] -= 1
    results = []
    for label in engines:
        tokens = sum(len(ids) for ids in outputs[label].values())
        policy, reads = label.split("@")
        rate = tokens / seconds[label]
        whole = f"{policy}@whole"
        row = {"policy": label, "tokens": tokens, "seconds": round(seconds[label], 2), "tokens_per_s": round(rate, 2),
               "vs_whole_blocks": round(rate / (sum(len(i) for i in outputs[whole].values()) / seconds[whole]), 3),
               "identical": outputs[label] == outputs["none@whole"]}
        results.append(row)
        print(row, flush=True)
    write_results(args.output, "key_tails.py", {
        "prompts": args.prompts, "count": len(prompts), "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "table": args.table, "draft_depths": args.draft_depths, "threads": args.threads, "key_tails": list(accepted),
        "torch_threads": torch.get_num_threads()}, results)


if __name__ == "__main__":
    main()
