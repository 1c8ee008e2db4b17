"""benchmarks/draft_depth.py: a proposal's time and a cut block's acceptance, depth by depth."""

from __future__ import annotations

import torch
from engine_support import random_prompts, tiny_pair
from script_support import load_script


def test_every_requests_and_depth_pair_is_timed():
    script = load_script("draft_depth")
    target, draft = tiny_pair(seed=1)
    script.CONTEXT = 20  # the tiny target holds 512 positions; 300 would do too, only slower
    times = script.proposal_times(target.to(torch.float32), draft.to(torch.float32), [1, 3], rounds=2, reps=1)
    assert set(times) == {(n, d) for n in (1, 3) for d in range(1, 8)}
    assert all(t > 0 for t in times.values())


def test_acceptance_runs_each_depth_and_leaves_the_draft_as_it_was():
    script = load_script("draft_depth")
    target, draft = tiny_pair(seed=2)
    rows = script.acceptance(target, draft, random_prompts(3, seed=4), [7, 2], max_tokens=24)
    assert [r["depth"] for r in rows] == [7, 2]
    assert [len(r["survival_by_position"]) for r in rows] == [7, 2]
    assert all(r["tau"] >= 1.0 and r["steps"] > 0 for r in rows)
    assert "propose" not in vars(draft)  # the cut was undone: the class's own propose again
