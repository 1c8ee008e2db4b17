"""Measuring a draft: real-engine acceptance and offline confidence statistics.

* :func:`engine_acceptance` runs the real :class:`Engine` (``policy="fixed"``,
  full width K, greedy) and reads every step's accepted counts through an
  observer: τ (accepted drafts + 1 bonus per request-step; ``tau_committed``
  counts only tokens that reached the output, i.e. after EOS / max_tokens
  cuts), acceptance
  (accepted / verified drafts) and, per position j, the fraction of
  request-steps whose draft survived to j (only steps that verified ≥ j).
* :func:`block_confidences` re-drafts every answer position of given
  sequences offline (teacher forced, exact up to the first miss) and returns
  raw confidence logits and hits, for ECE / ROC-AUC / STS fitting.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from dspark_core.geometry import kv_reserve
from dspark_core.train.blocks import BlockOutput, train_blocks
from dspark_core.train.features import FeatureSet, compute_features
from dspark_core.train.losses import answer_span


def engine_acceptance(target, draft, prompt_ids: list[list[int]], *, width: int, max_tokens: int,
                      buckets=(1, 2, 4, 8, 16), copy_proposals: str = "auto") -> dict:
    """Greedy speculative decoding of all prompts at full width ``width``; returns figures and outputs.
    ``copy_proposals``: auto (as the draft's config says), on or off."""
    from dspark_core.engine.engine import Engine, EngineConfig
    from dspark_core.engine.request import SamplingParams

    longest = max(len(p) for p in prompt_ids)
    cfg = EngineConfig(draft_width=width, policy="fixed", request_buckets=tuple(buckets),
                       max_model_len=longest + max_tokens + kv_reserve(width) + 8, copy_proposals=copy_proposals)
    engine = Engine(target, draft, cfg)
    verified_at = np.zeros(width)
    survived_at = np.zeros(width)
    accepted: list[int] = []

    def observe(report) -> None:
        for length, acc in zip(report.verify_lengths, report.accepted):
            if length >= width:  # steps capped by max_tokens are left out of the per-position view
                verified_at[:] += 1
                survived_at[: int(acc)] += 1
            accepted.append(int(acc))

    engine.add_observer(observe)
    try:
        outputs = engine.generate(prompt_ids, SamplingParams(max_tokens=max_tokens))
    finally:
        engine.close()
    steps = sum(o.steps for o in outputs)
    committed = sum(len(o.token_ids) - 1 for o in outputs)  # the prefill's first token is not a decode step
    survival = (survived_at / np.maximum(verified_at, 1)).tolist()
    conditional = [survival[0]] + [survival[j] / survival[j - 1] if survival[j - 1] > 0 else float("nan") for j in range(1, width)]
    return {
        "width": width,
        "tau": float(np.mean(accepted) + 1.0) if accepted else float("nan"),
        "tau_committed": committed / steps if steps else float("nan"),
        "acceptance": float(np.sum(accepted) / (len(accepted) * width)) if accepted else float("nan"),
        "survival_by_position": survival,
        "acceptance_by_position": conditional,
        "steps": steps,
        "outputs": [list(o.token_ids) for o in outputs],
    }


@torch.no_grad()
def block_confidences(draft, target, pairs: list[tuple[list[int], list[int]]], *, anchors_per_call: int = 64,
                      progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Raw confidence logits ``[N, K]`` and greedy hits ``[N, K]`` of every block whose K targets exist."""
    feats = compute_features(target, pairs, draft.config.aux_layer_ids, k=1, progress=progress)
    return confidences_from_features(draft.bind_target(target), feats, anchors_per_call=anchors_per_call)


@torch.no_grad()
def teacher_forced_blocks(draft, feats: FeatureSet, *, anchors_per_call: int = 64
                          ) -> Iterator[tuple[int, BlockOutput, torch.Tensor]]:
    """Every anchor of every answer in ``feats`` re-drafted, teacher forced (the draft must be bound):
    yields ``(sequence, out, hits)`` per call of up to ``anchors_per_call`` anchors, ``out`` the
    :class:`~dspark_core.train.blocks.BlockOutput` of batch 1 and ``hits`` ``[A, K]`` (the draft's
    greedy token equals the target's). Anchors come in answer order; an answer without a whole block
    after its first position yields nothing."""
    k_out = draft.config.num_speculative_tokens
    to_target = draft.draft_to_target()
    dev = draft.fc.weight.device
    for n in range(feats.num_sequences):
        off, first, total = answer_span(feats, n)
        anchors = list(range(first, total - 1 - k_out + 1))  # p + K <= total - 1
        if not anchors:
            continue
        hidden = feats.hidden[off : off + total].to(dev).float()[None]
        for s in range(0, len(anchors), anchors_per_call):
            a = torch.tensor(anchors[s : s + anchors_per_call])
            pos = a[:, None] + torch.arange(k_out)[None, :]
            prev = feats.tokens[off + pos].to(dev)
            teacher = feats.topk_ids[off + pos, 0].to(dev)
            out = train_blocks(draft, hidden[:, : int(a.max())], a[None].to(dev), prev[None])
            yield n, out, to_target[out.logits[0].argmax(-1)] == teacher


def confidences_from_features(draft, feats: FeatureSet, *, anchors_per_call: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """:func:`block_confidences` on already computed features (the draft must be bound)."""
    logits_out, hits_out = [], []
    for _, out, hits in teacher_forced_blocks(draft, feats, anchors_per_call=anchors_per_call):
        logits_out.append(out.confidence_logits[0].float().cpu().numpy())
        hits_out.append(hits.cpu().numpy())
    if not logits_out:
        k_out = draft.config.num_speculative_tokens
        return np.zeros((0, k_out)), np.zeros((0, k_out), dtype=bool)
    return np.concatenate(logits_out), np.concatenate(hits_out)
