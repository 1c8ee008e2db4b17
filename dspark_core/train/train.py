"""The draft training loop: frozen target features in, a speculators-format draft out.

Deterministic for a given seed and step count (one generator drives the
sequence order and the anchor choice; torch's global seed drives the
initialisation). Checkpoints (``checkpoint.pt``: weights, optimizer, step and
generator state) are written every ``save_every`` steps and on exit; calling
:func:`train` again with the same output directory resumes from the last one.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import attrs
import torch
from attrs import frozen

from dspark_core.errors import ConfigError
from dspark_core.models.draft_config import DraftConfig
from dspark_core.models.dspark_draft import DSparkDraft
from dspark_core.models.speculators_io import load_draft
from dspark_core.train.blocks import train_blocks
from dspark_core.train.features import FeatureSet, token_counts
from dspark_core.train.losses import (
    CE_WEIGHT,
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
    stop_at: float = 0.0  # > 0: also stop early at this wall-clock time (time.time()), e.g. a device call's deadline
    greedy_prefix_only: bool = False  # see losses.make_batch: drop proposals whose true prefix left the greedy path
    eval_every: int = 0  # > 0: held-out τ every N steps (curve.jsonl); the best checkpoint is kept
    eval_anchors: int = 16  # anchors per held-out sequence (fixed, seeded) for that evaluation
    ce_weight: float = CE_WEIGHT  # share of the greedy-token CE in the distribution loss (the rest is L1)


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


# architecture fields a fine-tuned draft must share with the options: the features are computed for
# ``aux_layer_ids`` and the rest is what the user asked for (the defaults match the shipped draft)
INIT_FIELDS = {"num_layers": "--layers", "block_size": "--block_size", "draft_vocab_size": "--draft_vocab",
               "aux_layer_ids": "--aux_layers", "markov_rank": "--markov_rank", "markov_head_type": "--markov_type",
               "hidden_size": "--target", "target_vocab_size": "--target"}


def start_from_draft(path, config: DraftConfig, seed: int = 0) -> DSparkDraft:
    """A trained draft to fine-tune: its weights and vocabulary, in float32, with its STS temperatures
    dropped (they describe the old confidence head; ``calibrate-confidence`` fits new ones). Its
    architecture must equal ``config`` (what the options ask for), or a ConfigError names the field,
    except that ``config`` may ask for more layers: the draft is then grown (:func:`grow_layers`)."""
    draft = load_draft(path)
    for name, flag in INIT_FIELDS.items():
        have, want = getattr(draft.config, name), getattr(config, name)
        if name == "num_layers" and have < want:
            continue
        if have != want:
            raise ConfigError(f"--init_draft={path}: its {name} is {have!r}, but {flag} asks for {want!r}")
    draft.config = attrs.evolve(draft.config, sts_temperatures=None)
    if draft.config.num_layers < config.num_layers:
        draft = grow_layers(draft, config.num_layers, seed)
    return draft


def grow_layers(draft: DSparkDraft, num_layers: int, seed: int) -> DSparkDraft:
    """The same draft with ``num_layers`` decoder layers: its own layers first, then new ones whose
    attention and MLP output projections are zero, so each new layer adds nothing to the residual
    stream and the grown draft proposes exactly what ``draft`` did. Training then starts from the
    draft's own quality, with the extra capacity to use, instead of from a random layer in its path."""
    old = draft.config.num_layers
    if num_layers <= old:
        raise ConfigError(f"grow_layers: the draft has {old} layers, cannot grow to {num_layers}")
    grown = DSparkDraft(attrs.evolve(draft.config, num_layers=num_layers))
    missing, unexpected = grown.load_state_dict(draft.state_dict(), strict=False)
    fresh = {n for n, _ in grown.named_parameters() if n.startswith("layers.") and int(n.split(".")[1]) >= old}
    if unexpected or not set(missing) <= fresh:
        raise ConfigError(f"grow_layers: unexpected checkpoint layout (missing {missing}, unexpected {unexpected})")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in grown.named_parameters():
            if name not in fresh:
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias") or name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    return grown.to(next(draft.parameters()).dtype)


