"""Replay greedy answers to ask what copies from *other* answers would add to copy proposals.

The engine copies only from the request's own prompt and output
(:mod:`dspark_kernels.copy_lookup`). A store of the target's earlier answers
(suffix-decoding style: answers to training-side prompts, or to earlier
requests) could propose where the request's own text has no match. This
script replays target-only greedy answers step by step at width K:

- where the request's own history has a match (keys as the engine's), the
  copy is proposed and its accepted run committed, plus the bonus token;
- else, with a store, the store's longest matching key proposes the most
  frequent continuation among the store's occurrences, token by token;
- else the position is a draft position, committed one token at a time here
  and priced at ``--draft_tau`` committed tokens per step (the draft's real
  engine τ on the same prompts with copies off: ``eval-draft --copy_proposals off``).

Estimated τ = committed tokens / (copy steps + draft positions / draft_tau).
With no store it reproduces the real engine's τ with copies (2026-12-07: 2.539
estimated against 2.545 measured, 80 held-out prompts, K = 7). ::

    python benchmarks/heldout_prompts.py /tmp/heldout.jsonl --count 80 --training_prompts 10728
    python benchmarks/target_generations.py --prompts /tmp/heldout.jsonl --limit 80 --output /tmp/heldout-gen.jsonl
    python benchmarks/target_generations.py --skip 0 --limit 480 --output /tmp/store-gen.jsonl
    python benchmarks/answer_store.py /tmp/heldout-gen.jsonl --store /tmp/store-gen.jsonl --sizes 60,120,240,480
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from pathlib import Path

from dspark_core.engine.copies import DEFAULT_COPY_ORDERS
from dspark_core.train.data import read_generations
from dspark_kernels.copy_lookup import copy_lookup_reference


class AnswerStore:
    """Every key of the given lengths in a set of answers, with where it occurred."""

    def __init__(self, orders: tuple[int, ...], min_count: int = 1) -> None:
        self.orders = tuple(sorted(orders, reverse=True))
        self.min_count = min_count
        self.answers: list[list[int]] = []
        self.occurrences: dict[int, dict[tuple[int, ...], list[tuple[int, int]]]] = {o: defaultdict(list) for o in self.orders}

    def add(self, answer: list[int]) -> None:
        index = len(self.answers)
        self.answers.append(answer)
        for order in self.orders:
            for end in range(order - 1, len(answer) - 1):
                self.occurrences[order][tuple(answer[end - order + 1 : end + 1])].append((index, end))

    def propose(self, tokens: list[int], width: int) -> list[int]:
        """Up to ``width`` tokens after the longest stored key that ends ``tokens``: at each place the
        continuation most of the remaining occurrences agree on (those that disagree drop out)."""
        for order in self.orders:
            found = self.occurrences[order].get(tuple(tokens[-order:])) if len(tokens) >= order else None
            if not found:
                continue
            proposal: list[int] = []
            for offset in range(1, width + 1):
                votes = Counter(self.answers[a][end + offset] for a, end in found if end + offset < len(self.answers[a]))
                if not votes or votes.most_common(1)[0][1] < self.min_count:
                    break
                token = votes.most_common(1)[0][0]
                proposal.append(token)
                found = [(a, end) for a, end in found
                         if end + offset < len(self.answers[a]) and self.answers[a][end + offset] == token]
            if proposal:
                return proposal
        return []


def replay(rows: list[tuple[list[int], list[int]]], width: int, store: AnswerStore | None,
           orders: tuple[int, ...] = DEFAULT_COPY_ORDERS) -> Counter:
    """Steps and committed tokens by source (own copy, store copy) and draft positions."""
    counts: Counter = Counter()
    for prompt, answer in rows:
        position = 1  # the first answer token comes from the prefill
        while position < len(answer):
            history = prompt + answer[:position]
            proposal, order = copy_lookup_reference(history, orders, width)
            source = "own"
            if order is None and store is not None:
                proposal, source = store.propose(history, width), "store"
            if not proposal:
                counts["draft positions"] += 1
                position += 1
                continue
            accepted = 0
            while accepted < len(proposal) and position + accepted < len(answer) \
                    and proposal[accepted] == answer[position + accepted]:
                accepted += 1
            committed = min(accepted + 1, len(answer) - position)
            counts[f"{source} steps"] += 1
            counts[f"{source} tokens"] += committed
            position += committed
    return counts


def estimated_tau(counts: Counter, draft_tau: float) -> float:
    steps = counts["own steps"] + counts["store steps"] + counts["draft positions"] / draft_tau
    return (counts["own tokens"] + counts["store tokens"] + counts["draft positions"]) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("answers", type=Path, help="Generations file of the answers to replay (prompt_ids/answer_ids).")
    parser.add_argument("--store", type=Path, help="Generations file whose answers fill the store.")
    parser.add_argument("--sizes", default="", help="Store sizes to try (first N answers), comma separated; default all.")
    parser.add_argument("--store_orders", default="6", help="Key lengths the store matches, comma separated.")
    parser.add_argument("--min_count", type=int, default=1, help="Occurrences a store continuation needs.")
    parser.add_argument("--width", type=int, default=7)
    parser.add_argument("--draft_tau", type=float, default=1.93,
                        help="The draft's engine tau with copies off on these prompts (1.93: the shipped draft, "
                             "80 held-out prompts, K = 7).")
    args = parser.parse_args()
    rows = read_generations(args.answers)
    store_rows = read_generations(args.store) if args.store else []
    orders = tuple(int(o) for o in args.store_orders.split(","))
    sizes = [int(s) for s in args.sizes.split(",") if s] or ([len(store_rows)] if store_rows else [])
    base = estimated_tau(replay(rows, args.width, None), args.draft_tau)
    print(f"own copies only: estimated tau {base:.3f}")
    for size in sizes:
        store = AnswerStore(orders, args.min_count)
        for _, answer in store_rows[:size]:
            store.add(answer)
        counts = replay(rows, args.width, store)
        tau = estimated_tau(counts, args.draft_tau)
        print(f"store of {size} answers, keys {orders}: estimated tau {tau:.3f} ({tau / base - 1:+.1%}); "
              f"store steps {counts['store steps']} committing {counts['store tokens'] / max(1, counts['store steps']):.2f}, "
              f"own steps {counts['own steps']}, draft positions {counts['draft positions']}")


if __name__ == "__main__":
    main()
