"""benchmarks/plot_draft_curves.py: held-out curves of train-draft runs to one PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "plot_draft_curves.py"


def write_curve(path: Path, taus: list[float]) -> Path:
    rows = [{"step": 100 * i, "answer_tokens_seen": 90_000 * i, "heldout_tau": t} for i, t in enumerate(taus)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_plots_runs_with_and_without_baselines(tmp_path):
    a = write_curve(tmp_path / "a.jsonl", [1.0, 1.2, 1.3])
    b = write_curve(tmp_path / "b.jsonl", [1.6, 1.7])
    out = tmp_path / "plots" / "tau.png"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--output", str(out), f"A, from scratch={a}:1.9", f"B={b}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 5_000  # a drawn figure, not an empty canvas


@pytest.mark.filterwarnings("ignore:No artists with labels")  # plot() is replaced by a recorder here
def test_chained_runs_continue_on_the_token_axis(tmp_path, monkeypatch):
    from script_support import load_script

    module = load_script("plot_draft_curves")
    drawn = []
    import matplotlib.axes

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, xs, ys, **kw: drawn.append(list(xs)))
    a = write_curve(tmp_path / "a.jsonl", [1.0, 1.2, 1.3])
    b = write_curve(tmp_path / "b.jsonl", [1.3, 1.4])
    assert module.main(["--output", str(tmp_path / "c.png"), "--chain", f"A={a}", f"B={b}"]) == 0
    assert drawn == [[0.0, 0.09, 0.18], [0.18, 0.27]]  # millions of tokens; B starts where A ends
    drawn.clear()
    assert module.main(["--output", str(tmp_path / "d.png"), f"A={a}", f"B={b}"]) == 0
    assert drawn == [[0.0, 0.09, 0.18], [0.0, 0.09]]


def test_a_run_without_a_curve_file_is_refused_by_name(tmp_path):
    out = tmp_path / "tau.png"
    for spec, words in (("just-a-label", "LABEL=CURVE.jsonl"), (f"A={tmp_path / 'missing.jsonl'}:1.5", "missing.jsonl not found")):
        proc = subprocess.run([sys.executable, str(SCRIPT), "--output", str(out), spec],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2
        assert spec in proc.stderr and words in proc.stderr
    assert not out.exists()


def test_a_colon_is_read_as_a_baseline_only_when_a_number_follows():
    from script_support import load_script

    module = load_script("plot_draft_curves")
    assert module.split_baseline("runs/a.jsonl:1.63") == ("runs/a.jsonl", 1.63)
    assert module.split_baseline("runs/a.jsonl") == ("runs/a.jsonl", None)
    assert module.split_baseline("C:/runs/a.jsonl") == ("C:/runs/a.jsonl", None)
    assert module.split_baseline("C:/runs/a.jsonl:2") == ("C:/runs/a.jsonl", 2.0)