def copy_target_layers(draft: DSparkDraft, target, first: int) -> list[int]:
    """Initialise draft layer ``i`` from target layer ``first + i`` (clipped to the last; negative
    ``first`` counts from the end). Returns the target layers used.

    The draft layer is Qwen3-style and the target Llama: projections, MLP and
    the two RMSNorm scales have the same shapes and are copied; the draft's
    q/k norms have no counterpart in a Llama target and stay at 1 (a target
    with q/k norms gives them too). So the copied layer is a warm start, not
    the target's function: q/k norms rescale every head's queries and keys,
    and the layer reads the embedding of ``[anchor, mask...]`` plus injected
    context instead of the residual stream after ``first`` layers.
    """
    c, t = draft.config, target.config
    n = t.num_layers
    start = first + n if first < 0 else first
    if not 0 <= start < n:
        raise ConfigError(f"--init_from_target_layer={first}: the target has layers 0..{n - 1}")
    shapes = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")
    if any(getattr(c, f) != getattr(t, f) for f in shapes):
        raise ConfigError("--init_from_target_layer: draft and target layer shapes differ")
    layers = getattr(target, "layers", None)
    if layers is None or not all(hasattr(layers[0], a) for a in ("qkv", "gate_up", "down", "o_proj", "input_norm", "post_norm")):
        raise ConfigError(f"--init_from_target_layer: only Llama-family targets are supported, not {type(target).__name__}")
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    used = []
    with torch.no_grad():
        for i, layer in enumerate(draft.layers):
            k = min(start + i, n - 1)
            src, a = layers[k], layer.self_attn
            qkv = src.qkv.detach()
            a.q_proj.weight.copy_(qkv[:q_out])
            a.k_proj.weight.copy_(qkv[q_out : q_out + kv_out])
            a.v_proj.weight.copy_(qkv[q_out + kv_out :])
            if getattr(src, "qkv_bias", None) is not None and a.q_proj.bias is not None:
                a.q_proj.bias.copy_(src.qkv_bias[:q_out])
                a.k_proj.bias.copy_(src.qkv_bias[q_out : q_out + kv_out])
                a.v_proj.bias.copy_(src.qkv_bias[q_out + kv_out :])
            a.o_proj.weight.copy_(src.o_proj)
            if getattr(src, "q_norm", None) is not None:
                a.q_norm.weight.copy_(src.q_norm)
                a.k_norm.weight.copy_(src.k_norm)
            layer.input_layernorm.weight.copy_(src.input_norm)
            layer.post_attention_layernorm.weight.copy_(src.post_norm)
            gate, up = src.gate_up.detach().chunk(2, dim=0)
            layer.mlp.gate_proj.weight.copy_(gate)
            layer.mlp.up_proj.weight.copy_(up)
            layer.mlp.down_proj.weight.copy_(src.down)
            used.append(k)
    return used


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


@torch.no_grad()
def heldout_stats(draft: DSparkDraft, feats: FeatureSet, settings: TrainSettings, to_draft: torch.Tensor, *,
                  head: torch.Tensor | None = None, seqs_per_call: int = 16) -> dict:
    """Teacher-forced acceptance on held-out (on-policy) sequences at fixed, seeded anchors.

    ``survival[j]`` is the fraction of complete blocks whose proposals
    ``0..j`` all equal the teacher's greedy tokens (what greedy verification
    accepts); ``tau = 1 + sum(survival)`` (with the bonus token). Also the
    held-out loss. The same anchors are drawn at every call, so values at
    different steps are comparable.
    """
    was_training = draft.training
    draft.eval()
    gen = torch.Generator().manual_seed(settings.seed + 12345)
    k_out = draft.config.num_speculative_tokens
    to_target = draft.draft_to_target()
    dev = draft.fc.weight.device
    pool = usable(feats)
    surv = torch.zeros(k_out, dtype=torch.float64)
    blocks, loss_sum, loss_n = 0, 0.0, 0
    for i in range(0, len(pool), seqs_per_call):
        seqs = pool[i : i + seqs_per_call]
        batch = make_batch(feats, seqs, sample_anchors(feats, seqs, settings.eval_anchors, gen), k_out, to_draft).to(dev)
        out = train_blocks(draft, batch.hidden, batch.anchors, batch.prev_tokens, head=head)
        loss, _ = dspark_loss(out.logits, out.confidence_logits, batch, settings.ce_weight)
        loss_sum, loss_n = loss_sum + float(loss) * len(seqs), loss_n + len(seqs)
        hit = (to_target[out.logits.argmax(-1)] == batch.teacher_top1) & batch.valid
        full = batch.valid.all(-1)
        surv += hit[full].long().cumprod(-1).sum(0).double().cpu()
        blocks += int(full.sum())
    draft.train(was_training)
    s = (surv / max(blocks, 1)).tolist()
    return {"blocks": blocks, "survival": s, "acc1": s[0] if s else math.nan, "tau": 1.0 + sum(s),
            "loss": loss_sum / max(loss_n, 1)}


