"""The DSpark training objective and the block batches it is computed on.

Loss per proposed position ``j`` (0-based) of a block, weighted by
``exp(-j / 4)`` and averaged over valid positions::

    w * CE(draft logits, teacher greedy token)
  + (1 - w) * L1(draft distribution, teacher distribution)
  + 1.0 * BCE(confidence logit, 1 - L1 / 2)

with ``w`` = 0.1 by default (``train-draft --ce_weight``). The L1 term makes
the draft's distribution overlap the target's, which is what acceptance under
sampling rewards; greedy verification only rewards agreeing on the argmax,
which the CE term aims at directly.

Approximation: the teacher distribution is its cached top-k (k = 16 by
default), restricted to the draft vocabulary and renormalised to sum to 1.
The L1 is then exact against that truncated teacher:
``sum_topk |q_i - p_i| + (draft mass outside the top-k)``. The soft label
``1 - L1/2`` (the overlap ``sum min(p, q)``) is detached.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from attrs import frozen

from dspark_core.train.features import FeatureSet

CE_WEIGHT, BCE_WEIGHT, DECAY = 0.1, 1.0, 4.0


@frozen
class BlockBatch:
    hidden: torch.Tensor  # float32 [B, L, n_aux*d]
    anchors: torch.Tensor  # int64 [B, A]
    prev_tokens: torch.Tensor  # int64 [B, A, K] target ids
    teacher_ids: torch.Tensor  # int64 [B, A, K, k] draft-vocabulary ids, -1 outside it
    teacher_probs: torch.Tensor  # float32 [B, A, K, k]
    teacher_top1: torch.Tensor  # int64 [B, A, K] target id of the teacher's greedy token
    valid: torch.Tensor  # bool [B, A, K]: the token p+j+1 exists (and, with greedy_prefix_only, p+1..p+j are greedy)

    def to(self, device) -> BlockBatch:
        return BlockBatch(*(getattr(self, f).to(device, non_blocking=True) for f in
                            ("hidden", "anchors", "prev_tokens", "teacher_ids", "teacher_probs", "teacher_top1", "valid")))


def answer_span(feats: FeatureSet, n: int) -> tuple[int, int, int]:
    """(row offset, first anchor position, sequence length) of sequence ``n``."""
    off = int(feats.offsets[n])
    return off, int(feats.prompt_lens[n]), int(feats.offsets[n + 1]) - off


def usable(feats: FeatureSet) -> list[int]:
    """Sequences with at least one anchor (answer of two or more tokens)."""
    return [n for n in range(feats.num_sequences) if answer_span(feats, n)[2] - answer_span(feats, n)[1] >= 2]


def make_batch(feats: FeatureSet, seqs: list[int], anchors: list[list[int]], k_out: int, to_draft: torch.Tensor, *,
               greedy_prefix_only: bool = False) -> BlockBatch:
    """Gather features for the given anchors (all lists in ``anchors`` have the same length).

    Tensors are built where ``feats`` lives (``offsets``/``prompt_lens`` stay on
    the CPU, see :meth:`FeatureSet.to`); ``to_draft`` must live there too.

    ``greedy_prefix_only`` drops proposal ``j`` of a block unless the true
    tokens at ``p+1 .. p+j`` are the teacher's greedy tokens. On on-policy
    (greedy) answers that changes nothing; on answers written by someone else
    it keeps only the blocks serving can reach: proposal ``j`` only counts
    once proposals ``0 .. j-1`` were accepted, i.e. equal the target's greedy
    tokens, and the draft cannot see the true tokens in between (they are mask
    tokens in its block).
    """
    dev = feats.hidden.device
    length = max(max(a) for a in anchors)  # context rows needed: positions < anchor
    width = feats.hidden.shape[1]
    hidden = torch.zeros(len(seqs), max(length, 1), width, device=dev)
    a_t = torch.tensor(anchors, dtype=torch.long, device=dev)
    j = torch.arange(k_out, device=dev)
    prev, tids, tprobs, valid = [], [], [], []
    for b, n in enumerate(seqs):
        off, _, total = answer_span(feats, n)
        rows = min(length, total)
        hidden[b, :rows] = feats.hidden[off : off + rows].float()
        pos = a_t[b][:, None] + j[None, :]  # [A, K]: rows p+j predict token p+j+1
        ok = pos + 1 < total
        idx = off + pos.clamp(max=total - 2)
        prev.append(feats.tokens[off + pos.clamp(max=total - 1)])
        tids.append(feats.topk_ids[idx])
        tprobs.append(feats.topk_probs[idx].float())
        valid.append(ok)
    tids_t = torch.stack(tids)
    prev_t, top1, valid_t = torch.stack(prev), tids_t[..., 0], torch.stack(valid)
    if greedy_prefix_only and k_out > 1:
        agree = (prev_t[..., 1:] == top1[..., :-1]).long().cumprod(-1).bool()  # p+1..p+j were the greedy tokens
        valid_t = valid_t & torch.cat([torch.ones_like(agree[..., :1]), agree], dim=-1)
    return BlockBatch(hidden, a_t, prev_t, to_draft[tids_t], torch.stack(tprobs), top1, valid_t)


def sample_anchors(feats: FeatureSet, seqs: list[int], per_seq: int, gen: torch.Generator) -> list[list[int]]:
    """``per_seq`` random anchor positions in each sequence's answer (with replacement if short)."""
    out = []
    for n in seqs:
        _, first, total = answer_span(feats, n)
        span = total - 1 - first  # anchors first .. total-2
        pick = torch.randperm(span, generator=gen)[:per_seq] if span >= per_seq else torch.randint(span, (per_seq,), generator=gen)
        out.append([first + int(i) for i in pick])
    return out


