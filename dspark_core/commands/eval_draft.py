"""``dspark-core eval-draft``: acceptance, τ and confidence quality of a draft on held-out prompts."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from dspark_core.commands import positive_int, positive_ints
from dspark_core.train.runtime import DTYPES, add_device_arguments

NAME = "eval-draft"
HELP = "Evaluate a draft: real-engine acceptance and τ at several widths, confidence ECE (before/after STS) and ROC-AUC."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--target", default="smollm2", help="Target GGUF file, HF directory or alias. Default: smollm2.")
    a("--draft_model", default="default", help="Draft directory, or 'default' for the target's shipped draft. Default: default.")
    a("--prompts", default=None, help="JSONL of prompts (objects with 'prompt' or 'messages', or a generations file with "
                                      "'prompt_ids' such as RUN/heldout.jsonl of train-draft). Default: MT-Bench first turns.")
    a("--limit", type=int, default=0, help="Use only the first N prompts (0 = all).")
    a("--widths", type=positive_ints, default=(5, 7), help="Draft widths K to run, comma separated. Default: 5,7.")
    a("--max_tokens", type=positive_int, default=128, help="Greedy tokens per prompt. Default: 128.")
    a("--batch", type=positive_int, default=16, help="Largest request bucket (concurrent requests). Default: 16.")
    a("--bins", type=positive_int, default=15, help="ECE bins. Default: 15.")
    a("--copy_proposals", choices=["auto", "on", "off"], default="auto",
      help="Copy proposals in the engine, as serve's flag (auto: as the draft's config says). Default: auto.")
    add_device_arguments(parser)
    a("--draft_dtype", choices=["same", *DTYPES], default="same",
      help="Draft dtype (`same`: --dtype). `serve` on a CPU with native bfloat16 drafts in bfloat16. Default: same.")
    a("--threads", type=int, default=1, help="Torch CPU threads. Default: 1.")
    a("--tiny", action="store_true", help="Use the random tiny target of train-draft --tiny (for smoke runs; needs "
                                          "--prompts with prompt_ids, e.g. RUN/heldout.jsonl).")
    a("--json", action="store_true", help="Print one JSON object.")


def read_eval_prompts(path: Path) -> list:
    """Prompts of a JSONL file: chat/text prompts, or the token ids of a generations file (``prompt_ids``)."""
    from dspark_core.prompts import jsonl_records
    from dspark_core.train.data import read_generations, read_prompts_jsonl

    first = next(jsonl_records(path), (0, None))[1]
    if isinstance(first, dict) and "prompt_ids" in first:
        return [p for p, _ in read_generations(path)]
    return read_prompts_jsonl(path)


def evaluate(target, draft, prompts, *, widths=(5, 7), max_tokens=128, batch=16, bins=15,
             copy_proposals: str = "auto") -> dict:
    """All figures of the report (see docs/draft-training.md for definitions); the engine proposes
    with copies as ``copy_proposals`` says, and with copies on the confidence figures are also
    given for the blocks as proposed (copied tokens with their confidences)."""
    import numpy as np

    from dspark_core.engine.copies import copy_settings
    from dspark_core.train import sts
    from dspark_core.train.data import chat_ids
    from dspark_core.train.evaluate import block_confidences, engine_acceptance

    ids = [chat_ids(target.tokenizer, p) for p in prompts]
    buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b <= batch) or (1,)
    report: dict = {"prompts": len(ids), "max_tokens": max_tokens, "widths": {}}
    outputs = None
    for k in widths:
        started = time.perf_counter()
        r = engine_acceptance(target, draft, ids, width=k, max_tokens=max_tokens, buckets=buckets,
                              copy_proposals=copy_proposals)
        outputs = r.pop("outputs")
        r["seconds"] = round(time.perf_counter() - started, 1)
        report["widths"][str(k)] = r
    if outputs is not None:
        pairs = [(p, o) for p, o in zip(ids, outputs)]
        logits, hits = block_confidences(draft, target, pairs)
        if len(logits):
            k_out = logits.shape[1]
            temps = list(draft.config.temperatures)
            auc, per_auc = sts.reached_auc(logits, hits)
            report["confidence"] = {
                "blocks": len(logits),
                "offline_acceptance_by_position": (sts.survival(hits).mean(0)).tolist(),
                "ece_before": sts.survival_ece(logits, hits, [1.0] * k_out, bins),
                "ece_after": sts.survival_ece(logits, hits, temps, bins),
                "temperatures": temps,
                "roc_auc": auc,
                "roc_auc_by_position": per_auc,
                "mean_hit_rate": float(np.mean(hits)),
            }
            orders, copy_confidences = copy_settings(draft, copy_proposals, k_out)
            report["copy_orders"] = list(orders)
            if orders:
                report["confidence_with_copies"] = copy_figures(pairs, logits, hits, temps, orders, copy_confidences, bins)
    return report


def copy_figures(pairs, logits, hits, temperatures, orders, copy_confidences, bins) -> dict:
    """Survival ECE and ROC-AUC of the blocks as the engine proposes them with copies."""
    import numpy as np

    from dspark_core.train import sts
    from dspark_core.train.copies import with_copies

    confidences, combined = with_copies(pairs, logits, hits, temperatures, orders, copy_confidences)
    predicted, survived = np.cumprod(confidences, axis=1), sts.survival(combined)
    auc, per_auc = sts.reached_auc(confidences, combined)  # rank-based: probabilities serve as scores
    return {"copy_confidences": [list(row) for row in copy_confidences],
            "offline_acceptance_by_position": survived.mean(0).tolist(),
            "ece": [sts.ece(predicted[:, j], survived[:, j], bins) for j in range(confidences.shape[1])],
            "roc_auc": auc, "roc_auc_by_position": per_auc}


def _clean(value):
    """NaN (a position no step reached) becomes null so the output is strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _print(report: dict) -> None:
    print(f"{report['prompts']} prompts, greedy, max_tokens {report['max_tokens']}")
    for k, r in report["widths"].items():
        print(f"K={k}: tau {r['tau']:.3f} (incl. bonus), acceptance {r['acceptance']:.3f}, {r['steps']} request-steps, {r['seconds']}s")
        print("   survival by position:   " + " ".join(f"{x:.3f}" for x in r["survival_by_position"]))
        print("   acceptance by position: " + " ".join(f"{x:.3f}" for x in r["acceptance_by_position"]))
    c = report.get("confidence")
    if c:
        print(f"confidence ({c['blocks']} blocks): ROC-AUC {c['roc_auc']:.3f}")
        print("   survival ECE before STS: " + " ".join(f"{100 * x:.2f}%" for x in c["ece_before"]))
        print("   survival ECE after STS:  " + " ".join(f"{100 * x:.2f}%" for x in c["ece_after"]))
    c = report.get("confidence_with_copies")
    if c:
        orders = "/".join(str(o) for o in report["copy_orders"])
        print(f"with copies (keys of {orders} tokens): ROC-AUC {c['roc_auc']:.3f}")
        print("   survival ECE:            " + " ".join(f"{100 * x:.2f}%" for x in c["ece"]))


