"""Plot held-out τ against answer tokens seen for several `train-draft` runs.

    python benchmarks/plot_draft_curves.py --output benchmarks/results/draft-v4/tau-vs-data.png \
        "A: scratch, 7000 ShareGPT + 768 on-policy=benchmarks/results/draft-v2/curve-run-a.jsonl:1.907" \
        "B: scratch, 2560 + 2560=benchmarks/results/draft-v2/curve-run-b.jsonl:1.630" \
        "C: first stage fine-tuned on B's data=benchmarks/results/draft-v2/curve-run-c.jsonl" \
        "D: C fine-tuned, 3840 + 3840=benchmarks/results/draft-v3/curve-run-d.jsonl:1.596" \
        "E: D's data again, from D=benchmarks/results/draft-v4/curve-run-e.jsonl:1.741" \
        "F: E fine-tuned, 6400 + 6400=benchmarks/results/draft-v4/curve-run-f.jsonl:1.866"

(the command that drew ``benchmarks/results/draft-v4/tau-vs-data.png``; the
``draft-v3`` plot is the same command without E and F).

With ``--chain`` the runs are stages of one draft (each fine-tunes the one
before), and each curve starts where the previous one ends on the token axis.

Each argument is ``LABEL=CURVE.jsonl[:BASELINE]``: a run's ``curve.jsonl``
and, optionally, the τ its starting or shipped draft measured on the same
held-out blocks (drawn as a dotted line in the run's colour). Every run has
its own held-out set, so compare a curve with its own baseline, not with the
other curves.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_curve(path: Path) -> tuple[list[float], list[float]]:
    """(answer tokens seen in millions, held-out τ) of one ``curve.jsonl``."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["answer_tokens_seen"] / 1e6 for r in rows], [r["heldout_tau"] for r in rows]


def split_baseline(rest: str) -> tuple[str, float | None]:
    """``CURVE.jsonl[:BASELINE_TAU]`` -> (path, baseline); a colon not followed by a number is part of the path."""
    path, sep, tail = rest.rpartition(":")
    if sep:
        try:
            return path, float(tail)
        except ValueError:
            pass
    return rest, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="LABEL=CURVE.jsonl[:BASELINE_TAU]")
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--chain", action="store_true",
                        help="Each run fine-tunes the previous run's draft: its tokens continue from where that run ends.")
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    start = 0.0
    for i, spec in enumerate(args.runs):
        label, _, rest = spec.partition("=")
        path, baseline = split_baseline(rest)
        if not label or not path:
            parser.error(f"run {spec!r}: expected LABEL=CURVE.jsonl[:BASELINE_TAU]")
        if not Path(path).is_file():
            parser.error(f"run {spec!r}: curve file {path} not found")
        xs, ys = read_curve(Path(path))
        xs = [start + x for x in xs]
        if args.chain and xs:
            start = xs[-1]
        color = f"C{i}"
        ax.plot(xs, ys, marker="o", ms=3, color=color, label=label)
        if baseline is not None:
            ax.axhline(baseline, color=color, ls=":", lw=1)
    ax.set_xlabel("answer tokens seen in training (millions)")
    ax.set_ylabel("held-out τ at K = 7 (teacher forced)")
    ax.set_title("Draft training runs; dotted: the draft each run was compared with")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
