"""What the draft's own distribution adds to its confidence head: evidence for the next training run.

The adaptive split gives a step's rows to the drafted tokens with the largest predicted survival,
so it gains over an even split only as far as the confidences tell good tokens from bad. This
script asks whether the draft already knows more than its confidence head says. At every anchor of
greedy answers to held-out prompts (teacher forced, as ``eval-draft`` scores acceptance) it records,
per drafted position, the head's logit, the draft's top-1 log-probability, its lead over the second
token, the draft's entropy, and whether the target's greedy token matched. Logistic models of
acceptance (given the earlier positions accepted) are fitted on half of the answers and scored on
the other half, and the other way round (two folds, split by answer), for three inputs: the head's
logit alone, the head with the draft's statistics, the statistics alone. It reports

* per position, each model's ROC-AUC (out of fold);
* at ``--requests`` requests, the draft tokens accepted per verified draft row when a step's rows go
  to the largest predicted survivals, for the shipped (STS) confidences, the refitted head, the head
  with the statistics, and an oracle that knows the hits: how much a better confidence would buy.

``--traces PATH`` also writes the records in the format of ``benchmarks/policy_replay.py`` with two
drafts, ``shipped`` and ``head+draft`` (out-of-fold confidences as logits, temperature 1), so the
policies can be replayed on both under a cost table. Use held-out prompts, never MT-Bench::

    python benchmarks/heldout_prompts.py /tmp/heldout.jsonl --count 80 --training_prompts 10728
    python benchmarks/confidence_features.py --prompts /tmp/heldout.jsonl --limit 80 \\
        --output benchmarks/results/confidence-features/heldout-80.json --traces /tmp/traces-both.npz
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from common import set_threads, write_report
from scipy.optimize import minimize
from scipy.stats import mannwhitneyu

STATISTICS = ("logpmax", "margin", "entropy")
INPUTS = {"head": ("logit",), "head+draft": ("logit", *STATISTICS), "draft only": STATISTICS}


def record(target, draft, prompts: list[list[int]], max_tokens: int, batch: int) -> dict[str, np.ndarray]:
    """Greedy answers, then per anchor ``[N, K]`` arrays: ``logit``, ``logpmax``, ``margin``, ``entropy``,
    ``hit``; and ``answer`` ``[N]``, the answer each anchor belongs to (the anchors of ``eval-draft``'s
    offline scoring, :func:`~dspark_core.train.evaluate.teacher_forced_blocks`)."""
    from dspark_core.train.evaluate import teacher_forced_blocks
    from dspark_core.train.features import generate_with_features

    _, feats = generate_with_features(target, prompts, draft.config.aux_layer_ids, max_tokens=max_tokens, k=1,
                                      batch=batch)
    columns: dict[str, list[np.ndarray]] = {name: [] for name in ("logit", *STATISTICS, "hit", "answer")}
    with torch.no_grad():
        for n, out, hits in teacher_forced_blocks(draft, feats):
            log_probs = torch.log_softmax(out.logits[0].float(), -1)
            top2 = log_probs.topk(2, -1).values
            columns["logit"].append(out.confidence_logits[0].float().numpy())
            columns["logpmax"].append(top2[..., 0].numpy())
            columns["margin"].append((top2[..., 0] - top2[..., 1]).numpy())
            columns["entropy"].append(-(log_probs.exp() * log_probs).sum(-1).numpy())
            columns["hit"].append(hits.numpy())
            columns["answer"].append(np.full(len(hits), n))
    return {name: np.concatenate(parts) for name, parts in columns.items()}


def alive(hits: np.ndarray) -> np.ndarray:
    """``[N, K]``: anchors whose positions before each one were all accepted (where it is verified)."""
    return np.c_[np.ones(len(hits), dtype=bool), np.cumprod(hits, 1)[:, :-1].astype(bool)]


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC-AUC of ``scores`` for boolean ``labels`` (the Mann-Whitney U statistic, ties counted half)."""
    positive, negative = scores[labels], scores[~labels]
    return float(mannwhitneyu(positive, negative).statistic / (len(positive) * len(negative)))


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1e-3) -> np.ndarray:
    """Weights (the bias last) of an L2-regularised logistic regression of ``y`` on standardised ``x``."""
    design = np.c_[x, np.ones(len(x))]

    def loss(w: np.ndarray) -> tuple[float, np.ndarray]:
        p = 1.0 / (1.0 + np.exp(-(design @ w)))
        value = -np.mean(y * np.log(p + 1e-12) + (1 - y) * np.log(1 - p + 1e-12)) + l2 * float(w[:-1] @ w[:-1])
        grad = design.T @ (p - y) / len(y)
        grad[:-1] += 2 * l2 * w[:-1]
        return value, grad

    return minimize(loss, np.zeros(design.shape[1]), jac=True, method="L-BFGS-B").x


