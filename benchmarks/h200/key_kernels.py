"""Device kernels each captured key launches per replay, counted on the CPU.

A replayed CUDA graph still runs every kernel it recorded, one after another: SmolLM2 has 30 layers,
so each elementwise op of a layer costs 30 kernels of 1-3 us per step however small the batch (the
first H200 profile counted about 1 130 kernels in a target-only step). This script runs the real
target and the shipped draft in float32 on the CPU through the captured-backend stand-in of the
tests (`tests/capture_support.py`), in the configuration CUDA runs (no batch-invariant forwards,
matmul attention for decode-sized row counts, the residual added inside the output products, no CPU
row padding), and counts the aten ops each key runs in a replay, views left out: on a GPU each such
op is about one kernel launch. The totals are therefore a proxy for a key's launch count that can be
compared before and after a change without a device; the device profile (`step_profile.py`) gives
the real figures.

    python benchmarks/h200/key_kernels.py --output /tmp/key-kernels.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from capture_support import StandInCapturedBackend  # noqa: E402
from common import load_models, mtbench_chats  # noqa: E402
from engine_support import synthetic_table  # noqa: E402

from dspark_core.engine.engine import Engine, EngineConfig  # noqa: E402
from dspark_core.engine.request import SamplingParams  # noqa: E402
from dspark_core.geometry import Geometry  # noqa: E402
from dspark_core.models import attention, layers  # noqa: E402

# aten ops that launch no device kernel: views of existing storage, type queries, and the 0-dim host
# tensors Python scalars are wrapped in (`torch.where(mask, x, 0.0)`)
NO_KERNEL_OPS = {"view", "_unsafe_view", "reshape", "slice", "select", "expand", "unsqueeze", "squeeze", "transpose",
            "permute", "t", "as_strided", "alias", "detach", "split", "split_with_sizes", "chunk", "unbind",
            "narrow", "view_as", "flatten", "unflatten", "diagonal", "movedim", "expand_as", "_reshape_alias",
            "promote_types", "result_type", "lift_fresh", "numel", "sym_size", "sym_stride", "sym_numel", "is_same_size",
            "contiguous", "scalar_tensor"}


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.fused: str | None = None  # inside an op that is one kernel on CUDA but decomposes on the CPU

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL_OPS and self.fused is None:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


_COUNTER: list[_Counter] = []
_rms_norm = torch.nn.functional.rms_norm


def _rms_norm_as_one_kernel(*args, **kwargs):
    """F.rms_norm is `_fused_rms_norm`, one kernel, on CUDA; on the CPU it decomposes into six ops."""
    counter = _COUNTER[-1] if _COUNTER else None
    if counter is None or counter.fused is not None:
        return _rms_norm(*args, **kwargs)
    counter.ops["_fused_rms_norm"] += 1
    counter.fused = "rms_norm"
    try:
        return _rms_norm(*args, **kwargs)
    finally:
        counter.fused = None


class CountingReplays(StandInCapturedBackend):
    """The stand-in, counting the kernel-launching ops of each key's replays."""

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.per_key: dict[str, collections.Counter] = {}
        self.replays: collections.Counter = collections.Counter()

    def _replay(self, key, prepared):
        counter = _Counter()
        _COUNTER.append(counter)
        try:
            with counter:
                outputs = super()._replay(key, prepared)
        finally:
            _COUNTER.pop()
        name = key.describe()
        self.replays[name] += 1
        self.per_key.setdefault(name, counter.ops)  # one replay's ops: a key's replays are identical
        return outputs


def count(policy: str, concurrency: int, steps: int, width: int, target, draft,
          buckets: tuple[int, ...] | None = None) -> dict:
    """One engine's keys for ``policy`` at ``concurrency`` requests; ``buckets`` (default: the
    concurrency alone) as ``serve`` and ``bench`` build them, whose cache has a slot per largest-bucket
    entry, so smaller buckets gather their keys instead of reading the cache in place."""
    graphs = CountingReplays("cpu")
    buckets = (concurrency,) if buckets is None else buckets
    engine = Engine(target, draft if policy != "none" else None,
                    EngineConfig(draft_width=width, policy=policy, request_buckets=buckets, max_model_len=1024,
                                 schedule_overlap=False),
                    geometry=Geometry.bucket_multiples(width, buckets), graphs=graphs)
    engine.install_table(synthetic_table(width, buckets))
    engine.warmup()
    engine.mark_ready()
    params = SamplingParams(max_tokens=steps * (width + 1) + 8, ignore_eos=True)
    for chat in mtbench_chats(concurrency):
        engine.add_request(chat, params)
    for _ in range(steps):
        engine.step()
    engine.close()
    keys = {name: {"kernels": sum(ops.values()), "replays": graphs.replays[name], "top": dict(ops.most_common(12))}
            for name, ops in graphs.per_key.items()}
    return {"policy": policy, "concurrency": concurrency, "keys": keys}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="none:1,fixed:1,fixed:16,adaptive:16",
                        help="policy:concurrency pairs")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--width", type=int, default=7)
    parser.add_argument("--buckets", help="request buckets of every engine, e.g. 1,2,4,8,16 as serve builds them "
                                          "(default: each run's concurrency alone)")
    parser.add_argument("--output")
    args = parser.parse_args()
    buckets = tuple(int(b) for b in args.buckets.split(",")) if args.buckets else None
    attention.set_attention_kernel("matmul")  # what CUDA runs at decode sizes
    layers.set_residual_product("fused")  # CUDA adds the residual inside the output products
    torch.nn.functional.rms_norm = _rms_norm_as_one_kernel  # layers.rms_norm calls it through F
    layers._CPU_MIN_ROWS = 1  # no CPU-only row padding
    target, draft = load_models()
    target.set_batch_invariant(False)
    results = []
    for pair in args.runs.split(","):
        policy, concurrency = pair.split(":")
        result = count(policy, int(concurrency), args.steps, args.width, target, draft, buckets)
        results.append(result)
        for name, entry in result["keys"].items():
            print(f"{policy:9s} c{concurrency:<3s} {name:55s} {entry['kernels']:5d} kernels  top {entry['top']}")
    if args.output:
        Path(args.output).write_text(json.dumps({"meta": {"torch": torch.__version__, "command": sys.argv},
                                                 "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
