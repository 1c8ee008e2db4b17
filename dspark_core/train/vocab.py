"""Shrinking a trained draft's vocabulary to the tokens it proposes most usefully.

The draft's LM head is the target's, restricted to the draft vocabulary, so
its cost per proposal grows with that vocabulary: with the shipped SmolLM2
draft on a CPU the head was about two thirds of a proposal. Dropping the
rarest tokens needs no retraining. A proposal's greedy token changes only
where it was one of the dropped tokens (the softmax normalisation does not
move an argmax), so the acceptance lost is bounded by how often the target
emits a dropped token.

Rarity is scored on the training data (:func:`dspark_core.train.features.token_counts`
over the feature shards that trained the draft), never on evaluation prompts.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import attrs
import torch

from dspark_core.errors import ConfigError
from dspark_core.models.dspark_draft import DSparkDraft
from dspark_core.train.features import FeatureSet, token_counts


def shard_token_scores(shard_dirs: Iterable[Path], vocab_size: int) -> tuple[torch.Tensor, int]:
    """Summed :func:`token_counts` over every ``part-*.pt`` shard in ``shard_dirs`` (and the shard count)."""
    scores = torch.zeros(vocab_size, dtype=torch.float64)
    shards = 0
    for directory in shard_dirs:
        paths = sorted(Path(directory).glob("part-*.pt"))
        if not paths:
            raise ConfigError(f"--features: {directory} holds no feature shards (part-*.pt)")
        for path in paths:
            shard = torch.load(path, weights_only=True)  # written by sources._shards
            scores += token_counts(FeatureSet(**shard["features"]), vocab_size)
            shards += 1
    return scores, shards


def check_size(draft: DSparkDraft, size: int) -> None:
    """A shrunk vocabulary keeps between 1 and all of the draft's tokens."""
    vocab = draft.config.draft_vocab_size
    if not 1 <= size <= vocab:
        raise ConfigError(f"--draft_vocab must be in 1..{vocab} (the draft's vocabulary), got {size}")


def keep_most_frequent(draft: DSparkDraft, scores: torch.Tensor, size: int) -> torch.Tensor:
    """Target ids of the ``size`` draft-vocabulary tokens that score highest, ascending.

    Ties go to the smaller token id, so the choice is deterministic.
    """
    check_size(draft, size)
    if scores.shape != (draft.config.target_vocab_size,):
        raise ConfigError(f"token scores cover {scores.shape[0]} tokens; the target has {draft.config.target_vocab_size}")
    candidates = draft.draft_to_target().cpu()
    # stable sort on the negated score: equal scores keep ascending token id order
    order = torch.sort(-scores[candidates], stable=True).indices
    return candidates[order[:size]].sort().values


def shrink_vocabulary(draft: DSparkDraft, keep: torch.Tensor) -> DSparkDraft:
    """A new draft that proposes only the target ids ``keep`` (ascending, all in the draft's vocabulary).

    Every weight is copied; the rows of the draft-vocabulary tensors (the
    Markov head's output, a checkpoint's own LM head) are sliced to ``keep``.
    The new draft is unbound: call ``bind_target`` before proposing.
    """
    keep = keep.to(torch.long).cpu()
    old_ids = draft.draft_to_target().cpu()
    position = torch.full((draft.config.target_vocab_size,), -1, dtype=torch.long)
    position[old_ids] = torch.arange(old_ids.numel())
    rows = position[keep]
    if keep.numel() == 0 or bool((rows < 0).any()) or bool((keep.diff() <= 0).any()):
        raise ConfigError("the kept tokens must be ascending, unique and inside the draft's vocabulary")
    config = attrs.evolve(draft.config, draft_vocab_size=int(keep.numel()))
    small = DSparkDraft(config).to(draft.fc.weight.dtype)
    state = draft.state_dict()
    for name in ("markov_head.markov_w2.weight", "lm_head"):
        if name in state:
            state[name] = state[name][rows.to(state[name].device)]
    state.pop("d2t", None)
    state.pop("t2d", None)
    if "lm_head" in state:  # a checkpoint's own head: give the new draft a parameter of the new shape first
        small.lm_head = torch.nn.Parameter(state["lm_head"].clone(), requires_grad=False)
    missing, unexpected = small.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if m not in ("d2t", "t2d")]:
        raise ConfigError(f"vocabulary shrink: state mismatch (missing {missing}, unexpected {unexpected})")
    if small.d2t is not None:
        small.d2t.copy_(keep - torch.arange(keep.numel()))
        small.t2d.zero_()
        small.t2d[keep] = True
    return small
