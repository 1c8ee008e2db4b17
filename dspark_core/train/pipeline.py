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
from dspark_core.train.features import (
    FeatureSet,
    concat_features,
    generate_with_features,
)
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
    draft_vocab: int = 24576
    markov_rank: int = 64
    markov_type: str = "vanilla"
    aux_layers: tuple[int, ...] | None = None
    topk: int = 16
    features_dir: Path | None = None
    tiny: bool = False
    settings: TrainSettings = field(factory=TrainSettings)


def tiny_target():
    """The random target tiny mode trains against (fixed seed)."""
    from dspark_core.models.random_models import random_target, tiny_target_config

    return random_target(tiny_target_config(max_position=256), seed=0)


def tiny_prompts(target, opts: PipelineOptions) -> list[list[int]]:
    g = torch.Generator().manual_seed(opts.settings.seed)
    vocab = target.config.vocab_size - 1
    return [torch.randint(vocab, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(opts.prompts)]


def shard_dir(opts: PipelineOptions, aux: tuple[int, ...]) -> Path:
    """Where the generation + feature shards of these options live."""
    if opts.tiny:
        return opts.output / "shards"
    base = opts.features_dir or data.data_cache_dir().parent / "features"
    aux_txt = "-".join(map(str, aux))
    return Path(base) / (f"{Path(str(opts.target)).stem}-sharegpt-s{opts.settings.seed}-c{opts.max_prompt_chars}"
                         f"-t{opts.max_tokens}-a{aux_txt}-k{opts.topk}")


def collect(target, opts: PipelineOptions, aux: tuple[int, ...], log, chunk: int = 64):
    """On-policy (prompt, answer) pairs and their features, generated in cached shards of ``chunk`` prompts."""
    if opts.tiny:
        ids = tiny_prompts(target, opts)
    else:
        prompts = data.sharegpt_prompts(limit=opts.prompts, seed=opts.settings.seed, max_chars=opts.max_prompt_chars)
        ids = [data.chat_ids(target.tokenizer, p) for p in prompts]
    where = shard_dir(opts, aux)
    where.mkdir(parents=True, exist_ok=True)
    log(f"{len(ids)} prompts ({sum(map(len, ids))} tokens); generation + feature shards in {where}")
    pairs, parts = [], []
    for n, s in enumerate(range(0, len(ids), chunk)):
        path = where / f"part-{n:05d}-{chunk}.pt"
        if path.is_file():
            shard = torch.load(path, weights_only=True)
            if shard["prompts"] != ids[s : s + chunk]:
                raise ValueError(f"{path} holds other prompts; delete {where} to regenerate")
        else:
            got, feats = generate_with_features(target, ids[s : s + chunk], aux, max_tokens=opts.max_tokens, k=opts.topk, batch=opts.gen_batch)
            shard = {"prompts": [p for p, _ in got], "answers": [a for _, a in got], "features": feats.to_dict()}
            torch.save(shard, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").replace(path)
            log(f"generated {min(s + chunk, len(ids))}/{len(ids)} answers with features")
        pairs.extend(zip(shard["prompts"], shard["answers"]))
        parts.append(FeatureSet(**shard["features"]))
    return pairs, concat_features(parts)


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
    cfg = make_draft_config(target.config, num_layers=opts.layers, block_size=opts.block_size, aux_layer_ids=opts.aux_layers,
                            draft_vocab_size=opts.draft_vocab, markov_rank=opts.markov_rank, markov_head_type=opts.markov_type)
    pairs, feats = collect(target, opts, cfg.aux_layer_ids, log)
    train_idx, held_idx = split(pairs, opts.heldout)
    held_file = opts.output / "heldout.jsonl"
    data.write_generations(held_file, [pairs[i][0] for i in held_idx], [pairs[i][1] for i in held_idx])
    if held_idx:
        torch.save(feats.subset(held_idx).to_dict(), opts.output / "heldout-features.pt")
    train_feats = feats.subset(train_idx)
    log(f"features: {train_feats.num_sequences} training sequences, {int(train_feats.tokens.numel())} rows")
    draft = init_draft(cfg, train_feats, opts.settings.seed)
    losses = train(draft, target, train_feats, opts.settings, opts.output, progress=progress, log=log)
    out = save_half(draft, opts.output / "draft", verifier=opts.target if not opts.tiny else None)
    (opts.output / "train-summary.json").write_text(json.dumps({
        "shards": str(shard_dir(opts, cfg.aux_layer_ids)), "train_sequences": len(train_idx), "heldout_sequences": len(held_idx),
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