def position_weights(k_out: int) -> torch.Tensor:
    return torch.exp(-torch.arange(k_out, dtype=torch.float32) / DECAY)


def dspark_loss(logits: torch.Tensor, conf_logits: torch.Tensor | None, batch: BlockBatch,
                ce_weight: float = CE_WEIGHT) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar loss and per-term values (see module docstring); ``ce_weight`` is ``w`` there."""
    inside = batch.teacher_ids >= 0
    p = batch.teacher_probs * inside
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-6)
    # one gather serves both terms: the greedy label is the teacher's first top-k entry, so its
    # log-probability is among the gathered ones. A separate nll_loss would scatter a second
    # gradient the size of the logits (at 4 096 entries, most of a CPU step's backward outside the products)
    logq_top = torch.log_softmax(logits, dim=-1).gather(-1, batch.teacher_ids.clamp_min(0))
    q_top = logq_top.exp() * inside
    l1 = (q_top - p).abs().sum(-1) + (1.0 - q_top.sum(-1)).clamp_min(0.0)
    label = batch.teacher_ids[..., 0]
    ce = -logq_top[..., 0]
    ce_ok = batch.valid & (label >= 0)
    w = position_weights(logits.shape[2]).to(logits.device) * batch.valid
    total_w = w.sum().clamp_min(1e-6)
    ce_term = (ce * w * ce_ok).sum() / (w * ce_ok).sum().clamp_min(1e-6)
    l1_term = (l1 * w).sum() / total_w
    loss = ce_weight * ce_term + (1.0 - ce_weight) * l1_term
    terms = {"ce": ce_term.detach(), "l1": l1_term.detach()}
    if conf_logits is not None:
        soft = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), soft, reduction="none")
        bce_term = (bce * w).sum() / total_w
        loss = loss + BCE_WEIGHT * bce_term
        terms["bce"] = bce_term.detach()
    return loss, terms


def chain_stats(pred_target_ids: torch.Tensor, batch: BlockBatch) -> tuple[torch.Tensor, float]:
    """Per-position acceptance ``[K]`` and mean accepted length τ (with bonus) of the blocks.

    With greedy verification and teacher-forced previous tokens, the accepted
    prefix equals what the free-running draft would get accepted.
    """
    hit = (pred_target_ids == batch.teacher_top1) & batch.valid
    acc = hit.float().sum((0, 1)) / batch.valid.float().sum((0, 1)).clamp_min(1)
    full = batch.valid.all(-1)
    run = hit.long().cumprod(-1).sum(-1).float()
    tau = float(run[full].mean().item()) + 1.0 if bool(full.any()) else math.nan
    return acc, tau