def train(draft: DSparkDraft, target, feats: FeatureSet, settings: TrainSettings, out_dir: Path, *,
          progress: bool = True, log=None, heldout: FeatureSet | None = None, on_best=None, with_info: bool = False,
          start_is_candidate: bool = False):
    """Train ``draft`` (unbound is fine; it is bound to ``target`` here). Returns the loss per step
    (and, with ``with_info``, a dict holding the best held-out evaluation).

    The draft and the target must be on the same device; ``feats`` may live
    on the CPU (each batch is gathered there and copied over) or on the device.
    With ``heldout`` and ``settings.eval_every``, held-out τ is measured every
    ``eval_every`` steps and at the end, appended to ``out_dir/curve.jsonl``
    (with the answer tokens trained on so far), and ``on_best(draft, step, tau)``
    is called whenever it improves. The step-0 weights count as a candidate
    only with ``start_is_candidate`` (a fine-tune of a trained draft): a random
    init is a curve point, but a trained starting draft that no later step
    beats is the right result.
    """
    from tqdm import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    draft.bind_target(target)
    draft.train()
    dev = draft.fc.weight.device
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay)
    gen = torch.Generator().manual_seed(settings.seed)
    step, losses, order, seen_tokens, best = 0, [], [], 0, None
    ckpt = out_dir / "checkpoint.pt"
    curve = out_dir / "curve.jsonl"
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False, map_location=dev)
        draft.load_state_dict(state["draft"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"].cpu())
        step, losses, order = state["step"], state["losses"], state["order"]
        seen_tokens, best = state.get("seen_tokens", 0), state.get("best")
        # the checkpoint wins over the starting weights the caller passed (a fresh draft or --init_draft)
        if log is not None:
            log(f"resuming {ckpt} at step {step} ({seen_tokens} answer tokens seen); its weights and optimizer "
                f"replace the starting draft's, and the schedule goes on with lr {settings.lr:g}")
    elif curve.is_file():
        curve.unlink()  # a fresh run: the old curve belongs to another one
    pool = usable(feats)
    to_draft_cpu = target_to_draft_ids(draft)
    to_draft = to_draft_cpu.to(feats.hidden.device)
    to_target = draft.draft_to_target()
    k_out = draft.config.num_speculative_tokens
    head = draft._head_weight().to(getattr(torch, settings.head_dtype))
    answer_len = (feats.offsets.diff() - feats.prompt_lens).tolist()

    def save() -> None:
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"draft": draft.state_dict(), "optimizer": opt.state_dict(), "generator": gen.get_state(),
                    "step": step, "losses": losses, "order": order, "seen_tokens": seen_tokens, "best": best}, tmp)
        tmp.replace(ckpt)

    def evaluate(elapsed: float) -> None:
        nonlocal best
        r = heldout_stats(draft, heldout, settings, to_draft_cpu.to(heldout.hidden.device), head=head)
        row = {"step": step, "answer_tokens_seen": seen_tokens, "train_loss_ema": round(ema["loss"], 5) if "loss" in ema else None,
               "heldout_loss": round(r["loss"], 5), "heldout_acc1": round(r["acc1"], 5), "heldout_tau": round(r["tau"], 5),
               "heldout_survival": [round(x, 5) for x in r["survival"]], "heldout_blocks": r["blocks"],
               "elapsed_s": round(elapsed, 1)}
        with curve.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        improved = (step > 0 or start_is_candidate) and (best is None or r["tau"] > best["tau"])
        if log is not None:
            log(f"held-out at step {step} ({seen_tokens} answer tokens seen): tau {r['tau']:.4f} acc1 {r['acc1']:.4f} "
                f"loss {r['loss']:.4f}" + (" (best)" if improved else ""))
        if improved:
            best = {"step": step, "tau": r["tau"], "acc1": r["acc1"], "answer_tokens_seen": seen_tokens}
            if on_best is not None:
                on_best(draft, step, r["tau"])

    ema: dict[str, float] = {}
    evaluating = heldout is not None and settings.eval_every > 0
    if evaluating and step == 0:
        evaluate(0.0)
    bar = tqdm(total=settings.steps, initial=step, desc="train", unit="step", disable=not progress)
    started = time.perf_counter()
    try:
        while step < settings.steps:
            over = settings.max_minutes > 0 and time.perf_counter() - started > 60 * settings.max_minutes
            if over or (settings.stop_at > 0 and time.time() > settings.stop_at):
                if log is not None:
                    log(f"time budget reached at step {step} (--max_minutes={settings.max_minutes}, --stop_at={settings.stop_at})")
                if evaluating and step > 0 and step % settings.eval_every != 0:
                    evaluate(time.perf_counter() - started)  # the last weights are a candidate too
                break
            if len(order) < settings.seqs_per_step:  # new pass over the data
                order = order + [pool[i] for i in torch.randperm(len(pool), generator=gen).tolist()]
            seqs, order = order[: settings.seqs_per_step], order[settings.seqs_per_step :]
            batch = make_batch(feats, seqs, sample_anchors(feats, seqs, settings.anchors_per_seq, gen), k_out, to_draft,
                               greedy_prefix_only=settings.greedy_prefix_only).to(dev)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, settings)
            out = train_blocks(draft, batch.hidden, batch.anchors, batch.prev_tokens, head=head)
            loss, terms = dspark_loss(out.logits, out.confidence_logits, batch, settings.ce_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
            opt.step()
            step += 1
            seen_tokens += sum(answer_len[n] for n in seqs)
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
            if evaluating and (step % settings.eval_every == 0 or step == settings.steps):
                evaluate(time.perf_counter() - started)
            if step % settings.save_every == 0:
                save()
    finally:
        bar.close()
        save()
    draft.eval()
    return (losses, {"best": best}) if with_info else losses
