"""End-to-end draft training: prompts -> target-labelled answers -> cached features -> trained draft.

:mod:`dspark_core.train.sources` makes (or reads back) the features,
:mod:`dspark_core.train.train` trains on them, and the draft with the best
held-out τ is saved. Every stage is cached, so re-running the same command
resumes: feature shards are reused and the training loop resumes from
``checkpoint.pt``.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from dspark_core.errors import ConfigError
from dspark_core.models.drafts import resolve_draft_path
from dspark_core.models.speculators_io import load_draft, read_draft_config, save_draft
from dspark_core.train import data
from dspark_core.train.features import concat_features
from dspark_core.train.options import PipelineOptions
from dspark_core.train.sources import STATS, collect, extra_shards, read_extra, shard_dir, shard_sources, tiny_target
from dspark_core.train.train import (
    copy_target_layers,
    heldout_stats,
    init_draft,
    make_draft_config,
    start_from_draft,
    target_to_draft_ids,
    train,
)


def run_pipeline(opts: PipelineOptions, *, progress: bool = True, log=print):
    """Train a draft; returns ``(draft, target, losses, heldout_file)``.

    The result is saved to ``output/draft``. With held-out evaluation on
    (``settings.eval_every > 0`` and held-out sequences), that is the
    checkpoint with the best held-out τ (``draft-best``); the final weights are
    in ``draft-last`` and the τ curve in ``curve.jsonl``.
    """
    from dspark_core.train.runtime import resolve_device, resolve_dtype

    device, dtype = resolve_device(opts.device), resolve_dtype(opts.dtype)
    opts.output.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if opts.tiny:
        target = tiny_target(device, dtype)
    else:
        from dspark_core.models.loading import load_target

        target = load_target(opts.target, device=device, dtype=dtype)
    cfg = make_draft_config(target.config, num_layers=opts.layers, block_size=opts.block_size, aux_layer_ids=opts.aux_layers,
                            draft_vocab_size=opts.draft_vocab, markov_rank=opts.markov_rank, markov_head_type=opts.markov_type)
    start = None
    if opts.init_draft:  # checked before the features are made, which can take hours
        if opts.init_from_target_layer is not None:
            raise ConfigError("--init_draft and --init_from_target_layer both say where the draft starts; give one")
        start = start_from_draft(resolve_draft_path(opts.init_draft, opts.target), cfg, opts.settings.seed)
    extra = extra_shards(opts, len(cfg.aux_layer_ids) * target.config.hidden_size)
    t1 = time.perf_counter()
    train_feats, held, held_pairs = collect(target, opts, cfg.aux_layer_ids, log)
    more = read_extra(extra, log)
    if more is not None:
        train_feats = concat_features([train_feats, more])
    t2 = time.perf_counter()
    held_file = opts.output / "heldout.jsonl"
    data.write_generations(held_file, [p for p, _ in held_pairs], [a for _, a in held_pairs])
    if held is not None:
        torch.save(held.to_dict(), opts.output / "heldout-features.pt")
    log(f"features: {train_feats.num_sequences} training sequences, {int(train_feats.tokens.numel())} rows "
        f"({train_feats.answer_tokens} answer tokens); {len(held_pairs)} held-out sequences")
    baseline = None
    if opts.baseline_draft and held is not None:
        path = resolve_draft_path(opts.baseline_draft, opts.target)
        other = load_draft(path, device=device).bind_target(target)
        baseline = {"draft": str(path), **heldout_stats(other, held, opts.settings, target_to_draft_ids(other).to(held.hidden.device))}
        log(f"baseline {path} on the held-out set: tau {baseline['tau']:.4f} acc1 {baseline['acc1']:.4f}")
        del other
    if start is not None:
        draft = start
        log(f"fine-tuning {opts.init_draft} (its weights and vocabulary; STS temperatures dropped)")
        own_layers = read_draft_config(resolve_draft_path(opts.init_draft, opts.target)).num_layers
        if own_layers < opts.layers:
            log(f"grown from {own_layers} to {opts.layers} layers: the new ones add nothing until trained")
    else:
        draft = init_draft(cfg, train_feats, opts.settings.seed)
    if opts.init_from_target_layer is not None:
        used = copy_target_layers(draft, target, opts.init_from_target_layer)
        log(f"draft layers initialised from target layers {used}")
    draft.to(device)
    verifier = opts.target if not opts.tiny else None
    evaluate = held is not None and opts.settings.eval_every > 0
    best_dir = opts.output / "draft-best"

    def on_best(d, step: int, tau: float) -> None:
        save_half(d, best_dir, verifier=verifier)

    feats_in = train_feats.to(device) if opts.features_on_device else train_feats
    held_in = (held.to(device) if opts.features_on_device else held) if evaluate else None
    losses, info = train(draft, target, feats_in, opts.settings, opts.output, progress=progress, log=log,
                         heldout=held_in, on_best=on_best if evaluate else None, with_info=True,
                         start_is_candidate=start is not None)
    t3 = time.perf_counter()
    out = opts.output / "draft"
    if evaluate:
        save_half(draft, opts.output / "draft-last", verifier=verifier)
        chosen = best_dir if best_dir.is_dir() else opts.output / "draft-last"
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(chosen, out)
    else:
        save_half(draft, out, verifier=verifier)
    (opts.output / "train-summary.json").write_text(json.dumps({
        "answers": list(opts.answers), "device": str(device), "dtype": opts.dtype,
        "shards": {src: str(shard_dir(opts, cfg.aux_layer_ids, src)) for src in shard_sources(opts)},
        "train_sequences": train_feats.num_sequences, "train_rows": int(train_feats.tokens.numel()),
        "train_answer_tokens": train_feats.answer_tokens, "heldout_sequences": len(held_pairs),
        "extra_features": [str(d) for d in opts.extra_features],
        "init_from_target_layer": opts.init_from_target_layer, "init_draft": opts.init_draft,
        "later_turns": opts.later_turns, "max_context_chars": opts.max_context_chars,
        "skip_prompts": opts.skip_prompts, "prompt_chars": [opts.min_prompt_chars, opts.max_prompt_chars], "steps": opts.settings.steps, "ce_weight": opts.settings.ce_weight, "steps_done": len(losses), "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None, "chosen": "draft-best" if evaluate and best_dir.is_dir() else "last",
        "best": info.get("best"), "baseline": baseline, "feature_stages": dict(STATS), "seconds": {"load": round(t1 - t0, 1), "features": round(t2 - t1, 1), "train": round(t3 - t2, 1)},
    }, indent=2) + "\n")
    log(f"draft saved to {out}")
    return draft, target, losses, held_file


def save_half(draft, directory: Path, *, verifier: str | None = None) -> Path:
    """Save with float16 weights (load_draft converts back); the in-memory draft stays float32."""
    lm_head = draft.lm_head
    draft.half()
    try:
        return save_draft(draft, directory, verifier=verifier)
    finally:
        draft.float()
        draft.lm_head = lm_head
