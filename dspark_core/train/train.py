"""The draft training loop: frozen target features in, a speculators-format draft out.

Deterministic for a given seed and step count (one generator drives the
sequence order and the anchor choice; torch's global seed drives the
initialisation). Checkpoints (``checkpoint.pt``: weights, optimizer, step and
generator state) are written every ``save_every`` steps and on exit; calling
:func:`train` again with the same output directory resumes from the last one.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from attrs import frozen

from dspark_core.models.draft_config import DraftConfig
from dspark_core.models.dspark_draft import DSparkDraft
from dspark_core.train.blocks import train_blocks
from dspark_core.train.features import FeatureSet, token_counts
from dspark_core.train.losses import (
    chain_stats,
    dspark_loss,
    make_batch,
    sample_anchors,
    usable,
)


@frozen
class TrainSettings:
    steps: int = 1000
    seqs_per_step: int = 8
    anchors_per_seq: int = 24
    lr: float = 6e-4
    warmup: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    head_dtype: str = "float32"  # "bfloat16": LM-head product in bf16 (about 2x faster on AVX512-BF16 CPUs)
    seed: int = 0
    save_every: int = 100
    max_minutes: float = 0.0  # > 0: stop early (checkpoint + export) once this much wall time has passed


def make_draft_config(target_config, *, num_layers: int = 1, block_size: int = 7, aux_layer_ids=None,
                      draft_vocab_size: int | None = None, markov_rank: int = 64, markov_head_type: str = "vanilla",
                      mask_token_id: int | None = None) -> DraftConfig:
    """A draft shaped for ``target_config`` (same width and heads, so the embedding is shared)."""
    t = target_config
    n = t.num_layers
    aux = aux_layer_ids or tuple(sorted({min(2, n), max(1, n // 2), max(1, n - 2)}))
    return DraftConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_layers=num_layers,
        num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
        target_vocab_size=t.vocab_size, draft_vocab_size=min(draft_vocab_size or t.vocab_size, t.vocab_size),
        block_size=block_size, aux_layer_ids=tuple(aux), mask_token_id=t.vocab_size - 1 if mask_token_id is None else mask_token_id,
        target_hidden_size=t.hidden_size, rms_eps=t.rms_eps, rope_theta=t.rope_theta, max_position=t.max_position,
        markov_rank=markov_rank, markov_head_type=markov_head_type, confidence_head_with_markov=markov_rank > 0,
        sample_from_anchor=True,
    )


def init_draft(config: DraftConfig, feats: FeatureSet | None, seed: int) -> DSparkDraft:
    """Fresh draft: small normal init, zero Markov output (starts as the plain backbone), and,
    for a vocabulary subset, the tokens that score highest in :func:`token_counts` of ``feats``."""
    torch.manual_seed(seed)
    draft = DSparkDraft(config)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            elif "markov_w1" in name:
                p.normal_(0.0, 1.0)
            elif "markov_w2" in name:
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
        if draft.d2t is not None:
            counts = token_counts(feats, config.target_vocab_size)
            counts[config.mask_token_id] -= 1e9  # never propose the mask token itself
            keep = counts.topk(config.draft_vocab_size).indices.sort().values
            draft.d2t.copy_(keep - torch.arange(keep.numel()))
            draft.t2d.zero_()
            draft.t2d[keep] = True
    return draft


def target_to_draft_ids(draft: DSparkDraft) -> torch.Tensor:
    """Map target id -> draft id (-1 when the token is outside the draft vocabulary)."""
    c = draft.config
    to_draft = torch.full((c.target_vocab_size,), -1, dtype=torch.long)
    to_draft[draft.draft_to_target().cpu()] = torch.arange(c.draft_vocab_size)
    return to_draft


def lr_at(step: int, s: TrainSettings) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    frac = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def train(draft: DSparkDraft, target, feats: FeatureSet, settings: TrainSettings, out_dir: Path, *,
          progress: bool = True, log=None) -> list[float]:
    """Train ``draft`` (unbound is fine; it is bound to ``target`` here). Returns the loss per step."""
    from tqdm import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    draft.bind_target(target)
    draft.train()
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay)
    gen = torch.Generator().manual_seed(settings.seed)
    step, losses, order = 0, [], []
    ckpt = out_dir / "checkpoint.pt"
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        draft.load_state_dict(state["draft"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        step, losses, order = state["step"], state["losses"], state["order"]
    pool = usable(feats)
    to_draft = target_to_draft_ids(draft)
    to_target = draft.draft_to_target()
    k_out = draft.config.num_speculative_tokens
    head = draft._head_weight().to(getattr(torch, settings.head_dtype))

    def save() -> None:
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"draft": draft.state_dict(), "optimizer": opt.state_dict(), "generator": gen.get_state(),
                    "step": step, "losses": losses, "order": order}, tmp)
        tmp.replace(ckpt)

    ema: dict[str, float] = {}
    bar = tqdm(total=settings.steps, initial=step, desc="train", unit="step", disable=not progress)
    started = time.perf_counter()
    try:
        while step < settings.steps:
            if settings.max_minutes > 0 and time.perf_counter() - started > 60 * settings.max_minutes:
                if log is not None:
                    log(f"time budget of {settings.max_minutes} min reached at step {step}")
                break
            if len(order) < settings.seqs_per_step:  # new pass over the data
                order = order + [pool[i] for i in torch.randperm(len(pool), generator=gen).tolist()]
            seqs, order = order[: settings.seqs_per_step], order[settings.seqs_per_step :]
            batch = make_batch(feats, seqs, sample_anchors(feats, seqs, settings.anchors_per_seq, gen), k_out, to_draft)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, settings)
            out = train_blocks(draft, batch.hidden, batch.anchors, batch.prev_tokens, head=head)
            loss, terms = dspark_loss(out.logits, out.confidence_logits, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
            opt.step()
            step += 1
            losses.append(float(loss.item()))
            acc, tau = chain_stats(to_target[out.logits.detach().argmax(-1)], batch)
            for key, val in (("loss", losses[-1]), ("acc1", float(acc[0])), ("tau", tau)):
                if not math.isnan(val):
                    ema[key] = val if key not in ema else 0.95 * ema[key] + 0.05 * val
            bar.set_postfix(loss=f"{ema['loss']:.3f}", acc1=f"{ema.get('acc1', 0):.3f}", tau=f"{ema.get('tau', 1):.2f}")
            bar.update(1)
            if log is not None and (step % 20 == 0 or step == settings.steps):
                log(f"step {step} loss {ema['loss']:.4f} acc1 {ema.get('acc1', 0):.4f} tau {ema.get('tau', 1):.3f} "
                    + " ".join(f"{k} {float(v):.4f}" for k, v in terms.items())
                    + f" lr {lr_at(step - 1, settings):.2e} elapsed {time.perf_counter() - started:.0f}s")
            if step % settings.save_every == 0:
                save()
    finally:
        bar.close()
        save()
    draft.eval()
    return losses
