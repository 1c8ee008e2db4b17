"""Host time per decode step outside the graph keys: what a GPU cannot hide behind its replays.

On a device the proposal and verify keys replay without Python; everything else a step does on
the host (building the step, the policy's choice, staging the keys' inputs, the split, the result
copy, processing the results) is host time per step whatever the card. This script measures it
on this machine's CPU with tiny random models and the captured-backend stand-in of the tests
(`tests/capture_support.py`), which replays a key by re-running it in static-shape mode: the time
inside the replays is measured and subtracted. It also counts the device ops a step still
launches one at a time outside the keys (each is a kernel launch on a GPU).

    python benchmarks/host_overhead.py --concurrency 1,16 --steps 200 --output host-overhead.json

Run it on the device machine's host too (the sitting does): its CPU sets the floor of the step.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from capture_support import StandInCapturedBackend, device_ops_outside_replays  # noqa: E402
from common import policy_labels  # noqa: E402
from engine_support import random_prompts, synthetic_table, tiny_pair  # noqa: E402

from dspark_core.engine.engine import Engine, EngineConfig  # noqa: E402
from dspark_core.engine.request import SamplingParams  # noqa: E402
from dspark_core.geometry import Geometry  # noqa: E402

POLICIES = {"none": ("none", {}), "fixed-k7": ("fixed", {}), "adaptive": ("adaptive", {}),
            "adaptive-lag2": ("adaptive", {"tier_lag": 2})}
BUCKETS = (1, 2, 4, 8, 16)
WIDTH = 7


class TimedReplays(StandInCapturedBackend):
    """The stand-in, adding up the wall time spent inside replays."""

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.replay_seconds = 0.0

    def _replay(self, key, prepared):
        started = time.perf_counter()
        try:
            return super()._replay(key, prepared)
        finally:
            self.replay_seconds += time.perf_counter() - started


class TimedChoices:
    """The engine's policy, with the host time of each ``choose_tier`` call recorded (the one
    policy computation of a step that sits between its two launches when ``tier_lag`` is 0)."""

    def __init__(self, policy) -> None:
        self._policy = policy
        self.seconds: list[float] = []

    def __getattr__(self, name: str):
        return getattr(self._policy, name)

    def choose_tier(self, ctx, confidences, caps):
        started = time.perf_counter()
        try:
            return self._policy.choose_tier(ctx, confidences, caps)
        finally:
            self.seconds.append(time.perf_counter() - started)


def measure(label: str, concurrency: int, steps: int, warmup: int, overlap: bool) -> dict:
    policy, options = POLICIES[label]
    target, draft = tiny_pair(seed=3, block_size=WIDTH)
    graphs = TimedReplays("cpu")
    # only the buckets up to the one this concurrency steps in: larger ones would be captured and never replayed
    buckets = tuple(b for b in BUCKETS if b <= next(b for b in BUCKETS if b >= concurrency))
    engine = Engine(target, draft, EngineConfig(draft_width=WIDTH, policy=policy, policy_options=options,
                                                request_buckets=buckets, max_model_len=512,
                                                schedule_overlap=overlap),
                    geometry=Geometry.bucket_multiples(WIDTH, buckets), graphs=graphs)
    engine.install_table(synthetic_table(WIDTH, buckets))
    engine.warmup()
    engine.mark_ready()
    choices = TimedChoices(engine.policy)
    engine.set_policy(choices)
    prompts = random_prompts(concurrency, seed=1)
    params = SamplingParams(max_tokens=256, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)

    def step() -> None:  # a finished request is replaced at once (its prefill shows in the mean, not the median)
        for index, _ in enumerate(engine.step()):
            engine.add_request(prompts[index % len(prompts)], params)

    for _ in range(warmup):
        step()
    choices.seconds.clear()
    walls, inside = [], []
    for _ in range(steps):
        before, started = graphs.replay_seconds, time.perf_counter()
        step()
        walls.append(time.perf_counter() - started)
        inside.append(graphs.replay_seconds - before)
    outside = [w - i for w, i in zip(walls, inside)]
    choice_seconds = list(choices.seconds)
    # a short second pass counts the ops launched outside the keys (the recorder slows the step)
    ops: list = []
    device_decode = engine.decode_on_device

    def counted(step):
        with device_ops_outside_replays() as recorder:
            result = device_decode(step)
        ops.extend(recorder.ops)
        return result

    engine.decode_on_device = counted
    counted_steps = 20
    for _ in range(counted_steps):
        step()
    engine.close()
    return {"policy": label, "concurrency": concurrency, "steps": steps, "schedule_overlap": overlap,
            "step_ms_median": round(1e3 * statistics.median(walls), 3),
            "in_replays_ms_median": round(1e3 * statistics.median(inside), 3),
            "outside_ms_median": round(1e3 * statistics.median(outside), 3),
            "outside_ms_mean": round(1e3 * statistics.mean(outside), 3),
            "ops_outside_per_step": round(len(ops) / counted_steps, 1),
            # draft-off steps and policies without a tier choice make no call
            "choose_tier_us_median": round(1e6 * statistics.median(choice_seconds), 1) if choice_seconds else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"Comma-separated, from {sorted(POLICIES)}.")
    parser.add_argument("--concurrency", default="1,16", help="Comma-separated request counts (at most 16).")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    labels = policy_labels(parser, args.policies, POLICIES)
    try:
        counts = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.error(f"--concurrency: expected comma-separated integers, got {args.concurrency!r}")
    if not all(1 <= c <= max(BUCKETS) for c in counts):
        parser.error(f"--concurrency: every value must lie in 1..{max(BUCKETS)}, got {counts}")
    torch.set_num_threads(1)  # host work is one thread; the device thread with overlap is another
    rows = []
    for label in labels:
        for concurrency in counts:
            row = measure(label, concurrency, args.steps, args.warmup, overlap=False)
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    meta = {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
            "torch": torch.__version__, "models": "tiny random float64 (tests/engine_support.tiny_pair)",
            "draft_width": WIDTH, "command": " ".join(sys.argv)}
    Path(args.output).write_text(json.dumps({"meta": meta, "results": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
