"""Decode-step time and its breakdown on the serving engine, for a device sitting (issue 17).

Builds the engine as `dspark-core bench` does (same flags: device, dtype, calibration or a saved
cost table), then for every (policy, concurrency) pair keeps ``concurrency`` requests of the
given prompts decoding with ``ignore_eos`` and times ``--steps`` steady-state steps (wall time per
``step()`` with schedule overlap on, after ``--warmup`` untimed ones). The first pair is also run
under the torch profiler, without overlap so that the host side of each step is recorded too; its
operator table (sorted by device time where there is one) is written beside the JSON.

    python benchmarks/h200/step_profile.py --device cuda --cost_table OUT/bench-k7/cost-table.json \\
        --prompts_file mtbench.jsonl --pairs none:1,fixed-k7:16,adaptive:16 --output OUT/step-profile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dspark_core.commands.bench import _engine, _policies
from dspark_core.engine.pipeline import DeviceQueue
from dspark_core.engine.request import SamplingParams
from dspark_core.geometry import kv_reserve
from dspark_core.models.attention import ATTENTION_KERNELS, set_attention_kernel
from dspark_core.prompts import read_prompts_jsonl


def pairs_arg(text: str) -> list[tuple[str, int]]:
    """``policy:concurrency,...`` -> [(policy, concurrency)]."""
    out = []
    for item in text.split(","):
        name, _, count = item.partition(":")
        if not name or not count.isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(f"expected policy:concurrency items, got {item!r}")
        out.append((name, int(count)))
    return out


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_steps(engine, prompts, concurrency: int, warmup: int, steps: int) -> list[float]:
    """Wall seconds of ``steps`` steady-state ``step()`` calls with ``concurrency`` live requests."""
    room = engine.max_model_len - max(len(engine.encode(p)) for p in prompts[:concurrency]) - kv_reserve(engine.config.draft_width)
    params = SamplingParams(max_tokens=max(1, room), ignore_eos=True)
    requests = [engine.add_request(prompts[i % len(prompts)], params) for i in range(concurrency)]
    durations = []
    try:
        for i in range(warmup + steps):
            started = time.perf_counter()
            engine.step()
            if i >= warmup:
                durations.append(time.perf_counter() - started)
            if any(r.finish_reason is not None for r in requests):
                break  # out of room: what was timed so far stands
    finally:
        for request in requests:
            engine.cancel(request)
        while engine.has_work:  # process what is still in flight, so the next pair starts clean
            engine.step()
    return durations


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--draft_model", default="default")
    parser.add_argument("--num_speculative_tokens", type=int, default=7)
    parser.add_argument("--calibration", default=None, help="Calibration file (default: the packaged demo file).")
    parser.add_argument("--cost_table", default=None, help="A saved cost table (skips calibration).")
    parser.add_argument("--max_seqs_per_batch", type=int, default=16)
    parser.add_argument("--prompts_file", required=True, help="JSONL prompts (`prompt` or `messages`).")
    parser.add_argument("--pairs", type=pairs_arg, default=pairs_arg("none:1,fixed-k7:16,none:16,adaptive:16"),
                        help="policy:concurrency pairs to time; the first is also profiled.")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--attention", default="auto", choices=ATTENTION_KERNELS,
                        help="Attention kernel for the whole run (attention.set_attention_kernel); captured graphs keep it.")
    parser.add_argument("--captured_kv_spans", default="auto", help="As the serve flag: auto, off or a list of spans.")
    parser.add_argument("--output", required=True, help="JSON results; the profiler table goes beside it (.txt).")
    args = parser.parse_args()
    set_attention_kernel(args.attention)
    if max(c for _, c in args.pairs) > args.max_seqs_per_batch:
        parser.error(f"--pairs: a concurrency above --max_seqs_per_batch={args.max_seqs_per_batch} would queue requests")
    prompts = read_prompts_jsonl(args.prompts_file)
    build_started = time.perf_counter()
    engine = _engine(argparse.Namespace(
        model=args.model, draft_model=args.draft_model, num_speculative_tokens=args.num_speculative_tokens,
        captured_target_rows="bucket_multiples", calibration=args.calibration, cost_table=args.cost_table,
        dtype=args.dtype, draft_dtype="auto", device=args.device, python_graph_backend="auto",
        max_seqs_per_batch=args.max_seqs_per_batch, captured_kv_spans=args.captured_kv_spans, json=True))
    device = str(engine.runner.device)
    # what warmup (calibration, one private memory pool per captured graph) cost, for sizing sittings
    built = {"engine_build_seconds": round(time.perf_counter() - build_started, 1)}
    if device.startswith("cuda"):
        built["cuda_memory_reserved_gib"] = round(torch.cuda.memory_reserved() / 2**30, 2)
        built["cuda_max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print(built, file=sys.stderr, flush=True)
    policies = _policies(engine.hooks, sorted({name for name, _ in args.pairs}), args.num_speculative_tokens)
    results = []
    for index, (name, concurrency) in enumerate(args.pairs):
        with engine.use_policy(policies[name]):
            durations = time_steps(engine, prompts, concurrency, args.warmup, args.steps)
            if index == 0:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if device.startswith("cuda"):
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                # device work inline on this thread while profiling: the profiler does not see the
                # overlap executor's thread, where the host side of every step would otherwise run
                engine.replace_queue(DeviceQueue(False))
                try:
                    with torch.profiler.profile(activities=activities) as prof:
                        time_steps(engine, prompts, concurrency, 2, min(args.steps, 20))
                        synchronize(device)
                finally:
                    engine.replace_queue(DeviceQueue(engine.config.schedule_overlap))
                sort = "cuda_time_total" if device.startswith("cuda") else "cpu_time_total"
                Path(args.output).with_suffix(".txt").write_text(
                    prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=70))
        row = {"policy": name, "concurrency": concurrency, "steps": len(durations),
               "step_ms_median": round(1e3 * statistics.median(durations), 3) if durations else None,
               "step_ms_mean": round(1e3 * statistics.mean(durations), 3) if durations else None}
        results.append(row)
        print(row, file=sys.stderr, flush=True)
    engine.close()
    meta = {"device": device, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
            "dtype": args.dtype, "attention": args.attention, "captured_kv_spans": args.captured_kv_spans,
            "kv_spans": list(engine.runner.kv_spans),
            "keys": len(engine.runner.graphs.keys) if engine.runner.graphs is not None else 0, **built,
            "command": " ".join(sys.argv)}
    Path(args.output).write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