def run(args: argparse.Namespace) -> int:
    from dspark_core.errors import ConfigError
    from dspark_core.models.drafts import resolve_draft_path
    from dspark_core.models.speculators_io import load_draft, read_draft_config
    from dspark_core.train.data import mtbench_first_turns
    from dspark_core.train.runtime import setup

    device, dtype = setup(args)
    if args.tiny and not args.prompts:
        raise ConfigError("eval-draft --tiny needs --prompts=RUN/heldout.jsonl (token ids; the tiny target has no tokenizer)")
    # the inputs are checked before any model loads: the prompts, and widths the draft can propose
    prompts = read_eval_prompts(Path(args.prompts)) if args.prompts else mtbench_first_turns()
    draft_dir = resolve_draft_path(args.draft_model, args.target)
    proposes = read_draft_config(draft_dir).num_speculative_tokens
    if max(args.widths) > proposes:
        raise ConfigError(f"--widths={','.join(map(str, args.widths))}: the draft at {draft_dir} proposes at most "
                          f"{proposes} tokens per block")
    if args.tiny:
        from dspark_core.train.sources import tiny_target

        target = tiny_target(device, dtype)
    else:
        from dspark_core.models.loading import load_target

        target = load_target(args.target, device=device, dtype=dtype)
    draft_dtype = dtype if args.draft_dtype == "same" else DTYPES[args.draft_dtype]
    draft = load_draft(draft_dir, device=device, dtype=draft_dtype)
    if args.limit > 0:
        prompts = prompts[: args.limit]
    report = evaluate(target, draft, prompts, widths=args.widths, max_tokens=args.max_tokens, batch=args.batch, bins=args.bins,
                      copy_proposals=args.copy_proposals)
    report["draft"] = str(draft_dir)
    report["device"], report["dtype"] = str(device), args.dtype
    report["draft_dtype"] = str(draft_dtype).removeprefix("torch.")
    report["prompt_source"] = args.prompts or "mt_bench first turns"
    if args.json:
        print(json.dumps(_clean(report)))
    else:
        _print(report)
    return 0
