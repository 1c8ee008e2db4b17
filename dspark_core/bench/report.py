"""Benchmark figures per cell, ratios against the fixed-width baselines, and the Markdown table.

Definitions: acceptance = accepted drafted tokens / verified drafted tokens;
accepted length (tau) = committed tokens per decode step per request, bonus
included; TPOT = (finish - first token) / (output tokens - 1) per request;
TTFT = first token - submission. ``model_*`` figures are computed from the
calibrated cost table, not the wall clock: they are how the policy (and the
oracle, which verifies exactly the tokens that get accepted) would do if the
table were exact. The table's costs include running the draft, so a policy
that never runs it (``none``) has no model or oracle figures.
``predicted_over_realized`` is the policy's forecast of committed tokens
summed over the steps it forecast, divided by what those steps committed
(1.0 = calibrated forecasts; NaN for policies that make none).
``drafted_step_ms`` and ``draft_off_step_ms`` are medians of the measured
decode steps (device work up to the result copy, no prefill), drafted and
not (target-only's steps are draft-off ones): set beside the table's prices,
they show which kind of step the table gets wrong on this machine.

Ratios: each cell's headline ratio pools every round (total tokens / total
wall time). The same ratio is also taken round by round, each round against
the same baseline policy's run of that round, and its ``spread`` gives the
minimum, median and maximum over the rounds: how far machine noise moves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dspark_core.bench.run import CellRecord

# the ratios whose spread over rounds is reported
RATIOS = ("vs_target_only", "vs_fixed_full_width", "vs_best_fixed", "model_vs_oracle", "predicted_over_realized")


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def _divide(a: float, b: float) -> float:
    return a / b if b and np.isfinite(a) and np.isfinite(b) else float("nan")


def _figures(cell: CellRecord, oracle: bool) -> dict[str, float]:
    """The round-by-round comparable figures of one cell: wall-clock and model throughput, forecast ratio."""
    tokens = sum(len(r.token_ids) for r in cell.requests)
    decode_tokens = sum(max(len(r.token_ids) - 1, 0) for r in cell.requests)
    modelled = cell.uses_draft and cell.model_steps_covered > 0
    return {
        "output_tokens_per_second": _divide(tokens, cell.wall_seconds),
        "model_tokens_per_second": _divide(decode_tokens, cell.model_seconds) if modelled else float("nan"),
        "oracle_model_tokens_per_second": _divide(decode_tokens, cell.oracle_seconds)
        if modelled and oracle else float("nan"),
        "predicted_over_realized": _divide(cell.predicted_tokens, cell.forecast_committed)
        if cell.forecast_steps else float("nan"),
    }


def summarize(cell: CellRecord, full_width_policy: str = "") -> dict[str, Any]:
    """The figures of one (policy, concurrency) cell; the oracle is read off the full-width run,
    the only one that verified every drafted token and so knows what would have been accepted."""
    reqs = cell.requests
    # a recorded request has finished and so has its first token; the filters only say so to the type checker
    tpot = [(r.finished - r.first_token) / (len(r.token_ids) - 1) for r in reqs
            if len(r.token_ids) > 1 and r.finished is not None and r.first_token is not None]
    ttft = [r.first_token - r.submitted for r in reqs if r.first_token is not None]
    verified, accepted = sum(r.verified for r in reqs), sum(r.accepted for r in reqs)
    steps = sum(r.steps for r in reqs)
    widths = [w for r in reqs for w in r.verify_widths]
    oracle = cell.policy == full_width_policy
    figures = _figures(cell, oracle)
    rounds = [_figures(part, oracle) for part in cell.per_round()]
    return {
        "policy": cell.policy, "concurrency": cell.concurrency, "requests": len(reqs),
        "output_tokens": sum(len(r.token_ids) for r in reqs), "wall_seconds": round(cell.wall_seconds, 3),
        "rounds": len(rounds),
        "output_tokens_per_second": figures["output_tokens_per_second"],
        "tpot_ms_mean": 1e3 * float(np.mean(tpot)) if tpot else float("nan"),
        "tpot_ms_p50": 1e3 * _percentile(tpot, 50), "tpot_ms_p99": 1e3 * _percentile(tpot, 99),
        "ttft_ms_mean": 1e3 * float(np.mean(ttft)) if ttft else float("nan"),
        "acceptance_rate": accepted / verified if verified else 0.0,
        "accepted_length": (accepted + steps) / steps if steps else float("nan"),
        "mean_verify_width": float(np.mean(widths)) if widths else 0.0,
        "fallback_rate": cell.fallback_steps / cell.steps if cell.steps else 0.0,
        # how often a drafting policy left the draft off, and how many of those steps verified copies
        # (not defined for target-only decoding, whose every step runs without a draft)
        "draft_off_rate": cell.draft_off_steps / cell.steps if cell.steps and cell.uses_draft else float("nan"),
        "copy_step_rate": cell.copy_steps / cell.steps if cell.steps and cell.uses_draft else float("nan"),
        "model_tokens_per_second": figures["model_tokens_per_second"],
        "oracle_model_tokens_per_second": figures["oracle_model_tokens_per_second"],
        "predicted_over_realized": figures["predicted_over_realized"],
        "forecast_steps": cell.forecast_steps,
        "drafted_step_ms": 1e3 * _percentile(cell.drafted_step_seconds, 50),
        "draft_off_step_ms": 1e3 * _percentile(cell.off_step_seconds, 50),
        "per_round": {key: [f[key] for f in rounds] for key in figures},
    }


def spread(values: Sequence[float]) -> dict[str, float]:
    """Minimum, median and maximum of the finite ``values`` (NaN when there are none)."""
    finite = [float(v) for v in values if np.isfinite(v)]
    if not finite:
        return {"min": float("nan"), "median": float("nan"), "max": float("nan")}
    return {"min": min(finite), "median": float(np.median(finite)), "max": max(finite)}


def _per_round(row: dict[str, Any] | None, key: str, rounds: int) -> list[float]:
    values = (row or {}).get("per_round", {}).get(key) or []
    return list(values) if len(values) == rounds else [float("nan")] * rounds


def add_ratios(rows: list[dict[str, Any]], draft_width: int) -> None:
    """Throughput ratios vs fixed full width and vs the best fixed k at the same concurrency,
    pooled and per round (with their spread). The best fixed k is chosen on the pooled figures."""
    for concurrency in sorted({r["concurrency"] for r in rows}):
        same = [r for r in rows if r["concurrency"] == concurrency]
        fixed = [r for r in same if r["policy"].startswith("fixed-k")]
        full = next((r for r in same if r["policy"] == f"fixed-k{draft_width}"), None)
        target_only = next((r for r in same if r["policy"] == "none"), None)
        best = max(fixed, key=lambda r: r["output_tokens_per_second"], default=None)
        oracle = full["oracle_model_tokens_per_second"] if full else float("nan")
        for r in same:
            tps = r["output_tokens_per_second"]
            r["vs_target_only"] = _divide(tps, target_only["output_tokens_per_second"]) if target_only else float("nan")
            r["vs_fixed_full_width"] = _divide(tps, full["output_tokens_per_second"]) if full else float("nan")
            r["vs_best_fixed"] = _divide(tps, best["output_tokens_per_second"]) if best else float("nan")
            r["best_fixed"] = best["policy"] if best else None
            r["model_vs_oracle"] = _divide(r["model_tokens_per_second"], oracle)
            n = len(r.get("per_round", {}).get("output_tokens_per_second") or [tps])
            mine = _per_round(r, "output_tokens_per_second", n)
            per_round = {
                "vs_target_only": list(map(_divide, mine, _per_round(target_only, "output_tokens_per_second", n))),
                "vs_fixed_full_width": list(map(_divide, mine, _per_round(full, "output_tokens_per_second", n))),
                "vs_best_fixed": list(map(_divide, mine, _per_round(best, "output_tokens_per_second", n))),
                "model_vs_oracle": list(map(_divide, _per_round(r, "model_tokens_per_second", n),
                                            _per_round(full, "oracle_model_tokens_per_second", n))),
                "predicted_over_realized": _per_round(r, "predicted_over_realized", n),
            }
            r.setdefault("per_round", {}).update(per_round)
            r["spread"] = {key: spread(per_round[key]) for key in RATIOS}


def exactness(cells: Sequence[CellRecord]) -> dict[str, Any]:
    """Did every policy, in every round, commit the same tokens for the same prompt? (They must.)"""
    outputs: dict[tuple[int, int], dict[str, set[tuple[int, ...]]]] = {}
    for cell in cells:
        for part in cell.per_round():
            for r in part.requests:
                outputs.setdefault((cell.concurrency, r.prompt_index), {}).setdefault(cell.policy, set()).add(r.token_ids)
    mismatches = []
    for (c, p), by_policy in sorted(outputs.items()):
        if len(set().union(*by_policy.values())) > 1:
            mismatches.append({"concurrency": c, "prompt": p, "policies": sorted(by_policy)})
    return {"identical": not mismatches, "checked_prompts": len(outputs), "mismatches": mismatches}


def _spread_text(row: dict[str, Any], key: str) -> str:
    s = row.get("spread", {}).get(key)
    if not s or not np.isfinite(s["median"]):
        return "—"
    return f"{s['min']:.2f}/{s['median']:.2f}/{s['max']:.2f}"


COLUMNS = [("policy", "policy", "{}"), ("c", "concurrency", "{}"), ("tok/s", "output_tokens_per_second", "{:.1f}"),
           ("TPOT ms", "tpot_ms_mean", "{:.1f}"), ("p50", "tpot_ms_p50", "{:.1f}"), ("p99", "tpot_ms_p99", "{:.1f}"),
           ("TTFT ms", "ttft_ms_mean", "{:.0f}"), ("accept", "acceptance_rate", "{:.2f}"),
           ("tau", "accepted_length", "{:.2f}"), ("verify", "mean_verify_width", "{:.2f}"),
           ("fallback", "fallback_rate", "{:.2f}"), ("draft off", "draft_off_rate", "{:.2f}"),
           ("copy steps", "copy_step_rate", "{:.2f}"), ("pred/real", "predicted_over_realized", "{:.2f}"),
           ("drafted step ms", "drafted_step_ms", "{:.1f}"), ("draft-off step ms", "draft_off_step_ms", "{:.1f}"),
           ("vs target-only", "vs_target_only", "{:.2f}x"), ("vs target-only min/med/max", "vs_target_only", None),
           ("vs full", "vs_fixed_full_width", "{:.2f}x"), ("vs full min/med/max", "vs_fixed_full_width", None),
           ("vs best fixed", "vs_best_fixed", "{:.2f}x"), ("vs best min/med/max", "vs_best_fixed", None),
           ("model tok/s", "model_tokens_per_second", "{:.1f}"),
           ("oracle tok/s (model)", "oracle_model_tokens_per_second", "{:.1f}"),
           ("model vs oracle", "model_vs_oracle", "{:.2f}x")]


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """One Markdown table of every cell (ratio spreads as min/median/max over the rounds)."""
    lines = ["| " + " | ".join(h for h, _, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = []
        for _, key, fmt in COLUMNS:
            if fmt is None:
                cells.append(_spread_text(r, key))
                continue
            value = r.get(key)
            cells.append("—" if value is None or (isinstance(value, float) and not np.isfinite(value)) else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
