"""``dspark-core train-draft``: train a DSpark draft for a frozen target (see docs/draft-training.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "train-draft"
HELP = "Train a DSpark draft on on-policy target answers to ShareGPT prompts (cached features, resumable)."


def _layers(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--target", default="smollm2", help="Target GGUF file, HF directory or alias. Default: smollm2.")
    a("--output", default="draft-run", help="Run directory: checkpoint.pt, heldout.jsonl, draft/ (the result). Default: draft-run.")
    a("--prompts", type=int, default=900, help="ShareGPT prompts to answer with the target (train + held-out). Default: 900.")
    a("--heldout", type=int, default=64, help="Last N generations kept out of training (for calibrate-confidence). Default: 64.")
    a("--max_tokens", type=int, default=128, help="Answer length cap for the on-policy generations. Default: 128.")
    a("--gen_batch", type=int, default=16, help="Concurrent requests while generating. Default: 16.")
    a("--layers", type=int, default=1, help="Draft decoder layers. Default: 1.")
    a("--block_size", type=int, default=7, help="Block size (= proposals K, sample_from_anchor). Default: 7.")
    a("--draft_vocab", type=int, default=24576, help="Draft vocabulary size (most frequent on-policy tokens). Default: 24576.")
    a("--markov_rank", type=int, default=64, help="Markov head rank (0 = none). Default: 64.")
    a("--markov_type", choices=("vanilla", "gated", "rnn"), default="vanilla", help="Markov head variant. Default: vanilla.")
    a("--aux_layers", type=_layers, default=None, help="Target hidden-state ids for KV injection, e.g. 2,15,28. Default: low/middle/high.")
    a("--topk", type=int, default=16, help="Teacher top-k probabilities cached per position. Default: 16.")
    a("--features_dir", default=None, help="Feature cache directory. Default: ~/.cache/dspark-core/features.")
    a("--steps", type=int, default=1000, help="Optimizer steps. Default: 1000.")
    a("--seqs_per_step", type=int, default=8, help="Sequences per step. Default: 8.")
    a("--anchors_per_seq", type=int, default=24, help="Random anchors (blocks) per sequence. Default: 24.")
    a("--lr", type=float, default=6e-4, help="Peak learning rate (warmup then cosine). Default: 6e-4.")
    a("--save_every", type=int, default=100, help="Checkpoint interval in steps. Default: 100.")
    a("--max_minutes", type=float, default=0.0, help="Stop training early after this many minutes (0 = run all steps).")
    a("--head_dtype", choices=("float32", "bfloat16"), default="bfloat16", help="Dtype of the frozen LM-head product while training. Default: bfloat16.")
    a("--seed", type=int, default=0, help="Seed for prompt choice, init, order and anchors. Default: 0.")
    a("--threads", type=int, default=1, help="Torch CPU threads. Default: 1.")
    a("--tiny", action="store_true", help="Seconds-long smoke run on a random tiny target (no downloads).")
    a("--no_progress", action="store_true", help="No progress bars.")


def options_from_args(args: argparse.Namespace):
    from dspark_core.train.pipeline import PipelineOptions
    from dspark_core.train.train import TrainSettings

    settings = TrainSettings(steps=args.steps, seqs_per_step=args.seqs_per_step, anchors_per_seq=args.anchors_per_seq,
                             lr=args.lr, seed=args.seed, save_every=args.save_every, max_minutes=args.max_minutes, head_dtype=args.head_dtype, warmup=min(30, max(1, args.steps // 10)))
    common = {"output": Path(args.output), "topk": args.topk, "markov_type": args.markov_type,
              "features_dir": Path(args.features_dir) if args.features_dir else None, "settings": settings}
    if args.tiny:
        settings = TrainSettings(steps=args.steps, seqs_per_step=4, anchors_per_seq=8, lr=args.lr * 5, seed=args.seed,
                                 save_every=args.save_every, warmup=min(30, max(1, args.steps // 10)))
        common["settings"] = settings
        return PipelineOptions(heldout=min(args.heldout, 6), prompts=min(args.prompts, 24), max_tokens=min(args.max_tokens, 40), gen_batch=8, layers=1,
                               block_size=min(args.block_size, 4), draft_vocab=64, markov_rank=8, tiny=True, **common)
    return PipelineOptions(target=args.target, prompts=args.prompts, max_tokens=args.max_tokens, gen_batch=args.gen_batch,
                           layers=args.layers, block_size=args.block_size, draft_vocab=args.draft_vocab,
                           markov_rank=args.markov_rank, aux_layers=args.aux_layers, heldout=args.heldout, **common)


def run(args: argparse.Namespace) -> int:
    import torch

    from dspark_core.train.pipeline import run_pipeline

    torch.set_num_threads(max(1, args.threads))
    opts = options_from_args(args)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    _, _, losses, held = run_pipeline(opts, progress=not args.no_progress, log=log)
    print(f"trained {len(losses)} steps; loss {losses[0]:.4f} -> {losses[-1]:.4f}; draft: {opts.output / 'draft'}; held-out: {held}")
    return 0
