"""Shared setup for the benchmark scripts: SmolLM2 + the shipped draft, MT-Bench prompts."""

from __future__ import annotations

import torch

from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.geometry import Geometry


def load_models(draft_path: str | None = "default", draft_dtype: torch.dtype | None = None,
                target_dtype: torch.dtype = torch.float32):
    """The real default target (in ``target_dtype``) and a draft (the shipped one unless a directory is
    given, none for ``None``; float32 unless ``draft_dtype`` says otherwise)."""
    from dspark_core.models.loading import load_target

    return load_target("smollm2", dtype=target_dtype), None if draft_path is None else load_draft_model(draft_path, draft_dtype)


def load_draft_model(draft_path: str = "default", draft_dtype: torch.dtype | None = None):
    """A fresh draft instance. Engines that run side by side each need their own: a draft holds the
    context (its KV cache) of the last engine built with it, so two engines sharing one overwrite
    each other's draft context and propose from the wrong one (still exact, but less accepted)."""
    from dspark_core.models.drafts import resolve_draft_path
    from dspark_core.models.speculators_io import load_draft

    draft_path = resolve_draft_path(draft_path, "smollm2")
    return load_draft(draft_path) if draft_dtype is None else load_draft(draft_path, dtype=draft_dtype)


def add_draft_dtype_argument(parser) -> None:
    """The scripts' ``--draft_dtype``; resolve it with :func:`cpu_draft_dtype` after parsing."""
    parser.add_argument("--draft_dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="`auto`: the CPU device's draft default (bfloat16 only with native bfloat16 products).")


def cpu_draft_dtype(name: str) -> str:
    """``auto`` → what the CPU device gives the draft by default (bfloat16 where the CPU multiplies it
    natively, else float32), so a script measures the dtype serving would use; other names pass through."""
    if name != "auto":
        return name
    from dspark_plugins.devices.cpu import native_bfloat16

    return "bfloat16" if native_bfloat16() else "float32"


def mtbench_chats(count: int) -> list:
    from dspark_core.train.data import mtbench_first_turns

    return [[{"role": "user", "content": q}] for q in mtbench_first_turns()[:count]]


def make_engine(target, draft, *, width: int = 7, policy: str = "adaptive", overlap: bool = True,
                buckets=(1, 2, 4, 8, 16), table=None, policy_options=None, max_model_len: int = 1024,
                tiers: str = "bucket_multiples", draft_depths: str = "full") -> Engine:
    """An engine on the real target; ``tiers`` names the captured target-row tiers (a Geometry constructor:
    ``bucket_multiples`` as ``make serve`` captures, or ``all_tiers``), ``draft_depths`` the tokens the draft
    proposes per bucket (``full`` or ``bucket:depth`` pairs, as ``--draft_depths``)."""
    from dspark_core.resolve import parse_draft_depths

    geometry = getattr(Geometry, tiers)(width, buckets)
    engine = Engine(target, draft, EngineConfig(draft_width=width, policy=policy, policy_options=policy_options or {},
                                                request_buckets=buckets, max_model_len=max_model_len,
                                                schedule_overlap=overlap,
                                                draft_depths=tuple(parse_draft_depths(draft_depths, buckets, width).items())),
                    geometry=geometry)
    if table is not None:
        engine.install_table(table)
    return engine


def policy_specs(widths, table_given: bool = False, variants: dict | None = None) -> dict[str, tuple[str, dict]]:
    """Label -> (policy, options) for side-by-side scripts: target-only, fixed k per width, and ``adaptive``
    plus ``variants`` when a cost table prices them."""
    specs = {"none": ("none", {}), **{f"fixed-k{k}": ("fixed", {"k": k}) for k in widths}}
    if variants and not table_given:
        raise SystemExit("--variants need --table: an adaptive policy prices its steps with a cost table")
    if table_given:
        specs["adaptive"] = ("adaptive", {})
        specs.update({label: (policy, dict(options)) for label, (policy, options) in (variants or {}).items()})
    return specs


def side_by_side_engines(target, specs: dict[str, tuple[str, dict]], *, table_path: str | None,
                         draft_dtype: torch.dtype, on_draft=None, label_tables: dict[str, str] | None = None,
                         label_depths: dict[str, str] | None = None, **engine_kwargs) -> dict[str, Engine]:
    """One engine per policy of ``specs``, without schedule overlap (a step ends inside its own call), priced
    by the table at ``table_path`` (or, for a label of ``label_tables``, by the table at its path); every
    drafting engine gets a draft of its own, since a draft instance holds the context cache of the engine
    last bound to it. ``on_draft(draft)`` sees each new draft. ``label_depths`` gives a label's engine its
    own ``draft_depths`` (the rest get ``engine_kwargs``' or ``full``)."""
    from dspark_core.table import load_table

    table = load_table(table_path) if table_path else None
    engines = {}
    for label, (policy, options) in specs.items():
        draft = None if policy == "none" else load_draft_model(draft_dtype=draft_dtype)
        if draft is not None and on_draft is not None:
            on_draft(draft)
        own_table = load_table(label_tables[label]) if label_tables and label in label_tables else table
        kwargs = dict(engine_kwargs)
        if label_depths and label in label_depths:
            kwargs["draft_depths"] = label_depths[label]
        engines[label] = make_engine(target, draft, policy=policy, policy_options=options, overlap=False,
                                     table=own_table, **kwargs)
    return engines


def policy_labels(parser, text: str, known) -> list[str]:
    """The comma-separated ``--policies`` of a script, each one of ``known``; an unknown label is a
    usage error naming it and the choices."""
    labels = text.split(",")
    unknown = [name for name in labels if name not in known]
    if unknown:
        parser.error(f"--policies: unknown {unknown}; choose from {sorted(known)}")
    return labels


def set_threads(n: int) -> None:
    torch.set_num_threads(n)


def write_report(path, report: dict) -> None:
    """Print ``report`` as indented JSON and, with a ``path``, write it there too (folders made)."""
    import json
    from pathlib import Path

    text = json.dumps(report, indent=1)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
    print(text)


def write_results(path: str | None, script: str, meta: dict, results: list[dict]) -> None:
    """Write ``{"meta", "results"}`` JSON to ``path`` (nothing without one); meta gains torch and the command."""
    if not path:
        return
    import json
    import sys
    from pathlib import Path

    meta = {**meta, "torch": torch.__version__, "command": f"python benchmarks/{script} " + " ".join(sys.argv[1:])}
    Path(path).write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")


def decode_in_turns(engines: dict, prompts: list, concurrency: int, max_tokens: int, before_step=None,
                    after_step=None):
    """Every engine decodes every prompt (at most ``concurrency`` at a time, a finished request replaced by
    the next prompt), the engines taking turns one ``step()`` at a time in an order shuffled every turn
    (``turn_order``). ``before_step(label)`` runs before each of an engine's steps (the untimed
    first-call one too) and ``after_step(label, seconds, admitted)`` after each measured one
    (``admitted``: the step took new requests), both untimed. Returns per label the outputs' token
    ids in prompt order and the summed seconds of the engine's own steps.

    The order matters: the first engine to run a new shape pays the process's one-time costs for it
    (kernel primitives are cached process-wide), so in a fixed order the second and third of three
    identical adaptive engines ran 2.3-4.5 % faster than the first (12 requests, held-out prompts);
    rotated by one every turn, a target-only engine that always followed its twin ran 0.2-1.9 % faster
    than the twin (five runs; shuffled, -0.7 to +0.6 %; results/amx/README.md)."""
    import time

    from dspark_core.bench.run import turn_order
    from dspark_core.engine.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens)
    queues = {label: list(enumerate(prompts)) for label in engines}
    live, seconds = dict.fromkeys(engines, 0), dict.fromkeys(engines, 0.0)
    order: dict = {label: {} for label in engines}
    outputs: dict = {label: {} for label in engines}
    for label, engine in engines.items():
        if before_step is not None:
            before_step(label)
        engine.generate(prompts[:1], SamplingParams(max_tokens=4))  # first-call costs, not measured
    turn = 0
    while any(queues[label] or live[label] for label in engines):
        for label in turn_order(list(engines), turn):
            engine = engines[label]
            if not (queues[label] or live[label]):
                continue
            if before_step is not None:
                before_step(label)
            admitted = live[label] < concurrency and bool(queues[label])
            while live[label] < concurrency and queues[label]:
                index, prompt = queues[label].pop(0)
                order[label][engine.add_request(prompt, params).request_id] = index
                live[label] += 1
            started = time.perf_counter()
            finished = engine.step()
            elapsed = time.perf_counter() - started
            seconds[label] += elapsed
            if after_step is not None:
                after_step(label, elapsed, admitted)
            for output in finished:
                outputs[label][order[label][output.request_id]] = output.token_ids
                live[label] -= 1
        turn += 1
    return {label: [outputs[label][i] for i in range(len(prompts))] for label in engines}, seconds


def paired_rows(outputs: dict, seconds: dict, baseline: str, reference: str) -> list[dict]:
    """One result row per ``policy@variant`` label: throughput, its ratio to the same policy's ``baseline``
    variant, and whether its outputs equal the ``reference`` label's."""
    rows = []
    for label in outputs:
        tokens = sum(len(ids) for ids in outputs[label])
        policy = label.split("@")[0]
        base = f"{policy}@{baseline}"
        base_rate = sum(len(ids) for ids in outputs[base]) / seconds[base]
        rate = tokens / seconds[label]
        rows.append({"policy": label, "tokens": tokens, "seconds": round(seconds[label], 2),
                     "tokens_per_s": round(rate, 2), f"vs_{baseline}": round(rate / base_rate, 3),
                     "identical": outputs[label] == outputs[reference]})
        print(rows[-1], flush=True)
    return rows
