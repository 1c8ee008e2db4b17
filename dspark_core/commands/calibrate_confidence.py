"""``dspark-core calibrate-confidence``: fit per-position STS temperatures on held-out generations."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dspark_core.commands import positive_int
from dspark_core.engine.copies import DEFAULT_COPY_ORDERS
from dspark_core.errors import ModelError
from dspark_core.models.draft_config import MAX_COPY_ORDER
from dspark_core.train.runtime import add_device_arguments

NAME = "calibrate-confidence"
HELP = "Fit the draft's per-position confidence temperatures (STS) on held-out data and write them into its config."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--draft_model", required=True, help="Draft checkpoint directory (or 'default' for the target's shipped draft).")
    a("--target", default="smollm2", help="Target GGUF file, HF directory or alias. Default: smollm2.")
    a("--heldout", default=None, help="Held-out data: generations JSONL (prompt_ids/answer_ids) or the features file, e.g. "
                                      "RUN/heldout.jsonl or RUN/heldout-features.pt from train-draft. Default: heldout.jsonl next to the draft.")
    a("--output", default=None, help="Write the calibrated checkpoint here (a copy). Default: update the draft in place "
                                     "(for --draft_model=default, the draft shipped in the package, only with --in_place).")
    a("--in_place", action="store_true", help="With --draft_model=default and no --output: rewrite the shipped draft "
                                              "itself (what a maintainer does in a source checkout).")
    a("--offset", action="store_true", help="Also fit one shared logit offset (folded into the confidence head's bias) "
                                          "before the temperatures; use when temperatures alone leave a biased head miscalibrated.")
    a("--bins", type=positive_int, default=15, help="ECE bins. Default: 15.")
    a("--copy_order", type=int, choices=range(0, MAX_COPY_ORDER + 1), default=max(DEFAULT_COPY_ORDERS), metavar="N",
      help="Also fit the confidences of copy proposals whose keys are the last N down to --copy_min_order tokens "
           "(their acceptance per key length and position, teacher forced on the same data) and turn them on in "
           f"the config; 0 leaves the config's copy settings as they are. Default: {max(DEFAULT_COPY_ORDERS)}.")
    a("--copy_min_order", type=int, choices=range(1, MAX_COPY_ORDER + 1), default=min(DEFAULT_COPY_ORDERS), metavar="M",
      help=f"Shortest copy key tried. Default: {min(DEFAULT_COPY_ORDERS)}.")
    a("--copies_only", action="store_true", help="Fit only the copy confidences (no target pass on a generations "
                                                 "file); the temperatures stay as they are.")
    add_device_arguments(parser)
    a("--threads", type=int, default=1, help="Torch CPU threads. Default: 1.")
    a("--tiny", action="store_true", help="Use the random tiny target of train-draft --tiny (for smoke runs).")
    a("--json", action="store_true", help="Print one JSON object.")


def read_heldout(heldout: Path):
    """The held-out data: a features file from train-draft (``.pt``: the features, and its sequences
    cut to the target's greedy path) or a generations JSONL (no features, its greedy sequences)."""
    from dspark_core.train.copies import greedy_sequences
    from dspark_core.train.data import read_generations

    if heldout.suffix != ".pt":
        return None, read_generations(heldout)
    import torch

    from dspark_core.train.features import FeatureSet

    feats = FeatureSet(**torch.load(heldout, weights_only=True))
    return feats, greedy_sequences(feats)


def calibrate(draft_dir: Path, target, heldout: Path, *, output: Path | None = None, bins: int = 15, offset: bool = False,
              copy_orders: tuple[int, ...] = ()) -> dict:
    """Fit, write and report (ECE per position before/after; with ``copy_orders``, the copies' acceptance)."""
    from dspark_core.models.speculators_io import load_draft
    from dspark_core.train import sts
    from dspark_core.train.copies import copy_acceptance, write_copy_settings
    from dspark_core.train.evaluate import block_confidences, confidences_from_features

    draft = load_draft(draft_dir, device=getattr(target, "device", "cpu"))
    feats, pairs = read_heldout(heldout)
    if feats is not None:  # features saved by train-draft: no target pass needed
        logits, hits = confidences_from_features(draft.bind_target(target), feats)
    else:
        logits, hits = block_confidences(draft, target, pairs)
    if len(logits) == 0:
        raise ModelError(f"{heldout}: no complete blocks to calibrate on")
    ones = [1.0] * logits.shape[1]
    if offset:
        shift, temps = sts.fit_sts_with_offset(logits, hits, bins)
    else:
        shift, temps = 0.0, sts.fit_sts(logits, hits, bins)
    written = sts.write_temperatures(draft_dir, temps, output=output)
    if shift:
        sts.add_confidence_offset(written, shift)
    copies = None
    if copy_orders:
        copies = copy_acceptance(pairs, copy_orders, draft.config.num_speculative_tokens)
        write_copy_settings(written, copy_orders, copies["confidences"])
    return {"draft": str(written), "heldout": str(heldout), "blocks": len(logits), "temperatures": temps,
            "offset": shift, "ece_before": sts.survival_ece(logits, hits, ones, bins),
            "ece_after": sts.survival_ece(logits + shift, hits, temps, bins), "copies": copies}


def copy_orders_of(args: argparse.Namespace) -> tuple[int, ...]:
    """The key lengths --copy_order and --copy_min_order ask for, longest first (empty: none)."""
    if args.copy_order == 0:
        return ()
    if args.copy_min_order > args.copy_order:
        raise ModelError(f"--copy_min_order={args.copy_min_order} exceeds --copy_order={args.copy_order}")
    return tuple(range(args.copy_order, args.copy_min_order - 1, -1))


def calibrate_copies(draft_dir: Path, heldout: Path, orders: tuple[int, ...], *, output: Path | None = None) -> dict:
    """Fit and write the copy confidences alone, from greedy generations or a features file."""
    from dspark_core.models.speculators_io import read_draft_config
    from dspark_core.train.copies import copy_acceptance, write_copy_settings
    from dspark_core.train.sts import checkpoint_to_update

    if not orders:
        raise ModelError("--copies_only needs --copy_order >= 1")
    width = read_draft_config(draft_dir).num_speculative_tokens
    copies = copy_acceptance(read_heldout(heldout)[1], orders, width)
    if copies["anchors"] == 0:
        raise ModelError(f"{heldout}: no answer tokens to measure copies on")
    written = checkpoint_to_update(draft_dir, output)
    write_copy_settings(written, orders, copies["confidences"])
    return {"draft": str(written), "heldout": str(heldout), "copies": copies}


def _print_copies(copies: dict) -> None:
    anchors = copies["anchors"]
    print(f"copies at {sum(copies['copied'])} of {anchors} anchors; acceptance per position, by key length:")
    for order, count, row in zip(copies["orders"], copies["copied"], copies["confidences"]):
        print(f"  {order} tokens ({count} anchors): " + ", ".join(f"{c:.3f}" for c in row))


def run(args: argparse.Namespace) -> int:
    from dspark_core.models.drafts import resolve_draft_path
    from dspark_core.train.runtime import setup

    if args.draft_model == "default" and not args.output and not args.in_place:
        # the shipped draft lives inside the installed package: every later serve would load the rewrite
        raise ModelError("--draft_model=default without --output would rewrite the draft shipped in the package; "
                         "pass --output=DIR to write a calibrated copy, or --in_place to rewrite it")
    device, dtype = setup(args)
    draft_dir = resolve_draft_path(args.draft_model, args.target)
    heldout = Path(args.heldout) if args.heldout else draft_dir.parent / "heldout.jsonl"
    if not heldout.is_file():
        raise ModelError(f"held-out file {heldout} not found (pass --heldout=FILE)")
    if args.copies_only:
        report = calibrate_copies(draft_dir, heldout, copy_orders_of(args), output=Path(args.output) if args.output else None)
        if args.json:
            print(json.dumps(report))
        else:
            print(f"wrote copy settings to {report['draft']}")
            _print_copies(report["copies"])
        return 0
    if args.tiny:
        from dspark_core.train.sources import tiny_target

        target = tiny_target(device, dtype)
    else:
        from dspark_core.models.loading import load_target

        target = load_target(args.target, device=device, dtype=dtype)
    report = calibrate(draft_dir, target, heldout, output=Path(args.output) if args.output else None,
                       bins=args.bins, offset=args.offset, copy_orders=copy_orders_of(args))
    if args.json:
        print(json.dumps(report))
    else:
        print(f"calibrated {report['draft']} on {report['blocks']} held-out blocks (logit offset {report['offset']:+.2f})")
        for j, (t, b, a) in enumerate(zip(report["temperatures"], report["ece_before"], report["ece_after"]), 1):
            print(f"  position {j}: T={t:.3f}  survival ECE {100 * b:.2f}% -> {100 * a:.2f}%")
        if report["copies"]:
            _print_copies(report["copies"])
    return 0
