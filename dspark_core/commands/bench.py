"""``dspark-core bench``: budget policies side by side on real prompts, with an oracle bound."""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import torch

from dspark_core.commands import positive_ints
from dspark_core.errors import ConfigError, DSparkError

NAME = "bench"
HELP = "Compare budget policies (adaptive, fixed k, none, peers) on real prompts: throughput, TPOT, acceptance."

DEFAULT_POLICIES = "adaptive,none,fixed,threshold,argmax-notier,stale-argmax,min-gain"
# Prompts per default concurrency (1, 4, 16): three waves at 4 and 16, so a cell measures that many
# requests in flight, with a refill as each ends, rather than one wave's slowest request (a wave of
# 16 MT-Bench prompts spent most of its steps with fewer than 16 running, and set the policies by
# who finishes last); four prompts at one request rather than two.
DEFAULT_PROMPTS_PER_CONCURRENCY = (4, 12, 48)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="Benchmark a running server instead of an in-process engine.")
    parser.add_argument("--model", default="smollm2", help="Target (in-process mode).")
    parser.add_argument("--draft_model", default="default", help="DSpark draft (in-process mode).")
    parser.add_argument("--num_speculative_tokens", type=int, default=7, help="Draft width K.")
    parser.add_argument("--policies", default=None,
                        help="Comma-separated budget policies; `fixed` expands to fixed k=1..K, `fixed-kN` is one width "
                             f"(in-process mode). Default: {DEFAULT_POLICIES}.")
    parser.add_argument("--policy_variants", default="{}",
                        help='JSON object of extra, labelled policies with options, run beside --policies: '
                             '{"adaptive-m0": ["adaptive", {"draft_off_margin": 0}]} (in-process mode).')
    parser.add_argument("--copy_proposals", default="auto", choices=["auto", "on", "off", "both"],
                        help="Copy proposals, as serve's flag (auto: as the draft's config says); `both` runs every "
                             "drafting policy twice, with copies and without (labelled NAME-nocopy), in one run "
                             "(in-process mode).")
    parser.add_argument("--prompts", default=None, help="JSONL prompts (`prompt` or `messages`); default MT-Bench first turns.")
    parser.add_argument("--concurrency", type=positive_ints, default=[1, 4, 16], help="Concurrency sweep.")
    parser.add_argument("--prompts_per_concurrency", type=positive_ints, default=list(DEFAULT_PROMPTS_PER_CONCURRENCY),
                        help="Prompts run at each concurrency (same order as --concurrency). Give a concurrency "
                             "a few times its own count: a cell of exactly c prompts is one wave, whose time is "
                             "its slowest request's, and most of it runs with fewer than c requests in flight.")
    parser.add_argument("--max_tokens", type=int, default=128, help="Output tokens per request (greedy).")
    parser.add_argument("--rounds", type=int, default=3,
                        help="Rounds per concurrency: each runs every policy on the same prompts, in an order "
                             "rotated per round; ratios are reported with their min/median/max over the rounds. "
                             "With --url, each round runs the prompts against the server again.")
    parser.add_argument("--calibration", default=None,
                        help="Calibration file (in-process mode). Default: `demo`, the demo calibration shipped "
                             "in the package for the width (K=5 or 7).")
    parser.add_argument("--cost_table", default=None, help="Reuse a saved cost table instead of calibrating.")
    parser.add_argument("--captured_target_rows", default="bucket_multiples", choices=["all", "bucket_multiples"],
                        help="Target-row tiers captured per request bucket, as the serve flag (in-process mode).")
    parser.add_argument("--captured_kv_spans", default="auto",
                        help="KV spans the decode keys are also captured for (as the serve flag): auto, off or a list.")
    parser.add_argument("--draft_depths", default="auto",
                        help="Tokens the draft proposes per request at each request bucket (as the serve flag): "
                             "auto, full or bucket:depth pairs such as 8:4,16:2.")
    parser.add_argument("--device", default="auto",
                        help="Device plugin of the in-process engine, as for `serve` (`auto`: cuda, then npu, then cpu).")
    parser.add_argument("--python_graph_backend", default="auto",
                        help="Graph backend of the in-process engine, as for `serve` (`auto`: the device's default).")
    parser.add_argument("--cpu_threads", type=int, default=0,
                        help="Torch intra-op threads of the in-process engine on the CPU device, as for `serve` "
                             "(0: auto, PyTorch's default of every core).")
    parser.add_argument("--max_seqs_per_batch", type=int, default=16,
                        help="Largest request bucket of the in-process engine (captured up to it; a concurrency "
                             "above it queues the rest). Raise it with a calibration file covering the new buckets.")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="Compute dtype of the in-process engine, as for `serve`.")
    parser.add_argument("--draft_dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="Draft compute dtype of the in-process engine, as for `serve`.")
    parser.add_argument("--batch_invariant", default="auto", choices=["auto", "on", "off"],
                        help="Batch-invariant target forwards of the in-process engine, as for `serve`.")
    parser.add_argument("--interleave", action="store_true",
                        help="Give every policy an engine of its own (same weights and cost table, its own KV cache: "
                             "memory grows with the policy count) and step the engines in turns, one decode step each, "
                             "so machine noise falls on all policies alike; each policy's times run on its own clock. "
                             "Without schedule overlap: it ranks policies, the default mode measures the served "
                             "setting (in-process mode).")
    parser.add_argument("--plugin", action="append", default=[], metavar="NAME_OR_MODULE",
                        help="Extra plugin (repeatable), as serve's flag: its policies can then be named in --policies "
                             "and --policy_variants (in-process mode).")
    parser.add_argument("--output_dir", default=None, help="Where to write results.json, results.md, the PNG and (in-process) cost-table.json, the table the run priced its steps with. Checked before anything runs; a directory that already holds a results.json is refused unless --overwrite. Default: benchmarks/results/bench-kK-<date>-<time>.")
    parser.add_argument("--overwrite", action="store_true", help="Replace the results an --output_dir already holds.")
    parser.add_argument("--json", action="store_true", help="Print the results as one JSON object.")


def _engine(args: argparse.Namespace, launches: list | None = None, extra_engines: int = 0):
    """The calibrated in-process engine of the bench's flags (its launch appended to ``launches``);
    with ``extra_engines``, first checks that as many more KV caches fit (``--interleave``)."""
    from dspark_core.calibration.install import bring_up
    from dspark_core.config import parse_serve_args
    from dspark_core.startup import build_engine, resolve_launch

    flags = [f"--model={args.model}", f"--draft_model={args.draft_model}",
             f"--num_speculative_tokens={args.num_speculative_tokens}", "--max_model_len=2048",
             f"--captured_target_rows={args.captured_target_rows}", f"--dtype={getattr(args, 'dtype', 'auto')}",
             f"--draft_dtype={getattr(args, 'draft_dtype', 'auto')}", f"--device={getattr(args, 'device', 'auto')}",
             f"--batch_invariant={getattr(args, 'batch_invariant', 'auto')}",
             f"--python_graph_backend={getattr(args, 'python_graph_backend', 'auto')}",
             f"--cpu_threads={getattr(args, 'cpu_threads', 0)}",
             f"--captured_kv_spans={getattr(args, 'captured_kv_spans', 'auto')}",
             f"--draft_depths={getattr(args, 'draft_depths', 'auto')}"]
    flags += [f"--plugin={name}" for name in getattr(args, "plugin", [])]
    copies = getattr(args, "copy_proposals", "auto")
    flags.append(f"--copy_proposals={'on' if copies == 'both' else copies}")
    largest = getattr(args, "max_seqs_per_batch", 16)  # the captured request buckets end there too
    flags += [f"--max_seqs_per_batch={largest}", f"--acl_graph_decode_batch_size_limit={largest}"]
    calibration = args.calibration or "demo"  # resolved from the package, whatever the working directory
    flags.append(f"--adaptive_dspark_cost_table={args.cost_table}" if args.cost_table
                 else f"--adaptive_dspark_calibration={calibration}")
    launch = resolve_launch(parse_serve_args(flags))
    if launches is not None:
        launches.append(launch)
    engine = build_engine(launch)
    if extra_engines:
        check_room_for_engines(engine, extra_engines)  # before minutes of calibration, not after
    bring_up(engine, launch, progress=not args.json)
    return engine


def interleaved_engines(engine, launch, policies: dict[str, Any], progress: bool = True) -> dict[str, Any]:
    """One engine per policy label for ``--interleave``, all without schedule overlap: ``engine`` itself
    (its queue made synchronous) for the first label, a warmed sibling sharing its weights and table
    for every other one (:func:`check_room_for_engines` says beforehand whether they fit)."""
    from tqdm import tqdm

    from dspark_core.engine.pipeline import DeviceQueue
    from dspark_core.startup import sibling_engine

    labels = list(policies)
    engine.replace_queue(DeviceQueue(overlap=False))
    engines = {labels[0]: engine}
    for label in tqdm(labels[1:], desc="engines", unit="engine", disable=not progress):
        engines[label] = sibling_engine(engine, launch, with_draft=bool(getattr(policies[label], "uses_draft", True)),
                                        overlap=False)
    return engines


def cache_bytes(engine) -> int:
    """Bytes of the engine's target KV cache (0 when its layout is not keys/values tensors)."""
    cache = engine.runner.target_cache
    return sum(int(t.nbytes) for t in (getattr(cache, "keys", None), getattr(cache, "values", None))
               if isinstance(t, torch.Tensor))


def free_bytes(device: torch.device) -> int | None:
    """Memory still free where ``device``'s tensors live (None when it cannot be read)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def check_room_for_engines(engine, extra: int) -> None:
    """Refuse ``--interleave`` before building anything when ``extra`` more KV caches of ``engine``'s size
    would not fit in the memory left (each policy past the first needs an engine of its own)."""
    each = cache_bytes(engine)
    free = free_bytes(engine.runner.target_cache.keys.device) if extra * each else None
    if free is not None and extra * each > 0.9 * free:
        gib = 2.0**30
        raise ConfigError(f"--interleave: {extra} more engines need {extra * each / gib:.1f} GiB of KV cache "
                          f"({each / gib:.1f} GiB each), {free / gib:.1f} GiB is free; "
                          "run fewer policies or lower --max_seqs_per_batch")


def parse_variants(text: str, option: str = "--policy_variants") -> dict[str, tuple[str, dict]]:
    """``{"label": ["policy", {options}]}`` -> ``{label: (policy, options)}``; a malformed value names
    the flag and the label."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{option}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f'{option}: expected a JSON object {{"label": ["policy", {{options}}]}}, got {text!r}')
    variants = {}
    for label, value in raw.items():
        if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], dict)):
            raise ConfigError(f'{option}: {label!r} must be ["policy", {{options}}], got {json.dumps(value)}')
        variants[label] = (value[0], value[1])
    return variants


