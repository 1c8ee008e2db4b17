"""Where the draft misses: position-1 acceptance against the target's own certainty.

The target answers each prompt greedily (the real engine, full width K); then, at
every anchor of every answer, the draft's first proposal is compared with the
target's greedy token (teacher forced, exactly as ``eval-draft`` scores offline
acceptance), and the anchor is binned by the target's probability of that token
(its top-1 probability) and by its lead over the second-best token. The report
says how much of the answer text lies in each bin and how often the draft is
right there, so one can read which positions limit acceptance: ones where the
target itself is sure, or near-ties between its best candidates.

Use held-out prompts (``benchmarks/heldout_prompts.py``), never the evaluation set::

    python benchmarks/draft_difficulty.py --prompts heldout.jsonl --limit 48 \\
        --output benchmarks/results/draft-difficulty/heldout-48.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from common import write_report

EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0001)  # top-1 probability bins (the last one holds 1.0)
LEADS = (0.0, 0.05, 0.1, 0.2, 0.4, 1.0001)  # top-1 minus top-2 probability


def bin_table(values: np.ndarray, hits: np.ndarray, edges: tuple[float, ...]) -> list[dict]:
    """Share of anchors and the draft's hit rate in each ``[edges[i], edges[i+1])`` bin."""
    rows = []
    for lo, hi in zip(edges, edges[1:]):
        inside = (values >= lo) & (values < hi)
        count = int(inside.sum())
        rows.append({"from": lo, "to": min(hi, 1.0), "anchors": count, "share": count / max(len(values), 1),
                     "acc1": float(hits[inside].mean()) if count else None})
    return rows


def analyse(top1: np.ndarray, top2: np.ndarray, hits: np.ndarray) -> dict:
    """The report for per-anchor teacher probabilities and first-proposal hits."""
    return {
        "anchors": int(len(hits)),
        "acc1": float(hits.mean()),
        "mean_target_top1": float(top1.mean()),
        "by_target_top1": bin_table(top1, hits, EDGES),
        "by_target_lead": bin_table(top1 - top2, hits, LEADS),
    }


def last_match_continuation(tokens: list[int], p: int, order: int, width: int) -> list[int] | None:
    """The ``width`` tokens that followed the latest earlier occurrence of ``tokens[p-order+1 : p+1]``
    (fewer near the end), or None when that n-gram did not occur before ``p``."""
    key = tokens[p - order + 1 : p + 1]
    for j in range(p - 1, order - 2, -1):
        if tokens[j - order + 1 : j + 1] == key:
            return tokens[j + 1 : min(j + 1 + width, p + 1)]  # only text already written: no look-ahead
    return None


def accepted(proposal: list[int], truth: list[int]) -> int:
    """How many leading proposals equal the target's greedy tokens."""
    n = 0
    for a, b in zip(proposal, truth):
        if a != b:
            break
        n += 1
    return n


def copy_study(sequences: list[tuple[list[int], int]], draft_hits: np.ndarray, width: int, order: int = 2) -> dict:
    """Accepted lengths per anchor (teacher forced, every anchor of every answer) of three proposers:
    the draft; a copy of what followed the latest earlier occurrence of the last ``order`` tokens
    (prompt lookup), falling back to the draft where there is none; and the better of the two."""
    expected = sum(max(len(tokens) - width - first, 0) for tokens, first in sequences)
    assert expected == len(draft_hits), "anchors out of step with the draft's hits"
    draft_len, copy_len, best_len, matched, copy_first = [], [], [], 0, []
    row = 0
    for tokens, first in sequences:
        for p in range(first, len(tokens) - width):
            d = int(np.cumprod(draft_hits[row]).sum())  # the draft's accepted length at this anchor
            row += 1
            truth = tokens[p + 1 : p + 1 + width]  # on-policy greedy text: the target's own tokens
            cont = last_match_continuation(tokens, p, order, width)
            c = d if cont is None else accepted(cont, truth)
            matched += cont is not None
            if cont is not None:
                copy_first.append(bool(cont) and cont[0] == truth[0])
            draft_len.append(d)
            copy_len.append(c)
            best_len.append(max(d, c))

    def figures(lengths: list[int]) -> dict:
        a = np.array(lengths)
        return {"tau": float(1 + a.mean()), "acc1": float((a > 0).mean())}

    return {"order": order, "anchors": row, "matched_share": matched / max(row, 1),
            "copy_first_token_precision": float(np.mean(copy_first)) if copy_first else None,
            "draft": figures(draft_len), "copy_else_draft": figures(copy_len), "better_of_both": figures(best_len)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=Path, required=True, help="JSONL prompts (held-out, never MT-Bench).")
    parser.add_argument("--limit", type=int, default=48)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--draft_model", default="default")
    parser.add_argument("--width", type=int, default=7)
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from dspark_core.models.drafts import resolve_draft_path
    from dspark_core.models.loading import load_target
    from dspark_core.models.speculators_io import load_draft
    from dspark_core.train.data import chat_ids, read_prompts_jsonl
    from dspark_core.train.evaluate import confidences_from_features, engine_acceptance
    from dspark_core.train.features import compute_features
    from dspark_core.train.losses import answer_span

    target = load_target(args.model)
    draft = load_draft(resolve_draft_path(args.draft_model, args.model)).bind_target(target)
    ids = [chat_ids(target.tokenizer, p) for p in read_prompts_jsonl(args.prompts)[: args.limit]]
    engine = engine_acceptance(target, draft, ids, width=args.width, max_tokens=args.max_tokens, buckets=(1, 2, 4, 8, 16))
    feats = compute_features(target, list(zip(ids, engine["outputs"])), draft.config.aux_layer_ids, k=2)
    _, hits = confidences_from_features(draft, feats)
    k_out = draft.config.num_speculative_tokens
    top1, top2, sequences = [], [], []
    for n in range(feats.num_sequences):  # the same anchors, in the same order, as confidences_from_features
        off, first, total = answer_span(feats, n)
        rows = off + torch.arange(first, total - k_out)
        top1.append(feats.topk_probs[rows, 0].float().numpy())
        top2.append(feats.topk_probs[rows, 1].float().numpy())
        sequences.append((feats.tokens[off : off + total].tolist(), first))
    report = {"prompts": str(args.prompts), "limit": args.limit, "width": args.width,
              "engine_tau": engine["tau"], "engine_acceptance_by_position": engine["acceptance_by_position"],
              **analyse(np.concatenate(top1), np.concatenate(top2), hits[:, 0].astype(bool)),
              "copy": [copy_study(sequences, hits.astype(bool), k_out, order) for order in (1, 2, 3)]}
    write_report(args.output, report)


if __name__ == "__main__":
    main()
