"""Prometheus metrics of one server (its own CollectorRegistry, so apps never share state).

Two feeds: the engine thread calls :meth:`ServerMetrics.observe_step` with a
StepReport after every decode step (speculation figures), and the HTTP
handlers call :meth:`observe_request` / :meth:`count_request` per request
(latency, tokens, outcome). prometheus-client objects are thread-safe.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "dspark"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
THROUGHPUT_WINDOW_S = 10.0


class ServerMetrics:
    """Every metric the server exports; names are documented in docs/serving.md."""

    def __init__(self, draft_width: int, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, p = self.registry, PREFIX
        token_buckets = tuple(float(i) for i in range(0, draft_width + 2))
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "Time from admission to the first output token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(f"{p}_time_per_output_token_seconds",
                              "Mean time between output tokens of a request after its first one",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{p}_request_latency_seconds", "Time from admission to the last output token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter(f"{p}_requests", "HTTP generation requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter(f"{p}_requests_finished", "Generations that ran, by finish reason", ["reason"],
                                registry=r)
        self.output_tokens = Counter(f"{p}_output_tokens", "Output tokens returned to clients", registry=r)
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.throughput = Gauge(f"{p}_output_tokens_per_second",
                                f"Tokens committed by the engine per second over the last {THROUGHPUT_WINDOW_S:g} s",
                                registry=r)
        self.steps = Counter(f"{p}_decode_steps", "Decode steps processed", registry=r)
        self.request_steps = Counter(f"{p}_decode_request_steps", "Sum over decode steps of the requests in them",
                                     registry=r)
        self.verified = Counter(f"{p}_draft_tokens_verified", "Drafted tokens sent to the target", registry=r)
        self.accepted = Counter(f"{p}_draft_tokens_accepted", "Drafted tokens the target accepted", registry=r)
        self.committed = Counter(f"{p}_committed_tokens", "Tokens committed by decode steps (bonus included)",
                                 registry=r)
        self.acceptance = Gauge(f"{p}_acceptance_rate", "Accepted / verified drafted tokens since start", registry=r)
        self.accepted_length = Gauge(f"{p}_mean_accepted_length",
                                     "Committed tokens per request per decode step since start (bonus included)",
                                     registry=r)
        self.verify_width = Histogram(f"{p}_verify_width", "Drafted tokens verified per request per decode step",
                                      buckets=token_buckets, registry=r)
        self.fallbacks = Counter(f"{p}_full_width_fallbacks", "Decode steps that fell back to full-width verification",
                                 registry=r)
        self.draft_off = Counter(f"{p}_draft_off_steps",
                                 "Decode steps the budget policy ran without the draft, verifying nothing", registry=r)
        self.copy_steps = Counter(f"{p}_copy_steps",
                                  "Decode steps run without the draft that verified copy proposals", registry=r)
        step_buckets = tuple(float(x) for x in (1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.predicted = Histogram(f"{p}_step_predicted_tokens",
                                   "Tokens per step the budget policy forecast (steps with a forecast)",
                                   buckets=step_buckets, registry=r)
        self.realized = Histogram(f"{p}_step_realized_tokens",
                                  "Tokens per step actually committed (same steps as the forecast)",
                                  buckets=step_buckets, registry=r)
        # a decode step's device work up to its result copy (StepReport.step_seconds), by what it ran: set
        # beside the cost table's prices (`table show`), it says whether the table still fits this machine
        self.step_seconds = Histogram(f"{p}_step_seconds", "Measured seconds of a decode step, by kind",
                                      ["kind"], buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0),
                                      registry=r)
        self.queue_depth = Gauge(f"{p}_queue_depth", "Requests in the server by state", ["state"], registry=r)
        self.ready = Gauge(f"{p}_ready", "1 once the cost table is installed and the server accepts requests",
                           registry=r)
        self._lock = threading.Lock()
        self._window: deque[tuple[float, int]] = deque()
        self._totals = [0, 0, 0, 0]  # verified, accepted, request-steps, committed
        self.throughput.set_function(self._tokens_per_second)

    def bind_queue(self, waiting: Callable[[], float], running: Callable[[], float], pending: Callable[[], float],
                   ready: Callable[[], float]) -> None:
        """Read queue depths and readiness at scrape time from the service."""
        self.queue_depth.labels("waiting").set_function(waiting)
        self.queue_depth.labels("running").set_function(running)
        self.queue_depth.labels("admitted").set_function(pending)
        self.ready.set_function(ready)

    # -- engine thread ----------------------------------------------------------
    def observe_step(self, report) -> None:
        """Engine observer: one processed decode step (a dspark_core.engine StepReport)."""
        verified, accepted = sum(report.verify_lengths), sum(report.accepted)
        self.steps.inc()
        self.request_steps.inc(report.live_requests)
        self.verified.inc(verified)
        self.accepted.inc(accepted)
        self.committed.inc(report.committed_tokens)
        for width in report.verify_lengths:
            self.verify_width.observe(width)
        if report.fallback:
            self.fallbacks.inc()
        if report.draft_off:
            self.draft_off.inc()
        if report.copy_only:
            self.copy_steps.inc()
        if report.step_seconds is not None:
            kind = "drafted" if report.drafted else "copy" if report.copy_only else "draft_off"
            self.step_seconds.labels(kind).observe(report.step_seconds)
        if not math.isnan(report.predicted_tokens):
            self.predicted.observe(report.predicted_tokens)
            self.realized.observe(report.committed_tokens)
        with self._lock:
            t = self._totals
            t[0] += verified
            t[1] += accepted
            t[2] += report.live_requests
            t[3] += report.committed_tokens
            self.acceptance.set(t[1] / t[0] if t[0] else 0.0)
            self.accepted_length.set((t[1] + t[2]) / t[2] if t[2] else 0.0)
            self._window.append((time.monotonic(), report.committed_tokens))

    def _tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._window and self._window[0][0] < now - THROUGHPUT_WINDOW_S:
                self._window.popleft()
            return sum(n for _, n in self._window) / THROUGHPUT_WINDOW_S

    # -- HTTP handlers ----------------------------------------------------------
    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def observe_request(self, *, prompt_tokens: int, output_tokens: int, reason: str, submitted: float,
                        first_token: float | None, last_token: float | None) -> None:
        """Latency and token figures of one generation that ran (monotonic timestamps)."""
        self.finished.labels(reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.output_tokens.inc(output_tokens)
        if first_token is not None:
            self.ttft.observe(first_token - submitted)
        if last_token is not None:
            self.e2e.observe(last_token - submitted)
            if first_token is not None and output_tokens > 1:
                self.tpot.observe((last_token - first_token) / (output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
