"""Prototype measurement: the shipped draft's blocks with a copy (prompt-lookup) prefix, in the real engine.

Not a product feature. For every block it drafts, the engine's runner here also
looks for the latest earlier occurrence, in the request's prompt and committed
output, of its last ``--order`` tokens; where there is one, the tokens that
followed it replace the first drafted tokens (as many as were already written,
up to K). Everything else is the product's engine at full width K (fixed
policy), so the target still verifies every token: the greedy output must stay
identical, and the script checks it against a draft-only run of the same
prompts made in the same process, before or after (``--rounds`` alternates them).

    python benchmarks/copy_proposals_prototype.py --prompts heldout.jsonl --limit 48 --order 2 \\
        --output benchmarks/results/draft-difficulty/engine-copy-48.json

(Confidences are the draft's own for every position, so only full width is
meaningful here; the adaptive policy would need confidences for copied tokens.)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def copy_prefix(history: list[int], order: int, width: int) -> list[int]:
    """What followed the latest earlier occurrence of ``history``'s last ``order`` tokens (at most
    ``width`` tokens, only ones already in ``history``); empty when there is none."""
    p = len(history) - 1
    key = history[p - order + 1 :]
    for j in range(p - 1, order - 2, -1):
        if history[j - order + 1 : j + 1] == key:
            return history[j + 1 : min(j + 1 + width, p + 1)]
    return []


def with_copy_prefix(engine, order: int, counts: dict) -> None:
    """Wrap ``engine.runner``'s eager block so that copies replace the first drafted tokens."""
    runner = engine.runner
    drafted = runner._draft_block

    def block(anchors: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor):
        tokens, confidences = drafted(anchors, positions, slots)
        prompts = {r.slot: r.prompt for r in engine.scheduler.running}
        tokens = tokens.clone()
        for b, slot in enumerate(slots.tolist()):
            if slot not in prompts:
                continue  # bucket padding
            written = runner.storage.output_tokens[slot, : int(runner.storage.output_lengths[slot])].tolist()
            history = prompts[slot] + written
            assert history[-1] == int(anchors[b]), "the anchor is not the last committed token"
            prefix = copy_prefix(history, order, tokens.shape[1])
            counts["blocks"] += 1
            if prefix:
                counts["copied"] += 1
                tokens[b, : len(prefix)] = torch.tensor(prefix, dtype=tokens.dtype)
        return tokens, confidences

    runner._draft_block = block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=Path, required=True, help="JSONL prompts (held-out, never MT-Bench).")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--limit", type=int, default=48)
    parser.add_argument("--order", type=int, default=2)
    parser.add_argument("--width", type=int, default=7)
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from dspark_core.engine import engine as engine_module
    from dspark_core.models.drafts import resolve_draft_path
    from dspark_core.models.loading import load_target
    from dspark_core.models.speculators_io import load_draft
    from dspark_core.train import evaluate
    from dspark_core.train.data import chat_ids, read_prompts_jsonl

    target = load_target("smollm2")
    draft = load_draft(resolve_draft_path("default", "smollm2")).bind_target(target)
    prompts = read_prompts_jsonl(args.prompts)[args.start : args.start + args.limit]
    ids = [chat_ids(target.tokenizer, p) for p in prompts]
    counts = {"blocks": 0, "copied": 0}
    plain = engine_module.Engine

    class CopyingEngine(plain):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            with_copy_prefix(self, args.order, counts)

    runs = {}
    for name in ("draft", f"copy-{args.order}+draft"):
        engine_module.Engine = plain if name == "draft" else CopyingEngine  # engine_acceptance builds its own
        try:
            started = time.perf_counter()
            result = evaluate.engine_acceptance(target, draft, ids, width=args.width, max_tokens=args.max_tokens)
            result["seconds"] = round(time.perf_counter() - started, 1)
        finally:
            engine_module.Engine = plain
        runs[name] = result
    outputs = [r.pop("outputs") for r in runs.values()]
    report = {"prompts": str(args.prompts), "start": args.start, "limit": args.limit, "width": args.width,
              "order": args.order, "copied_blocks": counts, "identical_outputs": outputs[0] == outputs[1],
              "runs": runs}
    text = json.dumps(report, indent=1)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
