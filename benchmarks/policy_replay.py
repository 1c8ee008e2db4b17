"""Budget policies replayed on recorded draft traces: a noise-free comparison.

On a shared CPU two runs of the same policy differ by 10-20 %, more than
most policy changes are worth. This script takes the machine out: it records,
once, what the draft would propose at *every* answer position of real
generations, then replays any policy over those records under a cost table.

    python benchmarks/policy_replay.py record --prompts /tmp/sharegpt-heldout.jsonl \\
        --drafts default,/path/to/other-draft --output /tmp/traces.npz
    python benchmarks/policy_replay.py replay --traces /tmp/traces.npz \\
        --table benchmarks/results/heldout-v5/k7/cost-table.json --concurrency 1,4,16 \\
        --policies adaptive,none,fixed-k1,fixed-k2,fixed-k3,fixed-k7 \\
        --extra '{"adaptive-m1": ["adaptive", {"draft_off_margin": 1.0}]}'

Why a replay is exact in tokens: with greedy decoding the committed text is
the same for every policy, and the draft's proposal at a position depends
only on the text before it (a draft-off step still feeds the draft the
target's hidden states). So the proposal and its acceptance at each position
(``record``: confidences and hits, teacher-forced on the target's own greedy
answer) is all a policy can meet; a replay walks the answer, letting the
policy plan, choose a tier and split it exactly as the engine would, and
advances each request by its accepted tokens plus the bonus.

What it does not model: time. Steps are charged their cost in a table
(``--table``: the costs the policy believes, and by default the truth too).
``--belief refit:SIGMA:SEED`` instead hands the policy a table refitted
from the truth's own probe points measured with log-normal window noise of
SIGMA (what a startup calibration on a noisy machine produces), and
``--belief PATH`` another saved table, while steps are still charged the
true costs: how much a policy loses to a wrong table.
Requests join as others finish (``--concurrency`` at a time, like the
bench); caps ignore ``max_tokens`` (each answer ends where its trace ends).
Use held-out ShareGPT prompts (``benchmarks/heldout_prompts.py``) for
decisions, never the MT-Bench evaluation prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import attrs
import numpy as np
import torch
from dspark_kernels import kernels_for

from dspark_core.commands.bench import _policies, parse_variants
from dspark_core.engine.costs import TierCosts
from dspark_core.engine.records import StepReport
from dspark_core.geometry import Geometry
from dspark_core.plugins import default_hooks, load_hooks
from dspark_core.policy import TierContext, observe_step, plan_step, step_draft_depth
from dspark_core.resolve import parse_draft_depths
from dspark_core.table import load_table

BUCKETS = (1, 2, 4, 8, 16)
CONTEXT = 300  # KV length passed to the table lookup (single-interval tables ignore it)


@attrs.frozen
class Trace:
    """One answer's draft record: raw confidence logits and greedy hits ``[anchors, K]``."""

    logits: np.ndarray
    hits: np.ndarray

    def accepted(self, position: int, width: int) -> int:
        """Leading drafted tokens the target accepts at ``position`` (out of ``width``)."""
        return int(np.cumprod(self.hits[position, :width]).sum())


def record(args: argparse.Namespace) -> int:
    """Greedy answers for the prompts (float32 target), then every position re-drafted by each draft."""
    from dspark_core.models.drafts import resolve_draft_path
    from dspark_core.models.loading import load_target
    from dspark_core.models.speculators_io import load_draft
    from dspark_core.train.data import chat_ids, read_prompts_jsonl
    from dspark_core.train.evaluate import confidences_from_features
    from dspark_core.train.features import generate_with_features

    torch.set_num_threads(args.threads)
    target = load_target("smollm2", dtype=torch.float32)
    prompts = [chat_ids(target.tokenizer, p) for p in read_prompts_jsonl(Path(args.prompts))[: args.count]]
    drafts = [d for d in args.drafts.split(",") if d]
    first = load_draft(resolve_draft_path(drafts[0], "smollm2"))
    _, feats = generate_with_features(target, prompts, first.config.aux_layer_ids, max_tokens=args.max_tokens, k=1,
                                      batch=args.batch)
    arrays: dict[str, np.ndarray] = {}
    for index, name in enumerate(drafts):
        draft = load_draft(resolve_draft_path(name, "smollm2"))
        if draft.config.aux_layer_ids != first.config.aux_layer_ids:
            raise SystemExit(f"draft {name!r} reads other target layers than {drafts[0]!r}; record it separately")
        draft = draft.bind_target(target)
        lengths, logits, hits = [], [], []
        for n in range(feats.num_sequences):
            seq_logits, seq_hits = confidences_from_features(draft, feats.subset([n]))
            lengths.append(len(seq_hits))
            logits.append(seq_logits)
            hits.append(seq_hits)
        arrays[f"d{index}_lengths"] = np.array(lengths)
        arrays[f"d{index}_logits"] = np.concatenate(logits).astype(np.float32)
        arrays[f"d{index}_hits"] = np.concatenate(hits)
        arrays[f"d{index}_temperatures"] = draft.temperatures.cpu().numpy()
        all_hits = arrays[f"d{index}_hits"]
        print(f"{name}: {len(all_hits)} positions, tau at full width {1 + np.cumprod(all_hits, 1).sum(1).mean():.3f}, "
              f"position-1 acceptance {all_hits[:, 0].mean():.3f}", file=sys.stderr)
    np.savez_compressed(args.output, names=np.array(drafts), **arrays)
    return 0


