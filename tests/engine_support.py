"""Shared builders for engine tests: tiny float64 models, a synthetic cost table, an oracle draft."""

from __future__ import annotations

import torch
from attrs import frozen

from dspark_core.calibration.settings import CalibrationSettings, ContextInterval
from dspark_core.costs.base import CostSample
from dspark_core.geometry import legal_tiers
from dspark_core.models.random_models import random_draft, random_target, tiny_target_config
from dspark_core.models.reference import greedy_generate
from dspark_core.policy import StepPlan
from dspark_plugins.policies.adaptive import AdaptivePolicy
from dspark_core.table import CostTable, IntervalFit, default_lookup, fit_table


def tiny_pair(seed: int = 0, block_size: int = 7):
    """A float64 tiny target (ties in argmax are then practically impossible) and a random draft."""
    cfg = tiny_target_config(max_position=512)
    target = random_target(cfg, seed=seed, dtype=torch.float64)
    draft = random_draft(cfg, seed=seed, block_size=block_size).to(torch.float64)
    return target, draft


def random_prompts(count: int, seed: int = 0, vocab: int = 90) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (count,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def synthetic_table(width: int, buckets: tuple[int, ...], *, per_row: float = 0.002, step: float = 0.01,
                    max_kv: int = 4096):
    """An additive cost table with a staircase in rows, as calibration would produce."""
    samples = []
    for bucket in buckets:
        for rows in legal_tiers(bucket, width):
            seconds = 0.02 + 0.001 * bucket + per_row * rows + step * (rows // 8)
            samples.append(CostSample(bucket, rows, 0, seconds * 4, 4))
    settings = CalibrationSettings(model="additive", draft_width=width, request_buckets=buckets,
                                   contexts=(ContextInterval(min(64, max_kv), 1, max_kv),), warmup_steps=1, window_steps=4,
                                   windows_per_point=1, token_seed=1)
    table = fit_table(settings, samples, default_lookup())
    if max_kv == 4096:
        return table
    # a bare fit limited to one KV interval: longer contexts have no calibrated profile
    return CostTable(width, "additive", [IntervalFit(settings.contexts[0], table.fits[0].cost)])


def draft_off_table(width: int, buckets: tuple[int, ...], *, off_seconds: float = 0.012, per_row: float = 0.001,
                    model: str = "additive"):
    """A calibrated-looking table with draft-off costs: a drafted step of G rows costs 20 ms +
    ``per_row`` per row, a draft-off step ``off_seconds`` + 0.5 ms per request."""
    samples = [CostSample(b, g, 0, 4 * (0.02 + per_row * g), 4) for b in buckets for g in legal_tiers(b, width)]
    samples += [CostSample(b, b, 0, 4 * (off_seconds + 0.0005 * b), 4, draft_off=True) for b in buckets]
    settings = CalibrationSettings(model=model, draft_width=width, request_buckets=buckets,
                                   contexts=(ContextInterval(64, 1, 4096),), warmup_steps=1, window_steps=4,
                                   windows_per_point=1, token_seed=1)
    return fit_table(settings, samples, default_lookup())


@frozen
class NeverDrafts(AdaptivePolicy):
    """Adaptive whose plan turns the draft off on every step, so every step is a copy step or a
    draft-off step."""

    def plan(self, ctx, confidences, caps):
        return StepPlan(draft=False)


class DraftDouble:
    """Base of the test doubles: a real draft does the work (context, proposal shapes);
    subclasses rewrite what ``propose`` returns."""

    def __init__(self, draft) -> None:
        self.inner = draft
        self.config = draft.config

    def bind_target(self, target):
        self.inner.bind_target(target)
        return self

    def allocate_context(self, num_slots, max_len):
        return self.inner.allocate_context(num_slots, max_len)

    def extend_context(self, hidden, positions, slot_of_row):
        self.inner.extend_context(hidden, positions, slot_of_row)

    def propose(self, anchors, positions, slots):
        return self.inner.propose(anchors, positions, slots)


class OracleDraft(DraftDouble):
    """Test double wrapping a real draft: proposes the target's true greedy continuation,
    corrupted at random positions, with informative confidences. It exercises the
    accept paths (long and partial acceptance) that a random draft almost never hits."""

    def __init__(self, draft, continuations: dict[tuple[int, ...], list[int]], seed: int = 0,
                 corrupt: float = 0.25) -> None:
        super().__init__(draft)
        self.continuations = continuations  # prompt -> target-only greedy continuation
        self.generator = torch.Generator().manual_seed(seed)
        self.corrupt = corrupt
        self.engine = None  # set by the test once the engine exists
        self.depths: list[tuple[int, int]] = []  # (rows, tokens proposed) of every call

    def propose(self, anchors, positions, slots, depth=None):
        # with a draft depth only the first ``depth`` tokens are proposed (the rest: confidence 0)
        tokens, confidences = self.inner.propose(anchors, positions, slots, **({} if depth is None else {"depth": depth}))
        self.depths.append((tokens.shape[0], tokens.shape[1] if depth is None else depth))
        k = tokens.shape[1] if depth is None else depth
        for r in range(tokens.shape[0]):
            seq = self._sequence_for(int(slots[r]))
            pos = int(positions[r])
            truth = seq[pos + 1: pos + 1 + k] if seq else []
            for j, tok in enumerate(truth):
                wrong = bool(torch.rand(1, generator=self.generator) < self.corrupt)
                tokens[r, j] = (tok + 1) % self.config.target_vocab_size if wrong else tok
                confidences[r, j] = 0.2 if wrong else 0.9
        return tokens, confidences

    def _sequence_for(self, slot: int) -> list[int] | None:
        # with schedule overlap a step may still run for a request the host already finished
        request = next((r for r in list(self.engine.scheduler.running) if r.slot == slot), None)
        return None if request is None else list(request.prompt) + self.continuations[tuple(request.prompt)]


def greedy_references(target, prompts, max_tokens):
    return [greedy_generate(target, p, max_tokens) for p in prompts]