def _policies(hooks, names: list[str], width: int, variants: dict[str, tuple[str, dict]] | None = None,
              option: str = "--policy_variants") -> dict[str, object]:
    """Budget policies by bench name (``fixed`` expands to fixed-k1..kK; ``fixed-kN`` is one width),
    then the labelled ``variants`` (a registered policy with options, e.g. adaptive with another margin;
    errors name ``option``, the flag they came from)."""
    policies: dict[str, object] = {}
    for name in names:
        single = re.fullmatch(r"fixed-k(\d+)", name)
        if name == "fixed":
            for k in range(1, width + 1):
                policies[f"fixed-k{k}"] = hooks.budget_policy("fixed", {"k": k})
        elif single:  # one fixed width, e.g. fixed-k1
            k = int(single.group(1))
            if not 1 <= k <= width:
                raise ConfigError(f"--policies: {name} needs 1 <= k <= K={width}")
            policies[name] = hooks.budget_policy("fixed", {"k": k})
        else:
            policies[name] = hooks.budget_policy(name, {})
    for label, (policy, options) in (variants or {}).items():
        if label in policies:
            raise ConfigError(f"{option}: label {label!r} is already a policy of this run; choose another")
        try:
            policies[label] = hooks.budget_policy(policy, options)
        except DSparkError as exc:
            raise ConfigError(f"{option}: {label!r}: {exc}") from None
    return policies


