"""End-to-end draft training: prompts -> on-policy answers -> cached features -> trained draft.

Every stage is cached, so re-running the same command resumes: generations
are appended chunk by chunk to a JSONL file, features are stored once per
generations file, and the training loop resumes from ``checkpoint.pt``.
``tiny=True`` swaps the real model and ShareGPT for a random tiny target and
random prompts (seconds on a CPU; used by the tests).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from attrs import field, frozen

from dspark_core.train import data
from dspark_core.train.features import FeatureSet, cached_features
from dspark_core.train.train import TrainSettings, init_draft, make_draft_config, train


@frozen
class PipelineOptions:
    target: str = "smollm2"
    output: Path = field(default=Path("draft-run"), converter=Path)
    prompts: int = 900
    heldout: int = 64
    max_tokens: int = 128
    max_prompt_chars: int = 500
    gen_batch: int = 16
    layers: int = 1
    block_size: int = 7
    draft_vocab: int = 16384
    markov_rank: int = 64
    markov_type: str = "vanilla"
    aux_layers: tuple[int, ...] | None = None
    topk: int = 16
    features_dir: Path | None = None
    tiny: bool = False
    settings: TrainSettings = TrainSettings()


def tiny_target():
    """The random target tiny mode trains against (fixed seed)."""
    from dspark_core.models.random_models import random_target, tiny_target_config

    return random_target(tiny_target_config(max_position=256), seed=0)


def tiny_generations(target, opts: PipelineOptions, path: Path) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(opts.settings.seed)
    vocab = target.config.vocab_size - 1
    prompts = [torch.randint(vocab, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(opts.prompts)]
    return data.generate_to_file(target, prompts, path, max_tokens=opts.max_tokens, batch=opts.gen_batch, chunk=len(prompts))


def generations(target, opts: PipelineOptions, log) -> tuple[Path, list[tuple[list[int], list[int]]]]:
    """(file, prompt/answer pairs) of the on-policy data; resumes a partial file."""
    if opts.tiny:
        path = opts.output / "tiny-generations.jsonl"
        return path, tiny_generations(target, opts, path)
    name = f"sharegpt-n{opts.prompts}-s{opts.settings.seed}-c{opts.max_prompt_chars}-t{opts.max_tokens}.jsonl"
    path = data.data_cache_dir() / name
    prompts = data.sharegpt_prompts(limit=opts.prompts, seed=opts.settings.seed, max_chars=opts.max_prompt_chars)
    ids = [data.chat_ids(target.tokenizer, p) for p in prompts]
    log(f"{len(ids)} ShareGPT prompts ({sum(map(len, ids))} tokens); answers -> {path}")
    return path, data.generate_to_file(target, ids, path, max_tokens=opts.max_tokens, batch=opts.gen_batch, log=log)


def split(pairs: list, heldout: int) -> tuple[list[int], list[int]]:
    """Indices of training and held-out sequences (the last ``heldout`` are held out)."""
    n = len(pairs)
    cut = max(1, n - heldout) if n > 1 else n
    return list(range(cut)), list(range(cut, n))


def run_pipeline(opts: PipelineOptions, *, progress: bool = True, log=print):
    """Train a draft; returns ``(draft, target, losses, heldout_file)``; the draft is saved to ``output/draft``."""
    opts.output.mkdir(parents=True, exist_ok=True)
    if opts.tiny:
        target = tiny_target()
    else:
        from dspark_core.models.loading import load_target

        target = load_target(opts.target)
    gen_path, pairs = generations(target, opts, log)
    train_idx, held_idx = split(pairs, opts.heldout)
    held_file = opts.output / "heldout.jsonl"
    data.write_generations(held_file, [pairs[i][0] for i in held_idx], [pairs[i][1] for i in held_idx])
    cfg = make_draft_config(target.config, num_layers=opts.layers, block_size=opts.block_size, aux_layer_ids=opts.aux_layers,
                            draft_vocab_size=opts.draft_vocab, markov_rank=opts.markov_rank, markov_head_type=opts.markov_type)
    feats_dir = opts.features_dir or (opts.output / "features" if opts.tiny else data.data_cache_dir().parent / "features")
    feats: FeatureSet = cached_features(target, gen_path, pairs, cfg.aux_layer_ids, k=opts.topk, cache_dir=feats_dir, progress=progress)
    train_feats = feats.subset(train_idx)
    log(f"features: {train_feats.num_sequences} training sequences, {int(train_feats.tokens.numel())} rows")
    draft = init_draft(cfg, train_feats, opts.settings.seed)
    losses = train(draft, target, train_feats, opts.settings, opts.output, progress=progress, log=log)
    out = save_half(draft, opts.output / "draft", verifier=opts.target if not opts.tiny else None)
    (opts.output / "train-summary.json").write_text(json.dumps({
        "generations": str(gen_path), "train_sequences": len(train_idx), "heldout_sequences": len(held_idx),
        "steps": opts.settings.steps, "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
    }, indent=2) + "\n")
    log(f"draft saved to {out}")
    return draft, target, losses, held_file


def save_half(draft, directory: Path, *, verifier: str | None = None) -> Path:
    """Save with float16 weights (load_draft converts back); the in-memory draft stays float32."""
    from dspark_core.models.speculators_io import save_draft

    lm_head = draft.lm_head
    draft.half()
    try:
        return save_draft(draft, directory, verifier=verifier)
    finally:
        draft.float()
        draft.lm_head = lm_head
