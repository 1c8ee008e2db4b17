"""Human views of a cost table: the text summary and the measured-vs-fitted plot."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from dspark_core.convert import unstructure
from dspark_core.costs.bundle import CostTable, IntervalFit
from dspark_core.errors import TableError

PER_LINE = 8


def _points(fit: IntervalFit, draft_width: int) -> Iterator[tuple[str, list[tuple[int, float]]]]:
    """(label, [(rows, ms), ...]) per covered bucket, in bucket order."""
    coverage = fit.coverage
    if coverage.any_bucket is not None:
        lo, hi = coverage.any_bucket
        # Any legal bucket gives the same answer; the smallest legal one is ceil(G / (K + 1)).
        rows = [(g, fit.cost.predict_seconds(-(-g // (draft_width + 1)), g)) for g in range(lo, hi + 1)]
        yield "any bucket", [(g, s * 1000) for g, s in rows if s is not None]
        return
    for span in coverage.spans:
        rows = [(g, fit.cost.predict_seconds(span.request_bucket, g)) for g in range(span.min_rows, span.max_rows + 1)]
        yield f"bucket {span.request_bucket}", [(g, s * 1000) for g, s in rows if s is not None]


def describe_table(table: CostTable) -> list[str]:
    """Lines for ``table show``: identity, fingerprint, settings, coverage and the cost grid."""
    lines = [
        f"cost table  {table.source}",
        f"format      {table.origin}" + ("" if table.is_bundle else " (no fingerprint: only the width can be checked)"),
        f"model       {table.model}",
        f"draft_width {table.draft_width}" + (" (assumed: legacy file without draft_width)" if table.width_assumed else ""),
    ]
    if table.provenance is not None:
        p = table.provenance
        lines.append(f"created     {p.created_utc} by dspark-core {p.dspark_core_version} on {p.host}")
    if table.fingerprint is not None:
        lines.append("fingerprint")
        lines += [f"  {key}: {json.dumps(value)}" for key, value in _flat(unstructure(table.fingerprint))]
    if table.settings is not None:
        lines.append("calibration")
        lines += [f"  {key}: {json.dumps(value)}" for key, value in unstructure(table.settings).items()]
    for index, fit in enumerate(table.fits):
        where = "every KV length" if fit.context is None else fit.context.describe()
        lines.append(f"interval {index}: {where}; {len(fit.measurements)} measured point(s)")
        lines.append("  predicted full-step cost, ms, by target rows G:")
        for label, points in _points(fit, table.draft_width):
            cells = [f"G={g}: {ms:.3f}" for g, ms in points]
            for start in range(0, len(cells), PER_LINE):
                head = f"    {label:<11}" if start == 0 else " " * 15
                lines.append(head + "  ".join(cells[start : start + PER_LINE]))
        off = _draft_off_points(fit)
        if off:
            lines.append("  predicted draft-off step cost, ms (no draft, one row per request):")
            lines.append("    " + "  ".join(f"bucket {b}: {ms:.3f}" for b, ms in off))
        else:
            lines.append("  no draft-off cost: the adaptive policy always runs the draft with this table")
    return lines


def _draft_off_points(fit: IntervalFit) -> list[tuple[int, float]]:
    """(bucket, ms) of every bucket with a draft-off cost."""
    predict = getattr(fit.cost, "predict_draft_off_seconds", None)  # optional for third-party fits
    if predict is None:
        return []
    points = [(b, predict(b)) for b in fit.coverage.draft_off_buckets]
    return [(b, s * 1000) for b, s in points if s is not None]


def _flat(value: object, prefix: str = "") -> list[tuple[str, object]]:
    if isinstance(value, dict):
        out: list[tuple[str, object]] = []
        for key, item in value.items():
            out += _flat(item, f"{prefix}.{key}" if prefix else key)
        return out
    return [(prefix, json.loads(json.dumps(value)))]


def plot_table(table: CostTable, output: str | Path) -> Path:
    """Plot measured points against the fitted surface, one panel per KV interval."""
    if not any(fit.measurements for fit in table.fits):
        raise TableError(
            f"{table.source} has no measured points ({table.origin} table); only bundles written by calibration can be plotted"
        )
    out = Path(output)
    if not out.parent.is_dir():
        raise TableError(f"plot output directory {out.parent} does not exist")
    if out.is_dir():
        raise TableError(f"plot output {out} is a directory; name the image file (e.g. {out / 'costs.png'})")
    import matplotlib
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if out.suffix.lstrip(".").lower() not in formats:
        raise TableError(f"plot output {out}: the file name must end in an image type matplotlib writes "
                         f"({', '.join('.' + f for f in sorted(formats))})")
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(table.fits), figsize=(6 * len(table.fits), 4.5), squeeze=False)
    for ax, fit in zip(axes[0], table.fits):
        colours = {}
        for label, points in _points(fit, table.draft_width):
            (line,) = ax.plot([g for g, _ in points], [ms for _, ms in points], label=f"{label} fit")
            colours[label] = line.get_color()
        labelled: set[bool] = set()
        for m in fit.measurements:
            colour = colours.get(f"bucket {m.request_bucket}", "black")
            point_label = None if m.draft_off in labelled else ("measured, draft off" if m.draft_off else "measured")
            labelled.add(m.draft_off)
            ax.scatter([m.target_rows], [m.step_seconds * 1000], color=colour, s=28 if m.draft_off else 14,
                       marker="x" if m.draft_off else "o", zorder=3, label=point_label)
        title = "every KV length" if fit.context is None else fit.context.describe()
        ax.set(title=f"{table.model}, K={table.draft_width}: {title}", xlabel="target rows G", ylabel="full-step ms")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out

