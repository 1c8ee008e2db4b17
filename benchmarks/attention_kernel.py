"""The batch-invariant attention kernel alone: one layer of SmolLM2-shaped attention in row bands.

Times :func:`dspark_core.models.row_bands.banded_attention` for verify-step shapes (rows per request,
even and uneven) at several context lengths, with the keys read as the target reads them
(:func:`~dspark_core.models.attention.invariant_kv_length`). No model is loaded: queries, keys and
values are random, so this isolates the kernel from the rest of the step, and a run takes seconds.

``--compare_tree PATH`` times another checkout's kernel in the same process, interleaved shape by
shape and round by round, which is how a kernel change is judged on a noisy shared CPU (separate
processes moved by 20 % between runs here). A tree from before commit 556112d has the older
kernel (one product per 128-key chunk over position-last keys); its keys are passed transposed
and read in 128-key chunks, as its target read them.

    python benchmarks/attention_kernel.py --contexts 100,250,400,900 --requests 16
    python benchmarks/attention_kernel.py --compare_tree /tmp/old-checkout --output attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch
from common import set_threads, write_results

from dspark_core.models import attention, row_bands

# rows per request of a verify step at 16 requests: even widths and adaptive-like uneven splits
DEFAULT_SHAPES = {"1x16": [1] * 16, "2x16": [2] * 16, "3x16": [3] * 16,
                  "uneven32": [1] * 12 + [5] * 4, "uneven48": [2] * 10 + [3] * 3 + [6] * 2 + [7]}


def load_tree(root: Path) -> tuple[types.ModuleType, types.ModuleType]:
    """Another checkout's attention module (``attention``, or ``layers`` in a tree from before the two
    were split) and ``row_bands`` as modules of their own (its row bands importing its own attention
    module), beside this checkout's."""
    def load(name: str, path: Path, renames: dict[str, str]) -> types.ModuleType:
        source = path.read_text()
        for old, new in renames.items():
            source = source.replace(old, new)
        module = types.ModuleType(name)
        sys.modules[name] = module
        exec(compile(source, str(path), "exec"), module.__dict__)
        return module

    models = root / "dspark_core" / "models"
    name = "attention" if (models / "attention.py").exists() else "layers"
    other_attention = load("compared_attention", models / f"{name}.py", {})
    other_bands = load("compared_row_bands", models / "row_bands.py", {f"dspark_core.models.{name}": "compared_attention"})
    return other_attention, other_bands


def kernel_call(layer_mod, bands_mod, counts: list[int], context: int, keys: torch.Tensor, values: torch.Tensor,
                generator: torch.Generator):
    """A closure running one layer's banded attention for ``counts`` rows per request, request b
    starting at position ``context + 7 b``."""
    requests, kv_heads, cache_length, head_dim = keys.shape
    groups = 3
    rows = max(counts)
    positions = torch.tensor([context + 7 * b for b in range(requests)])[:, None] + torch.arange(rows)[None]
    needed = int(positions.max()) + 1
    chunked = hasattr(layer_mod, "KEY_CHUNK")  # the kernel before 556112d: transposed keys, 128-key chunks
    length = min(-(-needed // 128) * 128, cache_length) if chunked else layer_mod.invariant_kv_length(needed, cache_length)
    causal = torch.arange(length)[None, None, None, :] <= positions[:, None, :, None]
    bands = bands_mod.plan_bands(causal, counts, groups, torch.float32, (positions.amax(1) + 1).tolist())
    q = torch.randn(requests, rows, kv_heads * groups, head_dim, generator=generator)
    layer_keys = keys[:, :, :length].transpose(-1, -2).contiguous() if chunked else keys[:, :, :length]
    return lambda: bands_mod.banded_attention(q, layer_keys, values[:, :, :length], bands)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="100,250,400,900", help="First query positions (comma-separated).")
    parser.add_argument("--requests", type=int, default=16, help="Requests per step (the default shapes need 16).")
    parser.add_argument("--shapes", default=None, help="JSON {name: [rows per request]}; default: even and uneven 16-request steps.")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=20, help="Timed calls per shape and round (after 3 untimed).")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compare_tree", default=None, help="Another checkout whose kernel runs beside this one.")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    set_threads(args.threads)
    shapes = json.loads(args.shapes) if args.shapes else (
        DEFAULT_SHAPES if args.requests == 16 else {f"{r}x{args.requests}": [r] * args.requests for r in (1, 2, 4, 8)})
    bad = [name for name, counts in shapes.items() if len(counts) != args.requests or min(counts) < 1]
    if bad:
        parser.error(f"--shapes {bad}: each needs {args.requests} positive row counts (--requests)")
    kernels = {"this": (attention, row_bands)}
    if args.compare_tree:
        kernels["compared"] = load_tree(Path(args.compare_tree))
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(args.requests, 3, 2048, 64, generator=generator) for _ in range(2))
    results = []
    for context in (int(c) for c in args.contexts.split(",")):
        for name, counts in shapes.items():
            times: dict[str, list[float]] = {label: [] for label in kernels}
            outputs = {label: kernel_call(*kernels[label], counts, context, keys, values,
                                          torch.Generator().manual_seed(1))() for label in kernels}
            for round_index in range(args.rounds):
                order = list(kernels) if round_index % 2 == 0 else list(reversed(kernels))
                for label in order:
                    call = kernel_call(*kernels[label], counts, context, keys, values, generator)
                    for _ in range(3):
                        call()
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        call()
                    times[label].append((time.perf_counter() - start) / args.calls * 1e6)
            row = {"context": context, "shape": name, **{f"{label}_us": round(statistics.median(t), 1) for label, t in times.items()}}
            if "compared" in times:
                row["this_vs_compared"] = round(row["this_us"] / row["compared_us"], 3)
                # the same attention either way: the largest difference over the requests' real rows
                row["max_abs_diff"] = max(float((outputs["this"][b, :c] - outputs["compared"][b, :c]).abs().max())
                                          for b, c in enumerate(counts))
            print(row)
            results.append(row)
    write_results(args.output, "attention_kernel.py", {"requests": args.requests, "rounds": args.rounds,
                                                       "threads": args.threads, "compare_tree": args.compare_tree}, results)


if __name__ == "__main__":
    main()
