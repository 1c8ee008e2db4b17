"""Target features for draft training, computed once and cached on disk.

For every generated sequence (prompt + on-policy answer) one frozen-target
forward yields, per position:

* the hidden states of the draft's auxiliary layers (concatenated, stored as
  float16) — what the draft's KV injection consumes;
* the teacher's top-k next-token ids and probabilities (float16). The full
  49k-way distribution is not stored: training compares the draft against the
  top-k distribution renormalised to 1 (see :mod:`dspark_core.train.losses`).

Training gets them from :func:`generate_with_features` for on-policy answers
(the generating forwards already compute them) or from :func:`compute_features`
for given sequences such as ShareGPT's own answers (one prefill forward per
packed group, no decoding); the pipeline caches both in the same shards.
Evaluation recomputes them with :func:`compute_features` too.
"""

from __future__ import annotations

import torch
from attrs import frozen

from dspark_core.models.base import make_forward_batch


@frozen
class FeatureSet:
    """Flat, concatenated features of many sequences."""

    tokens: torch.Tensor  # int64 [T]
    offsets: torch.Tensor  # int64 [N + 1]: sequence n is rows offsets[n]:offsets[n+1]
    prompt_lens: torch.Tensor  # int64 [N]
    hidden: torch.Tensor  # float16 [T, n_aux * d]
    topk_ids: torch.Tensor  # int64 [T, k]: teacher's top-k for the token after each row
    topk_probs: torch.Tensor  # float16 [T, k]

    @property
    def num_sequences(self) -> int:
        return int(self.prompt_lens.shape[0])

    def subset(self, index: list[int]) -> FeatureSet:
        """The sequences ``index`` (in that order) as a new set."""
        rows = [torch.arange(int(self.offsets[i]), int(self.offsets[i + 1])) for i in index]
        take = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        lens = torch.tensor([len(r) for r in rows], dtype=torch.long)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
        return FeatureSet(self.tokens[take], offsets, self.prompt_lens[index], self.hidden[take],
                          self.topk_ids[take], self.topk_probs[take])

    def to(self, device) -> FeatureSet:
        """The same set with the per-row tensors on ``device``; ``offsets`` and ``prompt_lens`` stay on
        the CPU (they are read as Python ints per sequence, which must not wait on the device)."""
        rows = {k: getattr(self, k).to(device) for k in ("tokens", "hidden", "topk_ids", "topk_probs")}
        return FeatureSet(offsets=self.offsets.cpu(), prompt_lens=self.prompt_lens.cpu(), **rows)

    @property
    def answer_tokens(self) -> int:
        """Rows after the prompts: the answer tokens the draft learns to propose."""
        return int((self.offsets.diff() - self.prompt_lens).sum())

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in ("tokens", "offsets", "prompt_lens", "hidden", "topk_ids", "topk_probs")}


@torch.no_grad()
def compute_features(target, sequences: list[tuple[list[int], list[int]]], aux_layers: tuple[int, ...], *,
                     k: int = 16, rows_per_forward: int = 2048, progress: bool = True) -> FeatureSet:
    """One target forward per packed group of sequences; returns the flat :class:`FeatureSet`."""
    from tqdm import tqdm

    seqs = [list(p) + list(a) for p, a in sequences]
    longest = max(len(s) for s in seqs)
    toks, hid, ids, probs = [], [], [], []
    bar = tqdm(total=len(seqs), desc="features", unit="seq", disable=not progress)
    for first, last in packed_groups([len(s) for s in seqs], rows_per_forward):
        group = seqs[first:last]
        cache = target.new_cache(len(group), longest)
        batch = make_forward_batch(group, [0] * len(group), list(range(len(group))), device=target.device)
        out = target.forward(batch, cache, hidden_layers=tuple(aux_layers))
        top_ids, top_probs = _topk(out.logits, k)
        toks.append(batch.tokens.cpu())
        hid.append(out.hidden.to(torch.float16).cpu())
        ids.append(top_ids)
        probs.append(top_probs)
        bar.update(len(group))
    bar.close()
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    return FeatureSet(
        tokens=torch.cat(toks), offsets=torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
        prompt_lens=torch.tensor([len(p) for p, _ in sequences], dtype=torch.long),
        hidden=torch.cat(hid), topk_ids=torch.cat(ids), topk_probs=torch.cat(probs),
    )


