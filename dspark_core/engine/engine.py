"""The engine: request lifecycle around the decode step.

``Engine.generate`` is the in-process API used by tests, the benchmark and
the HTTP server. Each iteration admits waiting requests (prefill), runs one
decode step for every running request and retires finished ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from attrs import field, frozen

from dspark_core.engine.request import Request, RequestOutput, SamplingParams, make_output, truncate_at_eos
from dspark_core.engine.runner import ModelRunner
from dspark_core.engine.scheduler import Scheduler
from dspark_core.engine.slots import SlotStorage
from dspark_core.engine.step import DecodeStep
from dspark_core.errors import ConfigError
from dspark_core.geometry import Geometry
from dspark_core.plugins import Hooks, default_hooks
from dspark_core.policy import TierContext


@frozen
class EngineConfig:
    """Engine-level settings (the serve flags map onto these)."""

    draft_width: int = 7
    policy: str = "adaptive"
    policy_options: Mapping[str, Any] = field(factory=dict, converter=dict)
    request_buckets: tuple[int, ...] = field(default=(1, 2, 4, 8, 16), converter=tuple)
    max_model_len: int = 2048
    max_prefill_tokens: int = 8192


@frozen
class EngineCounters:
    """Step counters since start (read by tests, metrics and the benchmark)."""

    steps: int
    fallback_steps: int
    committed_tokens: int


class Engine:
    """Continuous-batching speculative decoding over one target (+ DSpark draft)."""

    def __init__(self, target, draft, config: EngineConfig = EngineConfig(), *, hooks: Hooks | None = None,
                 geometry: Geometry | None = None) -> None:
        self.config = config
        self.hooks = hooks or default_hooks()
        self.policy = self.hooks.budget_policy(config.policy, config.policy_options)
        if self.policy.uses_draft and draft is None:
            raise ConfigError(f"budget policy {config.policy!r} needs a draft model")
        self.geometry = geometry or Geometry.all_tiers(config.draft_width, config.request_buckets)
        if self.geometry.draft_width != config.draft_width:
            raise ConfigError(f"geometry width {self.geometry.draft_width} differs from draft_width {config.draft_width}")
        num_slots = self.geometry.max_bucket
        # the model's own context limit caps the configured length
        self.max_model_len = min(config.max_model_len, target.config.max_position)
        self.runner = ModelRunner(target, draft if self.policy.uses_draft else None, draft_width=config.draft_width,
                                  num_slots=num_slots, max_len=self.max_model_len)
        self.storage = SlotStorage(num_slots, config.draft_width, self.max_model_len, device=self.runner.device)
        self.scheduler = Scheduler(self.storage, num_slots, config.max_prefill_tokens)
        self.tokenizer = getattr(target, "tokenizer", None)
        self.eos_ids = tuple(target.config.eos_token_ids)
        self.table = None
        self._tier_costs: dict[tuple[int, int], np.ndarray | None] = {}
        self._steps = self._fallbacks = self._committed = 0

    # -- cost table ------------------------------------------------------------
    def install_table(self, table) -> None:
        """Install an immutable cost table (before serving); clears cached per-tier costs."""
        if table is not None and table.draft_width != self.config.draft_width:
            raise ConfigError(f"cost table is for draft_width {table.draft_width}, the launch uses {self.config.draft_width}")
        self.table = table
        self._tier_costs.clear()

    def tier_costs(self, bucket: int, kv_length: int) -> np.ndarray | None:
        """Seconds per captured tier of ``bucket`` at ``kv_length`` (None: no calibrated profile)."""
        if self.table is None:
            return None
        fit = self.table.fit_for(kv_length)
        if fit is None:
            return None
        key = (bucket, self.table.fits.index(fit))
        if key not in self._tier_costs:
            costs = [fit.cost.predict_seconds(bucket, rows) for rows in self.geometry.rows_for(bucket)]
            values = np.array([np.nan if c is None else c for c in costs], dtype=np.float64)
            self._tier_costs[key] = None if np.isnan(values).all() else values
        return self._tier_costs[key]

    # -- requests --------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int] | Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of a raw text prompt, a chat message list or already-tokenized ids."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        items = list(prompt)
        if items and isinstance(items[0], Mapping):
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(items))
        return [int(t) for t in items]

    def add_request(self, prompt: str | Sequence[int] | Sequence[Mapping[str, str]],
                    params: SamplingParams = SamplingParams()) -> Request:
        """Queue a request; it joins the running batch at the next iteration with a free slot."""
        ids = self.encode(prompt)
        if not ids:
            raise ConfigError("prompt: must not be empty")
        need = len(ids) + params.max_tokens + self.config.draft_width + 1
        if need > self.max_model_len:
            raise ConfigError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) + draft width + 1 = {need} "
                f"exceeds max_model_len {self.max_model_len}"
            )
        request = Request(ids, params)
        self.scheduler.add(request)
        return request

    # -- the loop --------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: prefill newly admitted requests, one decode step for all running ones."""
        finished: list[RequestOutput] = []
        admitted = self.scheduler.admit()
        if admitted:
            first = self.runner.prefill([r.prompt for r in admitted], [r.slot for r in admitted])
            for request, token in zip(admitted, first):
                self._append(request, [token], finished)
        running = list(self.scheduler.running)
        if running:
            self._decode(running, finished)
        return finished

    def _decode(self, running: list[Request], finished: list[RequestOutput]) -> None:
        device = self.runner.device
        n = len(running)
        bucket = self.geometry.bucket_for(n)
        width = self.config.draft_width
        as_long = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        positions = [r.anchor_position for r in running]
        # verifying past max_tokens is wasted work: the bonus token always commits
        caps = [max(0, min(width, r.remaining - 1)) for r in running]
        kv = max(positions) + width + 1
        ctx = TierContext(bucket, n, width, self.geometry.rows_for(bucket), self.tier_costs(bucket, kv))
        step = DecodeStep(self.runner, self.storage, self.policy, ctx, as_long([r.slot for r in running]),
                          as_long([r.anchor for r in running]), as_long(positions), as_long(caps))
        proposal = self.hooks.propose(step)
        budget = self.hooks.select_budget(step, proposal)
        verification = self.hooks.verify(step, proposal, budget)
        self.hooks.commit(step, verification)
        self._steps += 1
        self._fallbacks += int(budget.choice.fallback)
        accepted = verification.acceptance.accepted.tolist()
        committed = verification.acceptance.committed.tolist()
        lengths = budget.lengths.tolist()
        for i, request in enumerate(running):
            stats = request.stats
            stats.steps += 1
            stats.drafted_verified += lengths[i]
            stats.drafted_accepted += accepted[i]
            stats.verify_widths.append(lengths[i])
            self._append(request, committed[i][: accepted[i] + 1], finished)

    def _append(self, request: Request, tokens: list[int], finished: list[RequestOutput]) -> None:
        """Add committed tokens to a request and retire it when a stop condition is met."""
        reason = None
        if not request.params.ignore_eos:
            cut = truncate_at_eos(tokens, self.eos_ids)
            if cut is not None:
                tokens, reason = tokens[: cut - 1], "stop"
        room = request.remaining
        if len(tokens) >= room:
            tokens = tokens[:room]
            reason = reason or "length"
        request.output.extend(tokens)
        self._committed += len(tokens)
        if request.params.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(request.output)
            hits = [text.index(s) for s in request.params.stop if s in text]
            if hits:
                request.text, reason = text[: min(hits)], "stop"
        if reason is not None:
            if self.tokenizer is not None and not (request.params.stop and reason == "stop" and request.text):
                request.text = self.tokenizer.decode(request.output)
            self.scheduler.finish(request, reason)
            finished.append(make_output(request))

    def generate(self, prompts: Sequence[str | Sequence[int] | Sequence[Mapping[str, str]]],
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams()) -> list[RequestOutput]:
        """Decode every prompt to completion (all batched together); outputs in prompt order."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        requests = [self.add_request(p, sp) for p, sp in zip(prompts, per_prompt, strict=True)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(requests):
            for output in self.step():
                done[output.request_id] = output
        return [done[r.request_id] for r in requests]

    @property
    def counters(self) -> EngineCounters:
        return EngineCounters(self._steps, self._fallbacks, self._committed)
