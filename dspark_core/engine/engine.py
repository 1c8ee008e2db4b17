"""The engine: request lifecycle around the decode step.

``Engine.generate`` is the in-process API used by tests, the benchmark and
the HTTP server. Each iteration admits waiting requests (prefill), launches
one decode step for every running request and processes finished device work:
at once without schedule overlap, one step later with it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import attrs

from dspark_core.device import host_to_device
from dspark_core.engine.costs import TierCosts
from dspark_core.engine.records import EngineConfig, EngineCounters, StartupWork, StepReport
from dspark_core.engine.pipeline import DeviceQueue, Job
from dspark_core.engine.planning import StepPlanner, remember
from dspark_core.engine.request import Request, RequestOutput, SamplingParams, make_output
from dspark_core.engine.runner import ModelRunner
from dspark_core.engine.scheduler import Scheduler
from dspark_core.engine.step import DecodeStep, StepResult, StepStages
from dspark_core.engine.stops import StopChecker
from dspark_core.errors import ConfigError, StartupAborted
from dspark_core.geometry import Geometry, kv_reserve, kv_spans
from dspark_core.graphs import GraphBackend
from dspark_core.models.base import DraftModel, TargetModel
from dspark_core.plugins import Hooks, default_hooks
from dspark_core.policy import BudgetPolicy, observe_step


class Engine:
    """Continuous-batching speculative decoding over one target (+ DSpark draft)."""

    def __init__(self, target: TargetModel, draft: DraftModel | None, config: EngineConfig = EngineConfig(), *,
                 hooks: Hooks | None = None,
                 geometry: Geometry | None = None, graphs: GraphBackend | None = None) -> None:
        self.config = config
        self.hooks = hooks or default_hooks()
        self.policy: BudgetPolicy = self.hooks.budget_policy(config.policy, config.policy_options)
        if self.policy.uses_draft and draft is None:
            raise ConfigError(f"budget policy {config.policy!r} needs a draft model")
        self.geometry = geometry or Geometry.all_tiers(config.draft_width, config.request_buckets)
        if self.geometry.draft_width != config.draft_width:
            raise ConfigError(f"geometry width {self.geometry.draft_width} differs from draft_width {config.draft_width}")
        num_slots = self.geometry.max_bucket
        # the model's own context limit caps the configured length
        self.max_model_len = min(config.max_model_len, target.config.max_position)
        self.runner = ModelRunner(target, draft if self.policy.uses_draft else None, draft_width=config.draft_width,
                                  num_slots=num_slots, max_len=self.max_model_len, graphs=graphs,
                                  copy_proposals=config.copy_proposals, draft_depths=dict(config.draft_depths),
                                  kv_spans=kv_spans(config.captured_kv_spans, self.max_model_len,
                                                    graphs is not None and graphs.records))
        self.storage = self.runner.storage
        self.scheduler = Scheduler(self.storage, num_slots, config.max_prefill_tokens)
        self.queue = DeviceQueue(config.schedule_overlap)
        self.costs = TierCosts(self.geometry)
        self.planner = StepPlanner(self.geometry, self.costs, self.runner, self.storage)
        self.stages = StepStages(self.hooks)  # plugins registered later do not change a built engine
        self.tokenizer = getattr(target, "tokenizer", None)
        self.stops = StopChecker(tuple(target.config.eos_token_ids), self.tokenizer)
        self._steps = self._fallbacks = self._committed = self._draft_off_steps = self._copy_steps = 0
        self._pending_release: set[int] = set()  # finished slots a launched step may still write
        self._observers: list[Callable[[StepReport], None]] = []
        self.work = StartupWork()
        self.ready = False
        # set from another thread (a server shutting down) to stop startup work at its next step
        self.startup_abort = threading.Event()

    # -- startup -----------------------------------------------------------------
    def warmup(self) -> None:
        """Allocate and warm/capture every binding key of the captured geometry (the warmup stage).

        Plugins implementing ``dspark_warmup`` run first, then the runner prepares every key.
        """
        self.hooks.warmup(self)
        self.runner.warmup(self.geometry)

    def check_startup_abort(self) -> None:
        """Raise StartupAborted if a shutdown asked warmup or calibration to stop.

        Startup work calls this between its steps: calibration runs for minutes on a
        CPU, and a SIGTERM should not wait for it to end.
        """
        if self.startup_abort.is_set():
            raise StartupAborted("startup stopped before ready: the server is shutting down")

    def mark_ready(self) -> None:
        """Seal the graph backend: from now on serving may only replay prepared keys."""
        if self.runner.graphs is not None:
            self.runner.graphs.seal()
        self.ready = True

    def work_counters(self) -> dict[str, int]:
        """Captures, warmups, fits and profiling runs so far (tests assert they stop at ready)."""
        graphs = self.runner.graphs.counters if self.runner.graphs is not None else None
        return {"captures": graphs.captures if graphs else 0, "warmups": graphs.warmups if graphs else 0,
                "fits": self.work.fits, "profiling_runs": self.work.profiling_runs}

    def add_observer(self, observer: Callable[[StepReport], None]) -> None:
        """Call ``observer`` on the host after every processed decode step."""
        self._observers.append(observer)

    def remove_observer(self, observer: Callable[[StepReport], None]) -> None:
        self._observers.remove(observer)

    def reset_counters(self) -> None:
        """Zero the step counters (calibration steps are not serving steps)."""
        self._steps = self._fallbacks = self._committed = self._draft_off_steps = self._copy_steps = 0

    def install_table(self, table) -> None:
        """Install an immutable cost table before serving."""
        if table is not None and table.draft_width != self.config.draft_width:
            raise ConfigError(f"cost table is for draft_width {table.draft_width}, the launch uses {self.config.draft_width}")
        self.costs.install(table)

    @property
    def table(self):
        return self.costs.table

    # -- what callers outside the engine may swap ---------------------------------
    def set_policy(self, policy: BudgetPolicy) -> None:
        """Choose every following step's budget with ``policy`` (a :class:`BudgetPolicy` object).

        Steps already built keep the policy they were built with; that one
        also observes their reports, so a swap never mixes two policies' state.
        """
        if policy.uses_draft and self.runner.draft is None:
            raise ConfigError(f"budget policy {getattr(policy, 'name', policy)!r} needs a draft model; "
                              "this engine was built without one")
        self.policy = policy

    def set_copy_proposals(self, on: bool) -> None:
        """Turn copy proposals off or back on for the following proposals (an engine built with them;
        a single-rank engine: the ranks of a service must propose alike, so there the flag decides)."""
        self.runner.set_copies(on)

    @contextmanager
    def use_policy(self, policy: BudgetPolicy) -> Iterator[None]:
        """Serve with ``policy`` inside the ``with`` block, then with the previous policy again."""
        saved = self.policy
        self.set_policy(policy)
        try:
            yield
        finally:
            self.policy = saved

    def replace_queue(self, queue: DeviceQueue) -> None:
        """Route device work through ``queue`` from now on (multi-rank: a queue that announces each job).

        Only while no device work is in flight; the old queue's executor is stopped.
        """
        if self.queue.in_flight:
            raise RuntimeError("replace_queue: device work is still in flight")
        self.queue.close()
        self.queue = queue

    # -- requests --------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int] | Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of a raw text prompt, a chat message list or already-tokenized ids."""
        items: list[Any] = [prompt] if isinstance(prompt, str) else list(prompt)
        if isinstance(prompt, str) or (items and isinstance(items[0], Mapping)):
            if self.tokenizer is None:
                raise ConfigError("prompt: this model has no tokenizer; pass token ids")
            text = prompt if isinstance(prompt, str) else self.tokenizer.apply_chat_template(items)
            return self.tokenizer.encode(text)
        return [int(t) for t in items]

    def add_request(self, prompt: str | Sequence[int] | Sequence[Mapping[str, str]],
                    params: SamplingParams = SamplingParams()) -> Request:
        """Queue a request; it joins the running batch at the next iteration with a free slot."""
        ids = self.encode(prompt)
        if not ids:
            raise ConfigError("prompt: must not be empty")
        # room for the output plus the rows launched steps may write past the last commit
        need = len(ids) + params.max_tokens + kv_reserve(self.config.draft_width)
        if need > self.max_model_len:
            raise ConfigError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) + 2 x (draft width + 1) = {need} "
                f"exceeds max_model_len {self.max_model_len}"
            )
        request = Request(ids, params)
        self.scheduler.add(request)
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request (client went away); its slot is freed once no step uses it.
        A request that already finished keeps its finish reason."""
        if request.finish_reason is None:
            self._release(self.scheduler.finish(request, "cancelled"))

    @property
    def has_work(self) -> bool:
        """True while a request waits or runs, or launched device work is unprocessed."""
        return bool(self.scheduler.waiting or self.scheduler.running or self.queue.in_flight)

    # -- the loop --------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: launch prefill and a decode step, then process finished device work."""
        finished: list[RequestOutput] = []
        admitted = self.scheduler.admit()
        if admitted:
            self.queue.submit("prefill", admitted, self.prefill_on_device, [r.prompt for r in admitted],
                              [r.slot for r in admitted])
        pending = self.queue.unprocessed_tokens()
        # a request whose launched work already reaches max_tokens gets no further step: its tokens
        # would be cut anyway (it finishes when that work is processed)
        running = [r for r in self.scheduler.running if r.remaining > pending[r]]
        if running:
            step = self.planner.build(running, self.policy, self.queue.depth, pending)
            self.queue.submit("decode", running, self.decode_on_device, step, context=step)
        while self.queue.in_flight and (self.queue.over_depth() or not running):
            self._process(*self.queue.pop_oldest(), finished)
        return finished

    # -- device work (run by the queue's executor; multi-rank workers call it directly) --
    def prefill_on_device(self, prompts: list[list[int]], slots: list[int]) -> list[int]:
        """Prefill ``prompts`` into ``slots`` and start their slot storage; returns each first token.

        Runs on the calling thread with no scheduling: the engine's queue calls
        it for admitted requests, and a multi-rank worker to replay rank 0's prefill.
        """
        first = self.runner.prefill(prompts, slots)
        as_long = lambda xs: host_to_device(xs, self.runner.device)  # noqa: E731
        self.storage.start(as_long(slots), as_long([len(p) for p in prompts]), first)
        return first.tolist()

    def decode_on_device(self, step: DecodeStep) -> StepResult:
        """Run one built decode step's stages (propose, select_budget, verify, commit) and collect it.

        Runs on the calling thread: the engine's queue calls it for the steps
        ``step()`` builds, a multi-rank worker for the steps it replays.
        """
        started = time.perf_counter()
        try:
            result = self.stages.run(step)
        except BaseException as exc:
            if step.proposal_ready is not None and not step.proposal_ready.done():
                step.proposal_ready.set_exception(exc)  # the host may be waiting for it
            raise
        # the result is on the host, so the device work is done: no event or extra sync is needed
        return attrs.evolve(result, seconds=time.perf_counter() - started)

    def _process(self, job: Job, result: Any, finished: list[RequestOutput]) -> None:
        """Apply a finished job's results to its requests (already-finished ones are skipped)."""
        if job.kind == "prefill":
            for request, token in zip(job.requests, result):
                self._append(request, [token], finished)
        else:
            step: DecodeStep = job.context
            ctx = step.tier_context
            self._steps += 1
            self._fallbacks += int(result.choice.fallback)
            self._draft_off_steps += int(result.choice.draft_off)
            self._copy_steps += int(result.choice.copy_only)
            report = StepReport(len(job.requests), ctx.request_bucket, result.choice.rows,
                                tuple(result.lengths), tuple(result.accepted), result.choice.fallback,
                                result.choice.predicted_tokens, sum(a + 1 for a in result.accepted),
                                ctx.tiers, ctx.tier_costs, draft_off=result.choice.draft_off,
                                draft_off_cost=ctx.draft_off_cost, forecast_scale=ctx.forecast_scale,
                                copy_only=result.choice.copy_only, step_seconds=result.seconds)
            observe_step(step.policy, report)
            if result.drafted:
                self.planner.record_population(step.index, result.confidences)
            for observer in self._observers:
                observer(report)
            for i, request in enumerate(job.requests):
                if request.finish_reason is not None:
                    continue  # finished on an earlier result; this step's tokens are past its end
                stats = request.stats
                stats.steps += 1
                stats.drafted_verified += result.lengths[i]
                stats.drafted_accepted += result.accepted[i]
                stats.verify_widths.append(result.lengths[i])
                stats.draft_off_steps += int(result.choice.draft_off)
                stats.copy_steps += int(result.choice.copy_only)
                if result.drafted:
                    remember(request, step.index, result.confidences[i])
                self._append(request, result.committed[i][: result.accepted[i] + 1], finished)
        self._release_idle_slots()

    def _append(self, request: Request, tokens: list[int], finished: list[RequestOutput]) -> None:
        before = len(request.output)
        reason = self.stops.append(request, tokens)
        self._committed += len(request.output) - before
        if reason is not None:
            self._release(self.scheduler.finish(request, reason))
            finished.append(make_output(request))

    # -- slots -----------------------------------------------------------------
    def _release(self, slot: int | None) -> None:
        if slot is not None:
            self._pending_release.add(slot)
            self._release_idle_slots()

    def _release_idle_slots(self) -> None:
        busy = self.queue.slots_in_flight()
        for slot in sorted(self._pending_release - busy):
            self.storage.release(slot)
            self.runner.release_draft_context(slot)
        self._pending_release &= busy

    def generate(self, prompts: Sequence[str | Sequence[int] | Sequence[Mapping[str, str]]],
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 finished: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Decode every prompt to completion (all batched together); outputs in prompt order.
        ``finished`` is called with each output as its request ends (a progress bar)."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        requests = [self.add_request(p, sp) for p, sp in zip(prompts, per_prompt, strict=True)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(requests):
            for output in self.step():
                done[output.request_id] = output
                if finished is not None:
                    finished(output)
        return [done[r.request_id] for r in requests]

    @property
    def counters(self) -> EngineCounters:
        return EngineCounters(self._steps, self._fallbacks, self._committed, self._draft_off_steps, self._copy_steps)

    def close(self) -> None:
        """Stop the device executor (pending work finishes first)."""
        self.queue.close()