def load_traces(path: str) -> dict[str, tuple[list[Trace], np.ndarray]]:
    """Per draft name: its traces (answers with at least one position) and STS temperatures."""
    data = np.load(path)
    out = {}
    for index, name in enumerate(data["names"]):
        bounds = np.concatenate([[0], np.cumsum(data[f"d{index}_lengths"])])
        logits, hits = data[f"d{index}_logits"], data[f"d{index}_hits"]
        traces = [Trace(logits[a:b], hits[a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        out[str(name)] = (traces, data[f"d{index}_temperatures"].astype(np.float64))
    return out


def table_costs(table, width: int) -> TierCosts:
    costs = TierCosts(Geometry.bucket_multiples(width, BUCKETS))
    costs.install(table)
    return costs


def refitted_table(path: str, sigma: float, seed: int):
    """The table refitted from its own probe points, each window re-measured with log-normal noise."""
    from dspark_core.costs.base import CostSample
    from dspark_core.table import fit_table

    table = load_table(path)
    fit = table.fits[0]
    if not fit.measurements or table.settings is None:
        raise SystemExit(f"{path}: --belief refit needs a table that kept its measurements and settings")
    rng = np.random.default_rng(seed)
    steps = table.settings.window_steps
    samples = []
    for m in fit.measurements:
        bucket, rows, off = m.request_bucket, m.target_rows, m.draft_off
        seconds = fit.cost.predict_draft_off_seconds(bucket) if off else fit.cost.predict_seconds(bucket, rows)
        for _ in range(m.windows):
            noisy = seconds * steps * float(np.exp(rng.normal(0.0, sigma)))
            samples.append(CostSample(bucket, rows, 0, noisy, steps, off))
    return fit_table(table.settings, samples, default_hooks().cost_model, table.fingerprint)


def replay(traces: list[Trace], temperatures: np.ndarray, width: int, policy, concurrency: int,
           belief: TierCosts, truth: TierCosts, draft_depths: dict[int, int] | None = None,
           drafted_scale: float = 1.0, time_noise: float = 0.0, seed: int = 0) -> dict:
    """Decode every trace ``concurrency`` at a time under ``policy``; time is charged from ``truth``.

    ``drafted_scale`` multiplies what a drafted step really costs (truth's price) while the policy still
    decides on ``belief``'s: a table that underprices drafting (> 1) or overprices it (< 1). Each report
    carries the charged seconds as its measured ``step_seconds`` (what the ``timed`` draft-off rule reads),
    times log-normal noise of ``time_noise`` (seeded by ``seed``; the charge itself stays exact).

    ``draft_depths`` (request bucket -> tokens proposed there, as ``--draft_depths``): the confidences past
    a step's depth are zeros, as the engine's are (a fixed k above the depth gets all K, as there). The
    recorded hits are the whole block's; a cut block's first tokens differ a little but were accepted
    as often on held-out prompts (docs/architecture.md, "Draft depth")."""
    geometry = belief.geometry

    kernels = kernels_for(width)
    queue = list(range(len(traces)))
    live: list[list[int]] = []  # [trace index, position]
    history: dict[int, list[tuple[int, np.ndarray]]] = {}  # per trace: (step, confidences) of its drafted steps
    population: list[tuple[int, np.ndarray]] = []  # (step, mean confidences) of drafted steps

    def known(trace: int, step: int) -> np.ndarray:
        """The newest confidences from a step no later than ``step`` (the planner's rule)."""
        for entries in (history.get(trace, []), population):
            for index, confidences in reversed(entries):
                if index <= step:
                    return confidences
        return np.ones(width)

    lag = policy.tier_lag
    rng = np.random.default_rng(seed)
    seconds = tokens = steps = off_steps = 0.0
    while queue or live:
        while queue and len(live) < concurrency:
            live.append([queue.pop(0), 0])
        bucket = geometry.bucket_for(len(live))
        tiers = geometry.rows_for(bucket)
        ctx = TierContext(bucket, len(live), width, tiers, belief.for_step(bucket, CONTEXT),
                          belief.draft_off_for_step(bucket, CONTEXT))
        caps = np.full(len(live), width)
        step = int(steps)
        depth = step_draft_depth(policy, draft_depths or {}, bucket, width)
        older = np.stack([known(t, step - max(lag, 1)) for t, _ in live])
        older[:, depth:] = 0.0  # nothing past this step's depth will be proposed
        plan = plan_step(policy, ctx, older, caps)
        ctx = attrs.evolve(ctx, forecast_scale=plan.forecast_scale)
        if not plan.draft:
            accepted = np.zeros(len(live), dtype=np.int64)
            charged = float(truth.draft_off_for_step(bucket, CONTEXT))
            off_steps += 1
            report = StepReport(len(live), bucket, bucket, tuple(accepted), tuple(accepted), False, float(len(live)),
                                len(live), tiers, ctx.tier_costs, True, ctx.draft_off_cost, plan.forecast_scale,
                                step_seconds=charged * float(np.exp(rng.normal(0.0, time_noise))))
        else:
            confidences = np.stack([1.0 / (1.0 + np.exp(-traces[t].logits[p, :width] / temperatures[:width]))
                                    for t, p in live])
            confidences[:, depth:] = 0.0
            tier_input = confidences if lag == 0 else np.stack([known(t, step - lag) for t, _ in live])
            tier_input[:, depth:] = 0.0
            choice = policy.choose_tier(ctx, tier_input, caps)
            # the policy's own split with the engine's kernels, as on the device
            lengths = policy.split(kernels, torch.from_numpy(confidences).float(), torch.from_numpy(caps), choice,
                                   bucket).numpy()
            accepted = np.minimum([traces[t].accepted(p, width) for t, p in live], lengths)
            charged = drafted_scale * float(truth.for_step(bucket, CONTEXT)[tiers.index(choice.rows)])
            report = StepReport(len(live), bucket, choice.rows, tuple(int(x) for x in lengths),
                                tuple(int(x) for x in accepted), choice.fallback, choice.predicted_tokens,
                                int(accepted.sum()) + len(live), tiers, ctx.tier_costs, False, ctx.draft_off_cost,
                                plan.forecast_scale, step_seconds=charged * float(np.exp(rng.normal(0.0, time_noise))))
            for (t, _), c in zip(live, confidences):
                history.setdefault(t, []).append((step, c))
            population.append((step, confidences.mean(axis=0)))
        seconds += charged
        observe_step(policy, report)
        steps += 1
        for item, a in zip(live, accepted):
            item[1] += int(a) + 1
            tokens += int(a) + 1
        live = [item for item in live if item[1] < len(traces[item[0]].hits)]
    return {"tokens_per_second": tokens / seconds, "steps": int(steps), "draft_off_share": off_steps / steps}


def make_policies(names: list[str], extra: dict, width: int, plugins: tuple[str, ...] = ()) -> dict:
    """The bench's policies by name (``fixed-kN``, ``fixed``, any registered policy, those of ``plugins``
    included) plus labelled extras."""
    return _policies(load_hooks(plugins) if plugins else default_hooks(), names, width, extra, option="--extra")


def replay_command(args: argparse.Namespace) -> int:
    truth_table = load_table(args.table)
    width = truth_table.draft_width if args.k is None else args.k
    truth = table_costs(truth_table, width)
    if args.belief == "table":
        belief = truth
    elif args.belief.startswith("refit"):
        kind, sigma, seed = (args.belief.split(":") + ["", ""])[:3]
        if kind != "refit" or not sigma or not seed:
            raise SystemExit(f"--belief must be 'table', 'refit:SIGMA:SEED' or a table file, got {args.belief!r}")
        belief = table_costs(refitted_table(args.table, float(sigma), int(seed)), width)
    else:
        if not Path(args.belief).is_file():
            raise SystemExit(f"--belief must be 'table', 'refit:SIGMA:SEED' or a table file, got {args.belief!r}")
        belief = table_costs(load_table(args.belief), width)
    names = [p for p in args.policies.split(",") if p]
    if "none" not in names:
        names.insert(0, "none")
    extra = parse_variants(args.extra, "--extra")
    depths = parse_draft_depths(args.draft_depths, BUCKETS, width)
    results = []
    for draft, (traces, temperatures) in load_traces(args.traces).items():
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            rates = {}
            for name, policy in make_policies(names, extra, width, tuple(args.plugin)).items():
                rates[name] = replay(traces, temperatures, width, policy, concurrency, belief, truth, depths,
                                     args.drafted_scale, args.time_noise, args.seed)
            base = rates["none"]["tokens_per_second"]
            fixed = {n: r["tokens_per_second"] for n, r in rates.items() if n.startswith("fixed-k")}
            best = max(fixed, key=fixed.get) if fixed else None
            for name, r in rates.items():
                row = {"draft": draft, "concurrency": concurrency, "policy": name,
                       "vs_target_only": r["tokens_per_second"] / base,
                       "vs_best_fixed": r["tokens_per_second"] / fixed[best] if best else float("nan"),
                       "draft_off_share": r["draft_off_share"], "steps": r["steps"]}
                results.append(row)
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print("| draft | c | policy | / target-only | / best fixed | draft-off steps |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if r["policy"] != "none":
            print(f"| {Path(r['draft']).name} | {r['concurrency']} | {r['policy']} | {r['vs_target_only']:.3f} | "
                  f"{r['vs_best_fixed']:.3f} | {r['draft_off_share']:.2f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="generate answers and record every position's draft proposal")
    rec.add_argument("--prompts", required=True, help="JSONL prompts (held-out ShareGPT, not MT-Bench)")
    rec.add_argument("--count", type=int, default=80)
    rec.add_argument("--drafts", default="default", help="comma-separated drafts ('default' or directories)")
    rec.add_argument("--max_tokens", type=int, default=128)
    rec.add_argument("--batch", type=int, default=40)
    rec.add_argument("--threads", type=int, default=2)
    rec.add_argument("--output", required=True)
    rep = sub.add_parser("replay", help="replay policies over recorded traces")
    rep.add_argument("--traces", required=True)
    rep.add_argument("--table", required=True, help="a saved cost table with its measurements (bench cost-table.json)")
    rep.add_argument("--k", type=int, default=None, help="draft width (default: the table's)")
    rep.add_argument("--concurrency", default="1,4,16")
    rep.add_argument("--policies", default="adaptive,fixed-k1,fixed-k2,fixed-k3,fixed-k5,fixed-k7")
    rep.add_argument("--extra", default="{}", help='JSON: {"label": ["policy", {options}]}')
    rep.add_argument("--plugin", action="append", default=[], metavar="NAME_OR_MODULE",
                     help="extra plugin whose policies --policies and --extra may name (repeatable)")
    rep.add_argument("--belief", default="table",
                     help="'table', 'refit:SIGMA:SEED' or another saved table (e.g. a second calibration) to decide on")
    rep.add_argument("--draft_depths", default="full",
                     help="Tokens the draft proposes per bucket: `full` or bucket:depth pairs (as the serve flag); "
                          "price them with a table calibrated at those depths")
    rep.add_argument("--drafted_scale", type=float, default=1.0,
                     help="what a drafted step really costs over the table's price (the policies still decide on "
                          "the table): 1.1 = the table underprices drafting by 10 %%")
    rep.add_argument("--time_noise", type=float, default=0.0,
                     help="log-normal sigma of the noise on each step's measured seconds (the timed draft-off rule's "
                          "input; the charged time stays exact)")
    rep.add_argument("--seed", type=int, default=0, help="seed of --time_noise")
    rep.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    return record(args) if args.command == "record" else replay_command(args)


if __name__ == "__main__":
    sys.exit(main())
