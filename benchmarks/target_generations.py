"""Greedy answers of the target to ShareGPT prompts, as a generations file (``prompt_ids``/``answer_ids``).

What ``calibrate-confidence`` reads to fit copy-proposal confidences for a draft
that came without its training run's held-out file (the shipped default). A
copy's acceptance depends on the target and its text, not on the draft, so any
prompts the project does not evaluate on will do; ``--skip`` picks them from the
seeded ShareGPT draw that ``train-draft`` uses::

    python benchmarks/target_generations.py --skip 0 --limit 96 --output /tmp/copy-fit.jsonl

``--prompts`` answers a prompts file instead (``heldout_prompts.py`` writes one),
which is how ``answer_store.py`` gets the held-out answers it replays.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip", type=int, default=0, help="Leave out the first N prompts of the draw.")
    parser.add_argument("--prompts", type=Path, default=None,
                        help="Answer the prompts of this JSONL file (the first --limit) instead of the ShareGPT draw.")
    parser.add_argument("--limit", type=int, default=96, help="Prompts to answer.")
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from dspark_core.engine.engine import Engine, EngineConfig
    from dspark_core.engine.request import SamplingParams
    from dspark_core.models.loading import load_target
    from dspark_core.train.data import chat_ids, read_prompts_jsonl, sharegpt_prompts, write_generations

    target = load_target("smollm2")
    if args.prompts is not None:
        prompts = read_prompts_jsonl(args.prompts)[args.skip : args.skip + args.limit]
    else:
        prompts = sharegpt_prompts(limit=args.skip + args.limit)[args.skip :]
    ids = [chat_ids(target.tokenizer, p) for p in prompts]
    engine = Engine(target, None, EngineConfig(draft_width=1, policy="none", request_buckets=(1, 2, 4, 8, 16),
                                               max_model_len=max(map(len, ids)) + args.max_tokens + 16))
    try:
        outputs = engine.generate(ids, SamplingParams(max_tokens=args.max_tokens))
    finally:
        engine.close()
    write_generations(args.output, ids, [list(o.token_ids) for o in outputs])
    print(f"wrote {len(ids)} greedy answers ({sum(len(o.token_ids) for o in outputs)} tokens) to {args.output}")


if __name__ == "__main__":
    main()
