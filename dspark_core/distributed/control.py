"""Rank 0 decides, every rank executes: the step-decision channel.

Rank 0 runs the scheduler. Each unit of device work it launches (a prefill of
the admitted prompts, or a decode step of the running slots) is announced to
the workers on the control group *from inside the device job*, right before
rank 0 runs it, so on every rank the announcements and the model collectives
happen in the same order. A worker replays the job with its own
:class:`~dspark_core.engine.engine.Engine` (its runner, slot storage and step
hooks; its scheduler stays unused).

The only decision made in the middle of a step, the budget (tier and
per-request verify lengths), is computed by rank 0's policy and broadcast on
the model group; a worker's budget stage simply returns it. So all ranks pack
the same rows and run the same kernels whatever the policy is, deterministic
or not.

Messages are int64 tensors: a header ``[kind, payload length]`` and the payload.
Their layout has a number, :data:`MESSAGE_FORMAT`, that every rank checks at
startup beside the package version (:func:`~dspark_core.distributed.table.check_same_launch`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dspark_core.audit import get_logger
from dspark_core.device import host_to_device
from dspark_core.distributed.group import RankGroup, RankLostError, collective
from dspark_core.engine.pipeline import DeviceQueue, Job
from dspark_core.engine.step import DecodeStep
from dspark_core.policy import TierChoice, TierContext, allocate_split

log = get_logger("distributed")

#: The layout of the messages below and of the broadcast budget. A worker that reads another layout
#: would replay wrong steps without any error, so ranks refuse to start unless theirs agree: raise
#: it whenever a kind is added or a payload changes.
MESSAGE_FORMAT = 1

PREFILL, DECODE, POINT_BEGIN, POINT_END, CALIBRATED, HEARTBEAT, STOP = range(1, 8)
KIND_NAMES = {PREFILL: "prefill", DECODE: "decode", POINT_BEGIN: "calibration point", POINT_END: "calibration point end",
              CALIBRATED: "calibration done", HEARTBEAT: "heartbeat", STOP: "stop"}


class Channel:
    """The control group seen from one rank: rank 0 sends, the others receive."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self._lock = threading.Lock()
        self.last_sent = time.monotonic()

    def send(self, kind: int, payload: Sequence[int] = ()) -> None:
        """Broadcast one message (rank 0 only; serialised across threads)."""
        with self._lock, collective(f"sending {KIND_NAMES[kind]}", self.group.rank):
            dist.broadcast(torch.tensor([kind, len(payload)], dtype=torch.int64), 0, group=self.group.control_group)
            if payload:
                dist.broadcast(torch.tensor(list(payload), dtype=torch.int64), 0, group=self.group.control_group)
            self.last_sent = time.monotonic()

    def receive(self) -> tuple[int, list[int]]:
        """Wait for rank 0's next message (workers)."""
        with collective("waiting for rank 0", self.group.rank):
            header = torch.empty(2, dtype=torch.int64)
            dist.broadcast(header, 0, group=self.group.control_group)
            kind, size = header.tolist()
            payload: list[int] = []
            if size:
                data = torch.empty(size, dtype=torch.int64)
                dist.broadcast(data, 0, group=self.group.control_group)
                payload = data.tolist()
        return kind, payload


# -- job encodings ---------------------------------------------------------------------

def encode_prefill(prompts: Sequence[Sequence[int]], slots: Sequence[int]) -> list[int]:
    return [len(prompts), *slots, *(len(p) for p in prompts), *(t for p in prompts for t in p)]


def decode_prefill(payload: list[int]) -> tuple[list[list[int]], list[int]]:
    n = payload[0]
    slots, lengths = payload[1 : 1 + n], payload[1 + n : 1 + 2 * n]
    prompts, at = [], 1 + 2 * n
    for length in lengths:
        prompts.append(payload[at : at + length])
        at += length
    return prompts, slots


def encode_decode(step: DecodeStep, slots: Sequence[int]) -> list[int]:
    # the draft flag is the step's own: the policy may plan a draft-off step, or a copy step
    drafts = bool(step.draft and step.policy.uses_draft)
    return [len(slots), step.tier_context.request_bucket, int(drafts), int(step.copy_only), step.kv_span,
            step.draft_depth, *slots]


# -- the budget decision, broadcast inside the step ------------------------------------

