"""How often copy proposals are right: the per-position confidences a draft's config stores.

Copied tokens get no confidence from the draft's head, which never saw them;
the budget policy still needs one per token. A copy's chance of acceptance is a
property of the target and its text, not of the draft, so it is measured
teacher forced on the target's own greedy answers: at every anchor of every
answer, the copy that the engine would propose (:func:`copy_lookup_reference`)
against the tokens the target really produced next.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dspark_kernels.copy_lookup import copy_lookup_reference

#: Fewest tries a position needs before its own rate is trusted; below that it takes the
#: previous position's value (long copies are rare in a small held-out set).
MIN_TRIES = 20


def copy_acceptance(sequences: Iterable[tuple[Sequence[int], Sequence[int]]], order: int, width: int) -> dict:
    """Teacher-forced acceptance of copies over (prompt ids, greedy answer ids) pairs.

    Returns ``anchors`` (anchors scanned), ``copied`` (anchors with a copy), ``tries[j]`` (copies
    whose token j was verified: tokens 0..j-1 accepted and the copy that long), ``hits[j]`` (token
    j accepted too) and ``confidences[j]``: hits / tries, the chance that copied token j is
    accepted once 0..j-1 were (a sparse position takes the one before it)."""
    tries, hits = [0] * width, [0] * width
    anchors = copied = 0
    for prompt, answer in sequences:
        tokens = list(prompt) + list(answer)
        for p in range(len(prompt), len(tokens) - 1):  # every anchor with at least one true next token
            anchors += 1
            copy = copy_lookup_reference(tokens[: p + 1], order, width)
            copied += bool(copy)
            for j, token in enumerate(copy):
                if p + 1 + j >= len(tokens):
                    break
                tries[j] += 1
                if token != tokens[p + 1 + j]:
                    break
                hits[j] += 1
    confidences: list[float] = []
    for j in range(width):
        if tries[j] >= MIN_TRIES:
            confidences.append(hits[j] / tries[j])
        else:
            confidences.append(confidences[-1] if confidences else 0.5)
    # a stored confidence must lie in (0, 1]
    confidences = [round(min(max(c, 0.01), 1.0), 4) for c in confidences]
    return {"order": order, "anchors": anchors, "copied": copied, "tries": tries, "hits": hits,
            "confidences": confidences}


def write_copy_settings(directory, order: int, confidences: Sequence[float]) -> None:
    """Store ``copy_order`` and ``copy_confidences`` in a draft's config.json (beside the STS temperatures)."""
    import json
    from pathlib import Path

    from dspark_core.models.speculators_io import PROJECT_KEY

    path = Path(directory) / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    extras = config.setdefault(PROJECT_KEY, {})
    extras["copy_order"] = int(order)
    extras["copy_confidences"] = [float(c) for c in confidences]
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def greedy_sequences(feats) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) of a feature set, each answer cut where it leaves the target's greedy
    path (its stored token differs from the target's top-1 there): copies are judged against what
    greedy decoding would have produced, and a ShareGPT answer is greedy only for a while."""
    pairs = []
    for n in range(feats.num_sequences):
        off, first, total = int(feats.offsets[n]), int(feats.prompt_lens[n]), int(feats.offsets[n + 1] - feats.offsets[n])
        tokens = feats.tokens[off : off + total].tolist()
        greedy = feats.topk_ids[off : off + total, 0].tolist()  # the target's top-1 after each row
        end = first
        while end < total and tokens[end] == greedy[end - 1]:
            end += 1
        pairs.append((tokens[:first], tokens[first:end]))
    return pairs


def with_copies(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], logits, hits, temperatures: Sequence[float],
                order: int, copy_confidences: Sequence[float]):
    """Teacher-forced blocks as the engine proposes them with copies: confidences and hits ``[N, K]``.

    ``logits`` and ``hits`` are the draft's own blocks from
    :func:`dspark_core.train.evaluate.block_confidences` over the same greedy ``pairs`` (one row
    per anchor p with p + K inside the sequence, in order). Where a copy exists, its tokens replace
    the first positions with their hits and the copy confidences; the rest keep the draft's
    (teacher forced, the draft's later tokens see the true prefix either way)."""
    import numpy as np

    width = logits.shape[1]
    confidences = 1.0 / (1.0 + np.exp(-np.asarray(logits, dtype=np.float64) / np.asarray(temperatures)[None, :]))
    hits = np.array(hits, dtype=bool)
    row = 0
    for prompt, answer in pairs:
        tokens = list(prompt) + list(answer)
        for p in range(len(prompt), len(tokens) - width):
            copy = copy_lookup_reference(tokens[: p + 1], order, width)
            for j, token in enumerate(copy):
                confidences[row, j] = copy_confidences[j]
                hits[row, j] = token == tokens[p + 1 + j]
            row += 1
    if row != len(hits):
        raise ValueError(f"{row} anchors in the pairs, {len(hits)} blocks: not the same sequences")
    return confidences, hits
