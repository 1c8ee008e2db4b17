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
meaningful there.) Second mode, speed in lock-step: ``lockstep`` runs
``benchmarks/lockstep.py`` with its arguments, and every engine whose label
ends in ``-copy`` (from ``--variants``) gets the copies, each copied token with
the confidence ``COPY_CONFIDENCE``::

    python benchmarks/copy_proposals_prototype.py lockstep --prompts heldout-48-59.jsonl --concurrency 1 \
        --widths 3 --table benchmarks/results/avx2/bench-k7/cost-table.json --threads 1 \
        --variants '{"adaptive-copy": ["adaptive", {}], "fixed-k3-copy": ["fixed", {"k": 3}]}' \
        --output benchmarks/results/draft-difficulty/lockstep-copy-c1.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from common import write_report
from draft_difficulty import last_match_continuation  # benchmarks/ is this script's directory


#: Confidence of a copied token in lock-step mode: the precision of a 2-token copy's first token,
#: teacher forced on held-out prompts 0-47 (0.79; results/draft-difficulty/heldout-48.json).
COPY_CONFIDENCE = 0.8


def with_copy_prefix(engine, order: int, counts: dict, confidence: float | None = None) -> None:
    """Wrap ``engine.runner``'s eager block so that copies replace the first drafted tokens (and,
    with ``confidence``, their confidences)."""
    runner = engine.runner
    drafted = runner._draft_block

    def block(anchors: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor):
        tokens, confidences = drafted(anchors, positions, slots)
        running = {r.slot for r in engine.scheduler.running}
        tokens, confidences = tokens.clone(), confidences.clone()
        for b, slot in enumerate(slots.tolist()):
            if slot not in running:
                continue  # bucket padding
            history = runner.storage.history[slot, : int(runner.storage.seq_len[slot])].tolist()  # prompt + output
            assert history[-1] == int(anchors[b]), "the anchor is not the last committed token"
            prefix = last_match_continuation(history, len(history) - 1, order, tokens.shape[1]) or []
            counts["blocks"] += 1
            if prefix:
                counts["copied"] += 1
                tokens[b, : len(prefix)] = torch.tensor(prefix, dtype=tokens.dtype)
                if confidence is not None:
                    confidences[b, : len(prefix)] = confidence
        return tokens, confidences

    runner._draft_block = block


def lockstep_main(argv: list[str]) -> None:
    """``benchmarks/lockstep.py`` with ``argv``; engines labelled ``*-copy`` get 2-token copies."""
    import lockstep  # benchmarks/ is this script's directory, so it is on sys.path

    counts: dict[str, dict] = {}
    build = lockstep.side_by_side_engines

    def engines_with_copies(*a, **k):
        engines = build(*a, **k)
        for label, engine in engines.items():
            if label.endswith("-copy"):
                counts[label] = {"blocks": 0, "copied": 0}
                with_copy_prefix(engine, 2, counts[label], COPY_CONFIDENCE)
        return engines

    lockstep.side_by_side_engines = engines_with_copies
    sys.argv = ["lockstep.py", *argv]
    lockstep.main()
    print(json.dumps({"copied_blocks": counts}))


def main() -> None:
    if sys.argv[1:2] == ["lockstep"]:
        lockstep_main(sys.argv[2:])
        return
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
    write_report(args.output, report)


if __name__ == "__main__":
    main()
