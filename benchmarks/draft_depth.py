"""What cutting the draft's block costs and saves (``--draft_depths``), depth by depth.

Two measurements with the shipped SmolLM2 draft:

* **time**: one proposal (``DSparkDraft.propose``) for 1 to 16 requests whose contexts hold 300 random
  target states, at every depth from 1 to K, depths alternating inside every round (median over rounds);
* **acceptance** (``--prompts``): the real engine at full width of each depth (``policy="fixed"``,
  greedy, copy proposals off, so only the draft's tokens are verified), on held-out prompts: the
  survival of every position, which shows whether a cut block's first tokens are accepted as often
  as the whole block's.

    python benchmarks/draft_depth.py --prompts heldout.jsonl --limit 48 --output draft-depth.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import load_models, set_threads, write_results

from dspark_core.prompts import read_prompts_jsonl
from dspark_core.train.evaluate import engine_acceptance

CONTEXT = 300


def proposal_times(target, draft, requests: list[int], rounds: int, reps: int) -> dict[tuple[int, int], float]:
    """Median milliseconds of one proposal per (requests, depth)."""
    width = draft.config.num_speculative_tokens
    slots = max(requests)
    draft.bind_target(target)
    draft.allocate_context(slots, CONTEXT + width + 1)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(slots * CONTEXT, draft.fc.in_features, generator=generator)
    draft.extend_context(hidden, torch.arange(CONTEXT).repeat(slots), torch.arange(slots).repeat_interleave(CONTEXT))
    anchors = torch.randint(0, target.config.vocab_size, (slots,), generator=generator)
    positions, slot_ids = torch.full((slots,), CONTEXT), torch.arange(slots)
    samples: dict[tuple[int, int], list[float]] = {}
    with torch.inference_mode():
        for round_index in range(rounds):
            depths = list(range(1, width + 1))
            for depth in depths if round_index % 2 == 0 else depths[::-1]:
                for n in requests:
                    args = (anchors[:n], positions[:n], slot_ids[:n])
                    draft.propose(*args, depth=depth)
                    started = time.perf_counter()
                    for _ in range(reps):
                        draft.propose(*args, depth=depth)
                    samples.setdefault((n, depth), []).append((time.perf_counter() - started) / reps * 1e3)
    return {key: statistics.median(values) for key, values in samples.items()}


def acceptance(target, draft, ids: list[list[int]], depths: list[int], max_tokens: int) -> list[dict]:
    """Per depth: τ and survival by position at full width (prompts as token ids), the block cut to that depth."""
    original = draft.propose
    rows = []
    for depth in depths:
        draft.propose = lambda a, p, s, depth=depth: original(a, p, s, depth=depth)  # noqa: E731
        try:
            result = engine_acceptance(target, draft, ids, width=draft.config.num_speculative_tokens,
                                       max_tokens=max_tokens, copy_proposals="off")
        finally:
            del draft.propose
        rows.append({"depth": depth, "tau": round(result["tau"], 4), "steps": result["steps"],
                     "survival_by_position": [round(x, 4) for x in result["survival_by_position"][:depth]]})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="1,4,8,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", default=None, help="JSONL prompts for the acceptance part (held-out, not MT-Bench).")
    parser.add_argument("--limit", type=int, default=48)
    parser.add_argument("--max_tokens", type=int, default=96)
    parser.add_argument("--depths", default="7,4,2,1", help="Depths whose acceptance is measured.")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    set_threads(args.threads)
    target, draft = load_models()
    requests = [int(n) for n in args.requests.split(",")]
    times = proposal_times(target, draft, requests, args.rounds, args.reps)
    results = []
    for n in requests:
        row = {"requests": n, **{f"depth_{d}_ms": round(times[(n, d)], 2) for d in range(1, draft.config.num_speculative_tokens + 1)}}
        results.append(row)
        print(row, flush=True)
    accepted = []
    if args.prompts:
        chats = read_prompts_jsonl(args.prompts)[: args.limit]
        ids = [target.tokenizer.encode(target.tokenizer.apply_chat_template(chat)) for chat in chats]
        accepted = acceptance(target, draft, ids, [int(d) for d in args.depths.split(",")], args.max_tokens)
    write_results(args.output, "draft_depth.py", {"context": CONTEXT, "rounds": args.rounds, "reps": args.reps,
                  "threads": torch.get_num_threads(), "prompts": args.prompts, "limit": args.limit,
                  "max_tokens": args.max_tokens, "acceptance": accepted}, results)


if __name__ == "__main__":
    main()
