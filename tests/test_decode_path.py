"""The path of one decode step stays short, and a stage plugin still plugs in.

docs/architecture.md ("The path of one decode step") promises that following
a step from ``Engine.step`` to the target's forward crosses at most
``MAX_FILES`` project files. The test records the Python stack at the target's
forward during one real ``Engine.step`` (tiny float64 models, no schedule
overlap, so the step runs on the calling thread) and counts the project files
from ``Engine.step`` down, the target model's own file included.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.engine.request import SamplingParams
from dspark_core.engine.step import verify as core_verify
from dspark_core.hookspecs import hookimpl
from dspark_core.models.reference import greedy_generate
from dspark_core.plugins import Hooks, build_plugin_manager, default_hooks
from engine_support import random_prompts, synthetic_table, tiny_pair

ROOT = Path(__file__).resolve().parents[1]
PROJECT_DIRS = tuple(ROOT / d for d in ("dspark_core", "plugins", "kernels"))
MAX_FILES = 6
WIDTH, BUCKETS = 3, (1, 2)


def _engine(graphs: bool, hooks: Hooks | None = None) -> Engine:
    target, draft = tiny_pair(seed=2, block_size=WIDTH)
    hooks = hooks or default_hooks()
    backend = hooks.graph_backend("static", hooks.device("cpu")) if graphs else None
    engine = Engine(target, draft, EngineConfig(draft_width=WIDTH, policy="fixed", request_buckets=BUCKETS,
                                                max_model_len=96), hooks=hooks, graphs=backend)
    engine.install_table(synthetic_table(WIDTH, BUCKETS))
    if graphs:
        engine.warmup()
        engine.mark_ready()
    return engine


def _project_file(path: Path) -> bool:
    return any(d in path.parents for d in PROJECT_DIRS)


def decode_path(engine: Engine) -> list[tuple[str, str]]:
    """(file, function) of every project frame from Engine.step down to the target's forward, outermost first."""
    target = engine.runner.target
    inner = target.forward
    stacks: list[list[inspect.FrameInfo]] = []

    def recording_forward(*args, **kwargs):
        stacks.append(inspect.stack()[1:])
        return inner(*args, **kwargs)

    target.forward = recording_forward  # an instance attribute shadows the method
    try:
        engine.add_request(random_prompts(1, seed=4)[0], SamplingParams(max_tokens=8, ignore_eos=True))
        engine.step()  # the prefill (and the first decode step)
        stacks.clear()
        engine.step()  # a decode step only
    finally:
        del target.forward
    assert stacks, "no target forward ran during the decode step"
    stack = stacks[-1]
    top = next(i for i, f in enumerate(stack) if f.function == "step" and Path(f.filename).name == "engine.py")
    frames = [(str(Path(f.filename).relative_to(ROOT)), f.function) for f in reversed(stack[: top + 1])
              if _project_file(Path(f.filename))]
    model_file = Path(inspect.getsourcefile(type(target)) or "")
    return frames + [(str(model_file.relative_to(ROOT)), "forward")]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static-backend"])
def test_one_decode_step_crosses_at_most_six_project_files(graphs):
    engine = _engine(graphs)
    try:
        frames = decode_path(engine)
    finally:
        engine.close()
    files = list(dict.fromkeys(f for f, _ in frames))
    shown = "\n  ".join(f"{f} {fn}" for f, fn in frames)
    assert len(files) <= MAX_FILES, f"the decode path crosses {len(files)} project files:\n  {shown}"
    # the default path runs the core's stages directly: no plugin machinery in between
    assert "dspark_core/plugins.py" not in files and not any(f.startswith("plugins/") for f in files)


class VerifyCounter:
    """A stage plugin: answers dspark_verify with the core's own stage and observes every commit."""

    def __init__(self) -> None:
        self.verified = self.committed = 0

    @hookimpl
    def dspark_verify(self, step, proposal, budget):
        self.verified += 1
        return core_verify(step, proposal, budget)

    @hookimpl
    def dspark_commit(self, step, verification):
        self.committed += 1


def test_a_stage_plugin_replaces_and_observes_stages_and_output_stays_exact():
    pm = build_plugin_manager()
    plugin = VerifyCounter()
    pm.register(plugin)
    engine = _engine(graphs=False, hooks=Hooks(pm))
    prompts = random_prompts(3, seed=6)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    steps = engine.counters.steps
    engine.close()
    target, _ = tiny_pair(seed=2, block_size=WIDTH)
    assert [list(o.token_ids) for o in outputs] == [greedy_generate(target, p, 10) for p in prompts]
    assert plugin.verified == plugin.committed == steps > 0


def test_the_split_inside_the_verify_key_chooses_what_the_policy_split_chooses():
    """adaptive's split (the allocate kernel) runs inside the verify key; with a verify plugin it runs in
    select_budget instead. Both engines verify the same lengths at every step and commit the same tokens."""
    prompts = random_prompts(3, seed=6)
    runs = []
    for plugin in (None, VerifyCounter()):
        pm = build_plugin_manager()
        if plugin is not None:
            pm.register(plugin)
        target, draft = tiny_pair(seed=2, block_size=WIDTH)
        engine = Engine(target, draft, EngineConfig(draft_width=WIDTH, policy="adaptive", request_buckets=BUCKETS,
                                                    max_model_len=96, schedule_overlap=False), hooks=Hooks(pm))
        engine.install_table(synthetic_table(WIDTH, BUCKETS, per_row=0.0001, step=0.0))  # drafting looks cheap
        reports = []
        engine.add_observer(reports.append)
        outputs = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
        engine.close()
        runs.append(([list(o.token_ids) for o in outputs], [(r.target_rows, r.verify_lengths) for r in reports]))
    (tokens, steps), (tokens_eager, steps_eager) = runs
    assert tokens == tokens_eager and steps == steps_eager
    assert any(0 < sum(lengths) < WIDTH * len(lengths) for _, lengths in steps)  # a real split, not all or none
