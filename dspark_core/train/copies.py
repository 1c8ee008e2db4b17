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

#: Fewest tries a cell (order, position) needs before its own rate is trusted; below that it
#: takes the rate of all orders at that position, or the position before (long copies of long
#: keys are rare in a small held-out set).
MIN_TRIES = 20


def copy_acceptance(sequences: Iterable[tuple[Sequence[int], Sequence[int]]], orders: Sequence[int],
                    width: int) -> dict:
    """Teacher-forced acceptance of copies over (prompt ids, greedy answer ids) pairs.

    ``orders`` are the key lengths tried, longest first, as the engine tries them. Returns
    ``anchors`` (anchors scanned), ``copied`` (anchors with a copy, per order), ``tries[o][j]``
    (copies of order index o whose token j was verified: tokens 0..j-1 accepted),
    ``hits[o][j]`` (token j accepted too) and ``confidences[o][j]``: hits / tries, the chance that
    copied token j is accepted once 0..j-1 were."""
    orders = tuple(orders)
    tries = [[0] * width for _ in orders]
    hits = [[0] * width for _ in orders]
    copied = [0] * len(orders)
    anchors = 0
    for prompt, answer in sequences:
        tokens = list(prompt) + list(answer)
        for p in range(len(prompt), len(tokens) - 1):  # every anchor with at least one true next token
            anchors += 1
            copy, order = copy_lookup_reference(tokens[: p + 1], orders, width)
            if order is None:
                continue
            index = orders.index(order)
            copied[index] += 1
            for j, token in enumerate(copy):
                if p + 1 + j >= len(tokens):
                    break
                tries[index][j] += 1
                if token != tokens[p + 1 + j]:
                    break
                hits[index][j] += 1
    pooled_tries = [sum(t[j] for t in tries) for j in range(width)]
    pooled_hits = [sum(h[j] for h in hits) for j in range(width)]
    confidences = []
    for row_tries, row_hits in zip(tries, hits):
        row: list[float] = []
        for j in range(width):
            if row_tries[j] >= MIN_TRIES:
                row.append(row_hits[j] / row_tries[j])
            elif pooled_tries[j] >= MIN_TRIES:
                row.append(pooled_hits[j] / pooled_tries[j])
            else:
                row.append(row[-1] if row else 0.5)
        # a stored confidence must lie in (0, 1]
        confidences.append([round(min(max(c, 0.01), 1.0), 4) for c in row])
    return {"orders": list(orders), "anchors": anchors, "copied": copied, "tries": tries, "hits": hits,
            "confidences": confidences}


def write_copy_settings(directory, orders: Sequence[int], confidences: Sequence[Sequence[float]]) -> None:
    """Store ``copy_order``, ``copy_min_order`` and ``copy_confidences`` (one row per order) in a
    draft's config.json, beside the STS temperatures."""
    from dspark_core.train.sts import update_project_settings

    update_project_settings(directory, {"copy_order": int(max(orders)), "copy_min_order": int(min(orders)),
                                        "copy_confidences": [[float(c) for c in row] for row in confidences]})


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
                orders: Sequence[int], copy_confidences: Sequence[Sequence[float]]):
    """Teacher-forced blocks as the engine proposes them with copies: confidences and hits ``[N, K]``.

    ``logits`` and ``hits`` are the draft's own blocks from
    :func:`dspark_core.train.evaluate.block_confidences` over the same greedy ``pairs`` (one row
    per anchor p with p + K inside the sequence, in order). Where a copy exists it fills the block
    (it repeats at the anchor), so its hits and its key length's confidences replace the draft's;
    elsewhere the draft's own stay."""
    import numpy as np

    width, orders = logits.shape[1], tuple(orders)
    confidences = 1.0 / (1.0 + np.exp(-np.asarray(logits, dtype=np.float64) / np.asarray(temperatures)[None, :]))
    hits = np.array(hits, dtype=bool)
    row = 0
    for prompt, answer in pairs:
        tokens = list(prompt) + list(answer)
        for p in range(len(prompt), len(tokens) - width):
            copy, order = copy_lookup_reference(tokens[: p + 1], orders, width)
            if order is not None:
                confidences[row] = copy_confidences[orders.index(order)]
                hits[row] = np.array(copy) == np.array(tokens[p + 1 : p + 1 + width])
            row += 1
    if row != len(hits):
        raise ValueError(f"{row} anchors in the pairs, {len(hits)} blocks: not the same sequences")
    return confidences, hits
