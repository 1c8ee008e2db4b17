"""``dspark-core shrink-draft``: keep only a draft's most frequent tokens (a cheaper LM head, no retraining)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dspark_core.errors import ConfigError

NAME = "shrink-draft"
HELP = "Shrink a trained draft's vocabulary to its N most frequent tokens on the training features (cheaper proposals)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--draft_model", default="default", help="Draft directory, or 'default' for the target's shipped draft. Default: default.")
    a("--target", default="smollm2", help="Target alias or path the draft belongs to (resolves 'default'). Default: smollm2.")
    a("--features", required=True, help="Comma-separated feature shard directories of train-draft (under "
                                         "~/.cache/dspark-core/features/) whose tokens score the vocabulary.")
    a("--draft_vocab", type=int, required=True, help="Tokens to keep (at most the draft's vocabulary size).")
    a("--output", required=True, help="Directory for the shrunk draft (must differ from the input draft).")
    a("--json", action="store_true", help="Print one JSON object.")


def shrink(draft_dir: Path, feature_dirs: list[Path], size: int, output: Path) -> dict:
    """Score, shrink and save; report the vocabulary sizes and the share of the training token score kept."""
    from dspark_core.models.speculators_io import load_draft, read_verifier
    from dspark_core.train.pipeline import save_half
    from dspark_core.train.vocab import check_size, keep_most_frequent, shard_token_scores, shrink_vocabulary

    if output.resolve() == draft_dir.resolve():
        raise ConfigError(f"--output {output} is the input draft; write the shrunk draft elsewhere")
    draft = load_draft(draft_dir)
    check_size(draft, size)  # before reading the shards, which takes a while
    scores, shards = shard_token_scores(feature_dirs, draft.config.target_vocab_size)
    keep = keep_most_frequent(draft, scores, size)
    small = shrink_vocabulary(draft, keep)
    save_half(small, output, verifier=read_verifier(draft_dir))
    before = scores[draft.draft_to_target().cpu()].sum()
    return {"draft": str(draft_dir), "output": str(output), "shards": shards,
            "draft_vocab_before": draft.config.draft_vocab_size, "draft_vocab_after": int(keep.numel()),
            "score_kept": float(scores[keep].sum() / before) if before > 0 else float("nan"),
            "bytes": int(sum(p.stat().st_size for p in output.iterdir()))}


def run(args: argparse.Namespace) -> int:
    from dspark_core.models.drafts import resolve_draft_path

    feature_dirs = [Path(p) for p in args.features.split(",") if p.strip()]
    missing = [str(p) for p in feature_dirs if not p.is_dir()]
    if not feature_dirs or missing:
        raise ConfigError(f"--features: no such directory {missing or args.features!r}")
    report = shrink(resolve_draft_path(args.draft_model, args.target), feature_dirs, args.draft_vocab, Path(args.output))
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{report['draft']}: {report['draft_vocab_before']} -> {report['draft_vocab_after']} tokens "
              f"({100 * report['score_kept']:.2f}% of the training token score kept, {report['shards']} shards); "
              f"wrote {report['output']}")
    return 0
