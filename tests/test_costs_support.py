"""Shared builders for the cost-model and cost-table tests (no tests of its own).

Cost models are reached the way the engine reaches them: through a plugin
manager built from the ``dspark_core`` entry points, never by importing the
default plugins into core code.
"""

from __future__ import annotations

from dspark_core.calibration import CalibrationSettings, ContextInterval
from dspark_core.costs import CostSample, Execution, Fingerprint, ModelIdentity, Parallelism
from dspark_core.geometry import Geometry, legal_tiers
from dspark_core.plugins import Hooks, build_plugin_manager

HOOKS = Hooks(build_plugin_manager(["additive", "sps"], autoload=False))
LOOKUP = HOOKS.cost_model
CONTEXT = ContextInterval(prefill_tokens=64, min_kv_length=1, max_kv_length=256)


def planted(bias: float, alpha: dict[int, float], theta: dict[int, float]):
    """The additive truth as a function of (bucket, rows); theta is interpolated."""
    rows = sorted(theta)

    def cost(b: int, g: int) -> float:
        for lo, hi in zip(rows, rows[1:]):
            if lo <= g <= hi:
                t = theta[lo] + (g - lo) / (hi - lo) * (theta[hi] - theta[lo])
                return bias + alpha[b] + t
        return bias + alpha[b] + theta[g]

    return cost


def grid_samples(cost, buckets, draft_width, *, rows=None, steps=32, windows=3, context=0, noise=None):
    """Windows at every legal tier (or ``rows(b)``) of every bucket; ``noise(i)`` scales seconds."""
    out = []
    i = 0
    for b in buckets:
        for g in (rows(b) if rows else legal_tiers(b, draft_width)):
            for _ in range(windows):
                factor = 1.0 if noise is None else noise(i)
                i += 1
                out.append(CostSample(b, g, context, cost(b, g) * steps * factor, steps))
    return out


def settings(model="additive", draft_width=3, buckets=(1, 2, 4), contexts=(CONTEXT,)):
    return CalibrationSettings(
        model=model, draft_width=draft_width, request_buckets=buckets, contexts=contexts,
        warmup_steps=8, window_steps=32, windows_per_point=3, token_seed=1,
    )


def fingerprint(draft_width=3, buckets=(1, 2, 4), device="cpu", dtype="float32", dp=1):
    return Fingerprint(
        target=ModelIdentity("target.gguf", "sha256:aa", 1000),
        draft=ModelIdentity("dspark", "sha256:bb", 200),
        parallelism=Parallelism(nnodes=1, tp=1, dp=dp, cp=1),
        execution=Execution(device, "static", dtype, True, True, Geometry.all_tiers(draft_width, buckets)),
    )


def simple_cost(b: int, g: int) -> float:
    return 0.010 + 0.001 * b + 0.0002 * g