def with_and_without_copies(policies: dict[str, object]) -> dict[str, bool]:
    """Add a ``NAME-nocopy`` twin (its own copy of the policy) after every drafting policy, in place;
    returns whether each label proposes with copies."""
    copies: dict[str, bool] = {}
    for name, policy in list(policies.items()):
        copies[name] = bool(getattr(policy, "uses_draft", True))
        if copies[name]:
            twin = f"{name}-nocopy"
            if twin in policies:
                raise ConfigError(f"--copy_proposals=both: label {twin!r} is already a policy of this run")
            policies[twin], copies[twin] = copy.deepcopy(policy), False
    return copies


def _prompts(path: str | None) -> list:
    from dspark_core.train.data import mtbench_first_turns

    if path:
        from dspark_core.prompts import read_prompts_jsonl

        return read_prompts_jsonl(path)
    return [[{"role": "user", "content": q}] for q in mtbench_first_turns()]


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from dspark_core.bench.plots import plot
    from dspark_core.bench.report import add_ratios, exactness, markdown, summarize
    from dspark_core.bench.run import run_benchmark

    if len(args.prompts_per_concurrency) != len(args.concurrency):
        raise ConfigError("--prompts_per_concurrency needs one value per --concurrency value")
    for concurrency, count in zip(args.concurrency, args.prompts_per_concurrency):
        if count < concurrency:
            raise ConfigError(f"--prompts_per_concurrency: {count} prompts never reach concurrency {concurrency}; "
                              f"give it at least {concurrency} (a few times that measures it best)")
    if args.rounds < 1:
        raise ConfigError("--rounds must be at least 1")
    if args.max_tokens < 1:
        raise ConfigError(f"--max_tokens must be at least 1, got {args.max_tokens}")
    width = args.num_speculative_tokens
    out = output_dir(args.output_dir or f"benchmarks/results/bench-k{width}-{time.strftime('%Y%m%d-%H%M%S')}",
                     overwrite=args.overwrite)  # before minutes of work, not after them
    prompts = _prompts(args.prompts)
    interleave = bool(getattr(args, "interleave", False))
    started = time.perf_counter()
    priced_by = None  # the cost table the in-process engine served with
    if args.url:
        from dspark_core.bench.client import run_against_server

        if parse_variants(args.policy_variants):
            raise ConfigError("--policy_variants needs the in-process engine; a server runs its own policy (drop --url)")
        if args.copy_proposals != "auto":
            raise ConfigError("--copy_proposals needs the in-process engine; a server proposes as it was launched (drop --url)")
        if interleave:
            raise ConfigError("--interleave needs the in-process engine; a server runs one policy (drop --url)")
        if args.policies is not None:
            raise ConfigError("--policies needs the in-process engine; a server runs the policy it was launched with (drop --url)")
        cells = run_against_server(args.url, prompts, args.concurrency, args.prompts_per_concurrency, args.max_tokens,
                                   rounds=args.rounds, progress=not args.json)
    else:
        from dspark_core.plugins import load_hooks

        if args.policies is None:  # (results.json records what ran; an empty list runs the variants alone)
            args.policies = DEFAULT_POLICIES
        names = [n.strip() for n in args.policies.split(",") if n.strip()]
        variants = parse_variants(args.policy_variants)
        if not names and not variants:
            raise ConfigError(f"--policies: no policy named in {args.policies!r}")
        # a typo fails now, not after the calibration
        preview = _policies(load_hooks(getattr(args, "plugin", [])), names, width, variants)
        if args.copy_proposals == "both":
            with_and_without_copies(preview)  # adds the twins in place, so the memory check counts them
        launches: list = []
        engine = _engine(args, launches, extra_engines=len(preview) - 1 if interleave else 0)
        policies = _policies(engine.hooks, names, width, variants)
        copies = with_and_without_copies(policies) if args.copy_proposals == "both" else None
        warmup = engine.hooks.budget_policy("none", {})
        if interleave:
            from dspark_core.bench.interleave import run_interleaved

            engines = interleaved_engines(engine, launches[0], policies, progress=not args.json)
            # a round lasts minutes: the bar counts finished requests of every policy
            requests = sum(min(count, len(prompts)) for count in args.prompts_per_concurrency)
            bar = tqdm(total=args.rounds * requests * len(policies), desc="bench", unit="request", disable=args.json)
            cells = run_interleaved(engines, policies, prompts, args.concurrency, args.prompts_per_concurrency,
                                    args.max_tokens, args.rounds, progress=bar.set_postfix_str,
                                    warmup=warmup, copies=copies, finished=bar.update)
            for other in engines.values():
                other.close()
        else:
            total = len(policies) * args.rounds * len(args.concurrency)
            bar = tqdm(total=total, desc="bench", unit="run", disable=args.json)
            cells = run_benchmark(engine, policies, prompts, args.concurrency, args.prompts_per_concurrency,
                                  args.max_tokens, args.rounds, progress=lambda msg: _advance(bar, msg),
                                  warmup=warmup, copies=copies)
        bar.close()
        engine.close()
        priced_by = engine.table
    rows = [summarize(c, f"fixed-k{width}") for c in cells]
    add_ratios(rows, width)
    result: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if not k.startswith("_")},
              "seconds": round(time.perf_counter() - started, 1), "exactness": exactness(cells), "results": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    table = markdown(rows)
    mode = ("\nInterleaved: one engine per policy, stepping in turns, without schedule overlap; each policy's "
            "times on its own clock.\n" if interleave else "")
    (out / "results.md").write_text(f"# dspark-core bench (K={width})\n{mode}\n{table}\nExactness: {result['exactness']}\n")
    plot(rows, out / "throughput_tpot.png", f"dspark-core bench, K={width}")
    if priced_by is not None:
        from dspark_core.table import dumps_table

        # the prices every adaptive decision of this run read: `dspark-core table show` it, or serve
        # with it (--adaptive_dspark_cost_table) to replay the run's pricing
        (out / "cost-table.json").write_text(dumps_table(priced_by))
    if args.json:
        print(json.dumps(result, default=str))
    else:
        print(table)
        print(f"exactness: {'all policies identical' if result['exactness']['identical'] else result['exactness']}")
        print(f"written to {out}/")
    return 0 if result["exactness"]["identical"] else 1


def output_dir(path: str, *, overwrite: bool = False) -> Path:
    """The bench's output directory, checked before any work so a run never ends unable to write its
    results: it (or the closest folder above it that exists) must be a writable directory, and one that
    holds an earlier run's results is refused unless ``overwrite``. Nothing is created here."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output_dir: {path} exists and is not a directory")
    if (out / "results.json").exists() and not overwrite:
        raise ConfigError(f"--output_dir: {path} already holds a run's results (results.json); choose another "
                          "directory or pass --overwrite")
    existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"--output_dir: cannot create {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--output_dir: cannot write under {existing}")
    return out


def _advance(bar: Any, message: str) -> None:
    """One finished benchmark run on the progress bar."""
    bar.set_postfix_str(message)
    bar.update()
