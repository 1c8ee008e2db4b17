"""An eager verify step with and without its tier's padding rows, side by side in one process.

A step's tier has one anchor per bucket entry plus its drafted rows; rows no live request uses
(empty bucket entries, drafted rows nobody can spend) sit on the scratch slot. Captured forwards
need them (static shapes); since 2026-12-07 an eager forward leaves them out. This script runs
every policy twice: once with the verify function of an earlier revision (``--before``, read with
``git show``; labels ``@padded``) and once with the current one (``@live``), the engines taking
turns one ``step()`` at a time. Outputs must be identical.

    python benchmarks/padding_rows.py --before 118ec90 --prompts /tmp/sharegpt-heldout.jsonl --limit 36 \\
        --concurrency 12 --table benchmarks/results/amx/k7/cost-table.json --draft_depths 4:4,8:4,16:2
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import types
from pathlib import Path

from common import decode_in_turns, paired_rows, set_threads, write_results
from key_tails import pair_arguments, paired_engines

from dspark_core.prompts import read_prompts_jsonl


def runner_at(revision: str) -> types.ModuleType:
    """``dspark_core/engine/runner.py`` as it was at ``revision``, imported under another name."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "show", f"{revision}:dspark_core/engine/runner.py"], cwd=root, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "runner_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("runner_before", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["runner_before"] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def main() -> None:
    parser = pair_arguments(__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="A git revision whose eager verify forwarded the padding rows.")
    args = parser.parse_args()
    set_threads(args.threads)
    before = runner_at(args.before)
    engines = paired_engines(args, ("padded", "live"))
    for label, engine in engines.items():
        if label.endswith("@padded"):
            engine.runner._verify_fn = types.MethodType(before.ModelRunner._verify_fn, engine.runner)
    prompts = read_prompts_jsonl(args.prompts)[: args.limit]
    outputs, seconds = decode_in_turns(engines, prompts, args.concurrency, args.max_tokens)
    results = paired_rows(outputs, seconds, "padded", "none@padded")
    write_results(args.output, "padding_rows.py", {
        "before": args.before, "prompts": args.prompts, "count": len(prompts), "concurrency": args.concurrency,
        "max_tokens": args.max_tokens, "table": args.table, "draft_depths": args.draft_depths, "threads": args.threads},
        results)


if __name__ == "__main__":
    main()
