"""Benchmark figures per cell, ratios against the fixed-width baselines, and the Markdown table.

Definitions: acceptance = accepted drafted tokens / verified drafted tokens;
accepted length (tau) = committed tokens per decode step per request, bonus
included; TPOT = (finish - first token) / (output tokens - 1) per request;
TTFT = first token - submission. ``model_*`` figures are computed from the
calibrated cost table, not the wall clock: they are how the policy (and the
oracle, which verifies exactly the tokens that get accepted) would do if the
table were exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dspark_core.bench.run import CellRecord


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize(cell: CellRecord, full_width_policy: str = "") -> dict[str, Any]:
    """The figures of one (policy, concurrency) cell; the oracle is read off the full-width run,
    the only one that verified every drafted token and so knows what would have been accepted."""
    reqs = cell.requests
    tokens = sum(len(r.token_ids) for r in reqs)
    tpot = [(r.finished - r.first_token) / (len(r.token_ids) - 1) for r in reqs if len(r.token_ids) > 1]
    ttft = [r.first_token - r.submitted for r in reqs]
    verified, accepted = sum(r.verified for r in reqs), sum(r.accepted for r in reqs)
    steps = sum(r.steps for r in reqs)
    widths = [w for r in reqs for w in r.verify_widths]
    decode_tokens = sum(max(len(r.token_ids) - 1, 0) for r in reqs)
    covered = cell.model_steps_covered
    return {
        "policy": cell.policy, "concurrency": cell.concurrency, "requests": len(reqs), "output_tokens": tokens,
        "wall_seconds": round(cell.wall_seconds, 3),
        "output_tokens_per_second": tokens / cell.wall_seconds if cell.wall_seconds else float("nan"),
        "tpot_ms_mean": 1e3 * float(np.mean(tpot)) if tpot else float("nan"),
        "tpot_ms_p50": 1e3 * _percentile(tpot, 50), "tpot_ms_p99": 1e3 * _percentile(tpot, 99),
        "ttft_ms_mean": 1e3 * float(np.mean(ttft)) if ttft else float("nan"),
        "acceptance_rate": accepted / verified if verified else 0.0,
        "accepted_length": (accepted + steps) / steps if steps else float("nan"),
        "mean_verify_width": float(np.mean(widths)) if widths else 0.0,
        "fallback_rate": cell.fallback_steps / cell.steps if cell.steps else 0.0,
        "model_tokens_per_second": decode_tokens / cell.model_seconds if covered else float("nan"),
        "oracle_model_tokens_per_second": decode_tokens / cell.oracle_seconds
        if covered and cell.policy == full_width_policy else float("nan"),
    }


def add_ratios(rows: list[dict[str, Any]], draft_width: int) -> None:
    """Throughput ratios vs fixed full width and vs the best fixed k at the same concurrency."""
    for concurrency in sorted({r["concurrency"] for r in rows}):
        same = [r for r in rows if r["concurrency"] == concurrency]
        fixed = [r for r in same if r["policy"].startswith("fixed-k")]
        full = next((r for r in same if r["policy"] == f"fixed-k{draft_width}"), None)
        best = max(fixed, key=lambda r: r["output_tokens_per_second"], default=None)
        oracle = full["oracle_model_tokens_per_second"] if full else float("nan")
        for r in same:
            tps = r["output_tokens_per_second"]
            r["vs_fixed_full_width"] = tps / full["output_tokens_per_second"] if full else float("nan")
            r["vs_best_fixed"] = tps / best["output_tokens_per_second"] if best else float("nan")
            r["best_fixed"] = best["policy"] if best else None
            r["model_vs_oracle"] = r["model_tokens_per_second"] / oracle if oracle == oracle else float("nan")


def exactness(cells: Sequence[CellRecord]) -> dict[str, Any]:
    """Did every policy commit the same tokens for the same prompt? (They must.)"""
    outputs: dict[tuple[int, int], dict[str, tuple[int, ...]]] = {}
    for cell in cells:
        for r in cell.requests:
            outputs.setdefault((cell.concurrency, r.prompt_index), {})[cell.policy] = r.token_ids
    mismatches = [{"concurrency": c, "prompt": p, "policies": sorted(v)} for (c, p), v in sorted(outputs.items())
                  if len(set(v.values())) > 1]
    return {"identical": not mismatches, "checked_prompts": len(outputs), "mismatches": mismatches}


COLUMNS = [("policy", "policy", "{}"), ("c", "concurrency", "{}"), ("tok/s", "output_tokens_per_second", "{:.1f}"),
           ("TPOT ms", "tpot_ms_mean", "{:.1f}"), ("p50", "tpot_ms_p50", "{:.1f}"), ("p99", "tpot_ms_p99", "{:.1f}"),
           ("TTFT ms", "ttft_ms_mean", "{:.0f}"), ("accept", "acceptance_rate", "{:.2f}"),
           ("tau", "accepted_length", "{:.2f}"), ("verify", "mean_verify_width", "{:.2f}"),
           ("fallback", "fallback_rate", "{:.2f}"), ("vs full", "vs_fixed_full_width", "{:.2f}x"),
           ("vs best fixed", "vs_best_fixed", "{:.2f}x"), ("model tok/s", "model_tokens_per_second", "{:.1f}"),
           ("oracle tok/s (model)", "oracle_model_tokens_per_second", "{:.1f}"),
           ("model vs oracle", "model_vs_oracle", "{:.2f}x")]


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """One Markdown table of every cell."""
    lines = ["| " + " | ".join(h for h, _, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = []
        for _, key, fmt in COLUMNS:
            value = r.get(key)
            cells.append("—" if value is None or (isinstance(value, float) and not np.isfinite(value)) else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