def token_counts(feats: FeatureSet, vocab_size: int) -> torch.Tensor:
    """Vocabulary score of each token: answer occurrences, plus the teacher's top-k probability mass
    at answer positions (plausible alternatives), plus a tenth of the prompt occurrences."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for n in range(feats.num_sequences):
        s, a, b = int(feats.offsets[n]), int(feats.offsets[n]) + int(feats.prompt_lens[n]), int(feats.offsets[n + 1])
        counts += torch.bincount(feats.tokens[a:b], minlength=vocab_size).double()
        counts += 0.1 * torch.bincount(feats.tokens[s:a], minlength=vocab_size).double()
        counts.index_add_(0, feats.topk_ids[a - 1 : b - 1].reshape(-1), feats.topk_probs[a - 1 : b - 1].reshape(-1).double())
    return counts


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return top.indices.cpu(), top.values.to(torch.float16).cpu()


@torch.no_grad()
def generate_with_features(target, prompts: list[list[int]], aux_layers: tuple[int, ...], *, max_tokens: int,
                           k: int = 16, batch: int = 16,
                           rows_per_forward: int = 2048) -> tuple[list[tuple[list[int], list[int]]], FeatureSet]:
    """Greedy answers *and* their features in one pass: the generating forwards already compute them.

    Prompts run ``batch`` at a time: prefill forwards of at most
    ``rows_per_forward`` prompt rows each (a prompt longer than that gets a
    forward of its own), then one decode forward per token over the
    still-running requests. The hidden states and
    top-k of the fed rows are recorded, so no second target pass is needed.
    Answers stop after EOS (kept) or ``max_tokens``. The last answer token is
    never fed, so its row holds zeros: training never reads it (it would only
    be context for, or teacher of, an anchor past the end).
    """
    eos = set(target.config.eos_token_ids)
    aux = tuple(aux_layers)
    pairs, sets = [], []
    for start in range(0, len(prompts), batch):
        group = prompts[start : start + batch]
        n = len(group)
        cache = target.new_cache(n, max(map(len, group)) + max_tokens + 1)
        rows: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
        answers: list[list[int]] = []
        for first, last in packed_groups([len(p) for p in group], rows_per_forward):
            # one forward over all prompts of a large batch would hold every prompt row's float32
            # logits at once (6.5 GB for 128 SmolLM2 prompts) and ran at half the rows/s on the CPU
            fb = make_forward_batch(group[first:last], [0] * (last - first), list(range(first, last)), device=target.device)
            out = target.forward(fb, cache, hidden_layers=aux)
            ids, probs = _topk(out.logits, k)
            hid = out.hidden.to(torch.float16).cpu()
            bounds = fb.row_offsets.tolist()
            rows += [[(hid[a:b], ids[a:b], probs[a:b])] for a, b in zip(bounds[:-1], bounds[1:])]
            answers += [[int(ids[b - 1, 0])] for b in bounds[1:]]
        for _ in range(max_tokens - 1):
            live = [i for i in range(n) if answers[i][-1] not in eos and len(answers[i]) < max_tokens]
            if not live:
                break
            fb = make_forward_batch([[answers[i][-1]] for i in live], [len(group[i]) + len(answers[i]) - 1 for i in live], live, device=target.device)
            out = target.forward(fb, cache, hidden_layers=aux)
            ids, probs = _topk(out.logits, k)
            hid = out.hidden.to(torch.float16).cpu()
            for r, i in enumerate(live):
                rows[i].append((hid[r : r + 1], ids[r : r + 1], probs[r : r + 1]))
                answers[i].append(int(ids[r, 0]))
        for i in range(n):
            parts = rows[i]
            missing = len(group[i]) + len(answers[i]) - sum(p[0].shape[0] for p in parts)  # the last token was never fed
            width = parts[0][0].shape[1]
            parts.append((torch.zeros(missing, width, dtype=torch.float16), torch.zeros(missing, k, dtype=torch.long),
                          torch.zeros(missing, k, dtype=torch.float16)))
            sets.append([torch.cat([p[j] for p in parts]) for j in range(3)])
            pairs.append((list(group[i]), answers[i]))
    lens = torch.tensor([len(p) + len(a) for p, a in pairs], dtype=torch.long)
    feats = FeatureSet(
        tokens=torch.tensor([t for p, a in pairs for t in p + a], dtype=torch.long),
        offsets=torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
        prompt_lens=torch.tensor([len(p) for p, _ in pairs], dtype=torch.long),
        hidden=torch.cat([s[0] for s in sets]), topk_ids=torch.cat([s[1] for s in sets]), topk_probs=torch.cat([s[2] for s in sets]),
    )
    return pairs, feats


def packed_groups(lengths: list[int], rows_per_forward: int) -> list[tuple[int, int]]:
    """Consecutive ``[first, last)`` index ranges whose summed lengths stay within ``rows_per_forward``
    (a single longer item is a range of its own): the sequences one target forward packs."""
    groups, first, rows = [], 0, 0
    for i, length in enumerate(lengths):
        if i > first and rows + length > rows_per_forward:
            groups.append((first, i))
            first, rows = i, 0
        rows += length
    if lengths:
        groups.append((first, len(lengths)))
    return groups


def concat_features(parts: list[FeatureSet]) -> FeatureSet:
    """One set holding every sequence of ``parts`` in order."""
    lens = torch.cat([p.offsets.diff() for p in parts])
    return FeatureSet(torch.cat([p.tokens for p in parts]), torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
                      torch.cat([p.prompt_lens for p in parts]), torch.cat([p.hidden for p in parts]),
                      torch.cat([p.topk_ids for p in parts]), torch.cat([p.topk_probs for p in parts]))
