"""Confidence metrics and per-position temperature scaling (STS).

Notation for ``N`` drafted blocks of ``K`` proposals:

* ``hits [N, K]`` — proposal j matched the target's greedy token (teacher
  forced, so identical to the real chain up to its first miss);
* survival ``S_j = hits_0 * ... * hits_j`` — proposal j is accepted by greedy
  verification;
* predicted survival ``P_j = c_0 * ... * c_j`` with ``c_i = sigmoid(z_i / T_i)``.

STS picks ``T_0`` to minimise the ECE of ``P_0`` against ``S_0``, then, with
``T_0`` fixed, ``T_1`` for ``P_1`` against ``S_1``, and so on left to right,
by a log-spaced grid search (ECE is piecewise constant, so no gradients).
"""

from __future__ import annotations

import numpy as np

GRID = np.exp(np.linspace(np.log(0.05), np.log(20.0), 241))


def roc_auc(scores, labels) -> float:
    """Area under the ROC curve (Mann-Whitney U with tied scores counted half); NaN if one class is absent."""
    s = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(labels, dtype=bool).ravel()
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s), dtype=np.float64)
    sorted_s = s[order]
    i = 0
    while i < len(s):  # average ranks over ties
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i : j + 1]] = 0.5 * (i + j) + 1.0
        i = j + 1
    return float((ranks[y].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def ece(pred, outcome, bins: int = 15) -> float:
    """Expected calibration error with equal-width bins over [0, 1]."""
    p = np.asarray(pred, dtype=np.float64).ravel()
    o = np.asarray(outcome, dtype=np.float64).ravel()
    if p.size == 0:
        return float("nan")
    idx = np.minimum((p * bins).astype(int), bins - 1)
    # per bin: |sum(p) - sum(o)| = count * |mean(p) - mean(o)|; empty bins add 0
    gap = np.abs(np.bincount(idx, weights=p, minlength=bins) - np.bincount(idx, weights=o, minlength=bins))
    return float(gap.sum() / p.size)


def survival(hits) -> np.ndarray:
    """``S_j``: all proposals up to j hit."""
    return np.cumprod(np.asarray(hits, dtype=bool), axis=1).astype(bool)


def predicted_survival(logits, temperatures) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64) / np.asarray(temperatures, dtype=np.float64)[None, :]
    return np.cumprod(1.0 / (1.0 + np.exp(-z)), axis=1)


def survival_ece(logits, hits, temperatures, bins: int = 15) -> list[float]:
    """ECE of predicted vs actual cumulative survival at each position."""
    p, s = predicted_survival(logits, temperatures), survival(hits)
    return [ece(p[:, j], s[:, j], bins) for j in range(p.shape[1])]


def fit_sts(logits, hits, bins: int = 15, grid=GRID) -> list[float]:
    """Per-position temperatures fitted left to right (see module docstring)."""
    z = np.asarray(logits, dtype=np.float64)
    s = survival(hits)
    prefix = np.ones(z.shape[0])
    temps: list[float] = []
    for j in range(z.shape[1]):
        best_t, best_e = 1.0, float("inf")
        for t in grid:  # ties go to the temperature closest to 1 (grid order is ascending; compare distances)
            e = ece(prefix / (1.0 + np.exp(-z[:, j] / t)), s[:, j], bins)
            if e < best_e - 1e-12 or (abs(e - best_e) <= 1e-12 and abs(np.log(t)) < abs(np.log(best_t))):
                best_t, best_e = float(t), e
        temps.append(best_t)
        prefix = prefix / (1.0 + np.exp(-z[:, j] / best_t))
    return temps


OFFSETS = np.arange(-3.0, 3.0001, 0.25)


def fit_sts_with_offset(logits, hits, bins: int = 15, offsets=OFFSETS) -> tuple[float, list[float]]:
    """A shared logit offset ``b`` plus per-position temperatures: ``c_j = sigmoid((z_j + b) / T_j)``.

    Temperatures alone cannot move a head whose logits are biased (e.g. it
    learned the soft overlap ``1 - L1/2`` while greedy acceptance is a harder
    event); the offset is folded into the confidence head's bias, so serving
    still computes ``sigmoid(logit / T_j)``. For each ``b`` on the grid STS is
    fitted left to right; the ``b`` with the smallest worst-position survival
    ECE wins (ties: the smallest ``|b|``).
    """
    z = np.asarray(logits, dtype=np.float64)
    best = None
    for b in sorted(offsets, key=abs):
        temps = fit_sts(z + b, hits, bins)
        worst = max(survival_ece(z + b, hits, temps, bins))
        if best is None or worst < best[0] - 1e-12:
            best = (worst, float(b), temps)
    return best[1], best[2]


def add_confidence_offset(directory, offset: float) -> None:
    """Add ``offset`` to the confidence head's bias inside ``model.safetensors`` (dtype kept)."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    path = Path(directory) / "model.safetensors"
    tensors = load_file(str(path))
    key = "confidence_head.proj.bias"
    bias = tensors[key]
    tensors[key] = (bias.float() + float(offset)).to(bias.dtype)
    save_file(tensors, str(path))


def reached_auc(logits, hits) -> tuple[float, list[float]]:
    """ROC-AUC of the raw confidence for proposals the chain actually reaches (all earlier ones hit):
    pooled over positions, and per position."""
    z = np.asarray(logits, dtype=np.float64)
    h = np.asarray(hits, dtype=bool)
    reached = np.concatenate([np.ones((h.shape[0], 1), dtype=bool), survival(h)[:, :-1]], axis=1)
    per = [roc_auc(z[reached[:, j], j], h[reached[:, j], j]) for j in range(z.shape[1])]
    return roc_auc(z[reached], h[reached]), per


def tau_from_accepted(accepted) -> float:
    """Mean committed tokens per verification step (accepted drafts + the bonus token)."""
    a = np.asarray(accepted, dtype=np.float64)
    return float(a.mean() + 1.0) if a.size else float("nan")


def write_temperatures(directory, temperatures, *, output=None):
    """Store STS temperatures in a draft's config.json (``dspark_core.sts_temperatures``).

    With ``output`` the checkpoint is copied there first and the copy is updated.
    """
    dst = checkpoint_to_update(directory, output)
    update_project_settings(dst, {"sts_temperatures": [round(float(t), 6) for t in temperatures]})
    return dst


def update_project_settings(directory, values: dict) -> None:
    """Set ``values`` under the project's own key (``dspark_core``) of a draft's config.json, keeping
    everything else in it."""
    import json
    from pathlib import Path

    from dspark_core.models.speculators_io import PROJECT_KEY

    path = Path(directory) / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.setdefault(PROJECT_KEY, {}).update(values)
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def checkpoint_to_update(directory, output=None):
    """The draft directory a calibration writes into: ``directory`` itself, or ``output`` after the
    checkpoint's files are copied there."""
    import shutil
    from pathlib import Path

    src = Path(directory)
    dst = Path(output) if output is not None else src
    if dst.resolve() != src.resolve():  # (the same directory spelt another way is updated in place)
        dst.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file():
                shutil.copy2(f, dst / f.name)
    return dst