_HEAD = 6  # rows, fallback, predicted tokens, predicted seconds, draft-off, copy step


def _pack_decision(choice: TierChoice, lengths: torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
    head = torch.tensor([choice.rows, float(choice.fallback), choice.predicted_tokens, choice.predicted_seconds,
                         float(choice.draft_off), float(choice.copy_only)], dtype=torch.float64, device=lengths.device)
    return torch.cat([head, lengths.to(torch.float64), caps.to(device=lengths.device, dtype=torch.float64)])


class BroadcastDecision:
    """Rank 0's policy wrapper: decides with the real policy, then tells the workers."""

    def __init__(self, inner: Any, group: RankGroup) -> None:
        self.inner = inner
        self.group = group

    def __getattr__(self, name: str) -> Any:  # name, uses_draft, tier_lag, ...
        return getattr(self.inner, name)

    def choose_tier(self, ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> TierChoice:
        return self.inner.choose_tier(ctx, confidences, caps)

    def split(self, kernels: object, confidences: torch.Tensor, caps: torch.Tensor, choice: TierChoice,
              request_bucket: int) -> torch.Tensor:
        return self._broadcast(choice, self.inner.split(kernels, confidences, caps, choice, request_bucket), caps)

    def copy_split(self, kernels: Any, confidences: torch.Tensor, caps: torch.Tensor, choice: TierChoice,
                   request_bucket: int) -> torch.Tensor:
        """A copy step's lengths (none when it stays draft-off), broadcast like a drafted step's."""
        lengths = (torch.zeros_like(caps) if choice.draft_off
                   else allocate_split(kernels, confidences, caps, choice, request_bucket))
        return self._broadcast(choice, lengths, caps)

    def _broadcast(self, choice: TierChoice, lengths: torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
        dist.broadcast(_pack_decision(choice, lengths, caps), 0, group=self.group.model_group)
        return lengths


class ReplayDecision:
    """A worker's policy: receives rank 0's tier and verify lengths (its own confidences are not used)."""

    name = "rank-0-decision"
    tier_lag = 0
    reads_confidences = False  # the tier comes from rank 0: no wait for this rank's proposal

    def __init__(self, uses_draft: bool, live: int, group: RankGroup, device: torch.device) -> None:
        self.uses_draft = uses_draft
        self.live = live
        self.group = group
        self.device = device
        self.caps: torch.Tensor | None = None
        self._lengths: torch.Tensor | None = None

    def choose_tier(self, ctx: TierContext, confidences: np.ndarray, caps: np.ndarray) -> TierChoice:
        packed = torch.empty(_HEAD + 2 * self.live, dtype=torch.float64, device=self.device)
        dist.broadcast(packed, 0, group=self.group.model_group)
        self._lengths = packed[_HEAD : _HEAD + self.live].to(torch.int64)
        self.caps = packed[_HEAD + self.live :].to(torch.int64)
        rows, fallback, tokens, seconds, draft_off, copy_only = packed[:_HEAD].tolist()
        return TierChoice(int(rows), bool(fallback), tokens, seconds, draft_off=bool(draft_off), copy_only=bool(copy_only))

    choose_copy_tier = choose_tier  # a copy step's decision travels the same way

    def split(self, kernels: object, confidences: torch.Tensor, caps: torch.Tensor, choice: TierChoice,
              request_bucket: int) -> torch.Tensor:
        assert self._lengths is not None, "split before choose_tier"
        return self._lengths

    copy_split = split


# -- rank 0: the announcing device queue -----------------------------------------------

class AnnouncingQueue(DeviceQueue):
    """Rank 0's device queue: every job first tells the workers what to run, then runs it.

    A failed collective inside a job becomes :class:`RankLostError` and calls
    ``on_lost`` once, so the service can stop.
    """

    def __init__(self, overlap: bool, channel: Channel, on_lost: Callable[[RankLostError], None]) -> None:
        super().__init__(overlap)
        self.channel = channel
        self.on_lost = on_lost

    def submit(self, kind: str, requests: list, fn: Callable[..., Any], *args: Any, context: Any = None) -> Job:
        if kind == "prefill":
            code, payload = PREFILL, encode_prefill(*args)
        elif kind == "decode":
            step: DecodeStep = args[0]
            step.policy = BroadcastDecision(step.policy, self.channel.group)
            code, payload = DECODE, encode_decode(step, [r.slot for r in requests])
        else:
            raise RuntimeError(f"multi-rank engine: unknown device job kind {kind!r}")
        group = self.channel.group

        def announced(*job_args: Any) -> Any:
            try:
                self.channel.send(code, payload)
                with collective(f"{kind} step", group.rank):
                    return fn(*job_args)
            except RankLostError as exc:
                self.on_lost(exc)
                raise

        return super().submit(kind, requests, announced, *args, context=context)


class Heartbeat:
    """Rank 0 pings idle workers so they can tell "no requests" from "rank 0 is gone"."""

    def __init__(self, channel: Channel, interval: float, on_lost: Callable[[RankLostError], None]) -> None:
        self.channel = channel
        self.interval = interval
        self.on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dspark-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval / 4):
            if time.monotonic() - self.channel.last_sent >= self.interval:
                try:
                    self.channel.send(HEARTBEAT)
                except RankLostError as exc:
                    self.on_lost(exc)
                    return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


# -- workers ---------------------------------------------------------------------------

class IntervalRecorder:
    """A worker's view of calibration: the timed decode intervals of each announced run,
    cut exactly as rank 0's probe cuts its own (rank 0 labels and windows them)."""

    def __init__(self) -> None:
        self.intervals: list[float] = []
        self._run: list[int] | None = None
        self._stamps: list[float] = []

    def begin(self, payload: list[int]) -> None:
        self._run, self._stamps = payload, []

    def decoded(self, live: int) -> None:
        if self._run is not None and live == self._run[0]:
            self._stamps.append(time.perf_counter())

    def end(self) -> None:
        assert self._run is not None, "calibration run end without a beginning"
        _, warmup, timed = self._run
        stamps = self._stamps[warmup - 1 : warmup + timed]
        found = [b - a for a, b in zip(stamps, stamps[1:])]
        self.intervals += found + [0.0] * (timed - len(found))  # a short run keeps the positions aligned
        self._run = None


def replay_prefill(engine, payload: list[int]) -> None:
    prompts, slots = decode_prefill(payload)
    engine.prefill_on_device(prompts, slots)


def replay_decode(engine, group: RankGroup, payload: list[int]) -> int:
    live, bucket, uses_draft, copy_only, kv_span, draft_depth = payload[:6]
    slots = payload[6 : 6 + live]
    device = engine.runner.device
    # the worker's own policy says whether a draft exists (its context is extended every
    # step); whether this step runs it is rank 0's decision
    policy = ReplayDecision(engine.policy.uses_draft, live, group, device)
    width = engine.config.draft_width
    ctx = TierContext(bucket, live, width, engine.geometry.rows_for(bucket), None)
    step = DecodeStep(engine.runner, engine.storage, policy, ctx, host_to_device(slots, device),
                      torch.zeros(live, dtype=torch.int64, device=device), draft=bool(uses_draft),
                      copy_only=bool(copy_only), kv_span=kv_span, draft_depth=draft_depth,
                      host_caps=np.zeros(live, dtype=np.int64))  # rank 0 sends the caps with its decision
    engine.decode_on_device(step)
    return live


def follow(engine, channel: Channel, stop_kinds: frozenset[int], recorder: IntervalRecorder | None = None) -> tuple[int, list[int]]:
    """Replay rank 0's jobs until a message of ``stop_kinds`` arrives; returns it."""
    group = channel.group
    while True:
        kind, payload = channel.receive()
        if kind in stop_kinds:
            return kind, payload
        if kind == STOP:
            raise RankLostError(f"rank {group.rank}: rank 0 stopped the service while this rank was still starting")
        with collective(f"{KIND_NAMES.get(kind, kind)} step", group.rank):
            if kind == PREFILL:
                replay_prefill(engine, payload)
            elif kind == DECODE:
                live = replay_decode(engine, group, payload)
                if recorder is not None:
                    recorder.decoded(live)
            elif kind == POINT_BEGIN and recorder is not None:
                recorder.begin(payload)
            elif kind == POINT_END and recorder is not None:
                recorder.end()
            elif kind == HEARTBEAT:
                continue
            else:
                raise RankLostError(f"rank {group.rank}: unexpected message {KIND_NAMES.get(kind, kind)} from rank 0")
