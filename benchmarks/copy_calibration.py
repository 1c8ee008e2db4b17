"""Are a draft's copy confidences right on a prompt set? Fitted against measured, per key length.

The copy confidences in a draft's config (``calibrate-confidence --copies_only``)
are measured on one set of texts; the budget policy prices copied tokens by
them everywhere. This script lets the target answer a prompt set greedily (the
real engine, target only), scans every anchor of every answer with the engine's
own lookup, as ``calibrate-confidence`` does, and sets the measured acceptance
of each key length and position beside the fitted one. The summary figure is
``predicted_over_realized``: copied tokens the fitted confidences expect
(survival products, summed per copy) over those the target took. Above 1 the
policy over-prices copies on these prompts.

    python benchmarks/copy_calibration.py --prompts heldout.jsonl --output copy-calibration-heldout.json
    python benchmarks/copy_calibration.py --output copy-calibration-mtbench.json   # MT-Bench: measure only
"""

from __future__ import annotations

import argparse

import numpy as np
from common import load_models, make_engine, mtbench_chats, set_threads, write_report

from dspark_core.engine.copies import copy_settings
from dspark_core.engine.request import SamplingParams
from dspark_core.prompts import read_prompts_jsonl
from dspark_core.train.copies import copy_acceptance


def compare(fitted: list[list[float]], measured: dict) -> dict:
    """Per key length: copies found, fitted and measured confidences, expected and realized copied
    tokens per copy; and the ratio of expected to realized over all copies."""
    rows, expected_total, realized_total = [], 0.0, 0
    for index, order in enumerate(measured["orders"]):
        copies, hits = measured["copied"][index], measured["hits"][index]
        expected = float(np.cumprod(fitted[index]).sum())
        expected_total += expected * copies
        realized_total += sum(hits)
        rows.append({"order": order, "copies": copies, "fitted": [round(c, 3) for c in fitted[index]],
                     "measured": [round(c, 3) for c in measured["confidences"][index]],
                     "expected_per_copy": round(expected, 3),
                     "realized_per_copy": round(sum(hits) / copies, 3) if copies else None})
    ratio = expected_total / realized_total if realized_total else float("nan")
    return {"anchors": measured["anchors"], "orders": rows, "predicted_over_realized": round(ratio, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default=None, help="JSONL prompts (`prompt` or `messages`); default MT-Bench first turns.")
    parser.add_argument("--limit", type=int, default=80)
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--width", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    set_threads(args.threads)
    prompts = read_prompts_jsonl(args.prompts) if args.prompts else mtbench_chats(args.limit)
    prompts = prompts[: args.limit]
    target, draft = load_models()
    orders, fitted = copy_settings(draft, "on", args.width)
    engine = make_engine(target, None, width=args.width, policy="none", overlap=False, max_model_len=2048)
    requests = [engine.add_request(p, SamplingParams(max_tokens=args.max_tokens)) for p in prompts]
    while engine.has_work:
        engine.step()
    answers = [(list(r.prompt), list(r.output)) for r in requests]
    report = compare(fitted, copy_acceptance(answers, orders, args.width))
    report["prompts"] = args.prompts or "mt-bench"
    report["count"] = len(prompts)
    print(f"{report['prompts']}: {len(prompts)} prompts, {report['anchors']} anchors, "
          f"predicted/realized copied tokens {report['predicted_over_realized']}")
    for row in report["orders"]:
        print(f"  key {row['order']}: {row['copies']} copies, expected {row['expected_per_copy']} "
              f"realized {row['realized_per_copy']} tokens per copy")
    if args.output:
        write_report(args.output, report)


if __name__ == "__main__":
    main()