def cross_fitted(data: dict[str, np.ndarray], inputs: tuple[str, ...], folds: list[np.ndarray]) -> np.ndarray:
    """Out-of-fold probabilities ``[N, K]`` that each position is accepted given the earlier ones were,
    from ``inputs``: each fold is predicted by models fitted on the other folds' answers, at every
    position on the anchors whose earlier positions were all accepted."""
    hits = data["hit"]
    verified = alive(hits)
    out = np.zeros(hits.shape)
    for held in folds:
        test = np.isin(data["answer"], held)
        for j in range(hits.shape[1]):
            x = np.stack([data[name][:, j] for name in inputs], 1)
            train = ~test & verified[:, j]
            mean, spread = x[train].mean(0), x[train].std(0) + 1e-9
            w = fit_logistic((x[train] - mean) / spread, hits[train, j].astype(float))
            out[test, j] = 1.0 / (1.0 + np.exp(-(np.c_[(x[test] - mean) / spread, np.ones(test.sum())] @ w)))
    return out


def split_yield(predicted: np.ndarray, hits: np.ndarray, requests: int, rows: int, trials: int, seed: int) -> float:
    """Draft tokens accepted per draft row when ``rows`` rows go to the largest predicted survivals of
    ``requests`` anchors drawn at random (``trials`` draws): the adaptive split's yield."""
    survival, true_survival = np.cumprod(predicted, 1), np.cumprod(hits, 1)
    rng = np.random.default_rng(seed)
    accepted = 0.0
    for _ in range(trials):
        batch = rng.choice(len(hits), requests, replace=False)
        chosen = np.argsort(-survival[batch].ravel(), kind="stable")[:rows]  # survival falls along a block
        accepted += true_survival[batch].ravel()[chosen].sum()
    return accepted / (trials * rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", required=True, help="JSONL prompts (held-out ShareGPT, never MT-Bench).")
    parser.add_argument("--limit", type=int, default=80, help="Use only the first N prompts.")
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=40, help="Answers generated at once.")
    parser.add_argument("--requests", type=int, default=16, help="Requests per step in the split-yield estimate.")
    parser.add_argument("--rows", default="8,16,24,32", help="Draft rows per step in the split-yield estimate.")
    parser.add_argument("--trials", type=int, default=1500)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None, help="JSON report.")
    parser.add_argument("--traces", default=None, help="Also write policy_replay.py traces (shipped, head+draft).")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",") if r]
    if args.limit < 2 or any(r < 1 for r in rows):
        parser.error("--limit needs at least 2 prompts (two folds) and --rows positive counts")
    set_threads(args.threads)
    from dspark_core.models.drafts import resolve_draft_path
    from dspark_core.models.loading import load_target
    from dspark_core.models.speculators_io import load_draft
    from dspark_core.train.data import chat_ids, read_prompts_jsonl

    target = load_target("smollm2", dtype=torch.float32)
    prompts = [chat_ids(target.tokenizer, p) for p in read_prompts_jsonl(Path(args.prompts))[: args.limit]]
    draft = load_draft(resolve_draft_path("default", "smollm2")).bind_target(target)
    data = record(target, draft, prompts, args.max_tokens, args.batch)
    hits = data["hit"]
    answers = np.unique(data["answer"])
    np.random.default_rng(0).shuffle(answers)
    folds = np.array_split(answers, 2)
    predicted = {name: cross_fitted(data, inputs, folds) for name, inputs in INPUTS.items()}
    verified = alive(hits)
    positions = []
    for j in range(hits.shape[1]):
        here = verified[:, j]
        row = {"position": j + 1, "anchors": int(here.sum()), "accepted": float(hits[here, j].mean())}
        row.update({f"auc_{name}": round(auc(p[here, j], hits[here, j]), 4) for name, p in predicted.items()})
        positions.append(row)
    temperatures = draft.temperatures.numpy().astype(np.float64)
    candidates = {"shipped": 1.0 / (1.0 + np.exp(-data["logit"] / temperatures)), "head": predicted["head"],
                  "head+draft": predicted["head+draft"], "oracle": hits.astype(float)}
    yields = [{"rows": r, **{name: round(split_yield(p, hits, args.requests, r, args.trials, seed=1), 4)
                             for name, p in candidates.items()}} for r in rows]
    write_report(args.output, {"prompts": args.prompts, "answers": len(answers), "anchors": len(hits),
                               "tau_full_width": round(float(1 + np.cumprod(hits, 1).sum(1).mean()), 4),
                               "positions": positions, "requests": args.requests, "split_yield": yields})
    if args.traces:
        lengths = np.bincount(data["answer"], minlength=int(data["answer"].max()) + 1)
        both = np.clip(predicted["head+draft"], 1e-6, 1 - 1e-6)
        np.savez_compressed(args.traces, names=np.array(["shipped", "head+draft"]),
                            d0_lengths=lengths, d0_logits=data["logit"].astype(np.float32), d0_hits=hits,
                            d0_temperatures=temperatures.astype(np.float32),
                            d1_lengths=lengths, d1_logits=np.log(both / (1 - both)).astype(np.float32), d1_hits=hits,
                            d1_temperatures=np.ones(hits.shape[1], dtype=np.float32))


if __name__ == "__main__":
    main()
