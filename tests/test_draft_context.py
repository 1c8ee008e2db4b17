"""The draft context the engine builds step by step is the one a fresh prefill of the same text builds.

Greedy exactness cannot see a wrong draft context: a stale or misplaced row only makes
proposals worse, and the target still decides every token. So this checks the context
itself, through what the draft proposes from it. After every decode step the real draft's
proposal for each running request (anchor = its newest token) must equal the proposal of a
second engine that prefilled the request's prompt and output in one forward. The steps in
between accept some drafted rows and reject others (an oracle draft proposes the target's
continuation with corruptions), so rejected rows must be rewritten and accepted ones kept.
"""

from __future__ import annotations

import pytest
import torch

from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.engine.request import SamplingParams
from engine_support import OracleDraft, greedy_references, random_prompts, synthetic_table, tiny_pair

WIDTH = 5
MAX_TOKENS = 40


def _real_proposal(engine: Engine, draft, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Anchor, position and the unwrapped draft's own proposal for one slot."""
    slots = torch.tensor([slot])
    anchors, positions = engine.storage.anchors(slots)
    engine.runner.flush_draft_context()
    tokens, confidences = draft.propose(anchors, positions, slots)
    return anchors, positions, tokens, confidences


def _fresh_proposal(target, draft, text: list[int], expect_next: list[int]):
    """Prefill ``text`` in a target-only engine, commit two tokens (one prefill, one decode step,
    so the anchor sits where the other engine's anchor sits) and propose from there."""
    engine = Engine(target, draft, EngineConfig(draft_width=WIDTH, request_buckets=(1,), max_model_len=256,
                                                policy="fixed", policy_options={"k": 0}, schedule_overlap=False))
    request = engine.add_request(text, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # launches the prefill and one decode step
    while engine.queue.in_flight:
        engine.step()
    assert list(request.output[:2]) == expect_next
    result = _real_proposal(engine, draft, request.slot)
    engine.close()
    return result


def _drain(engine: Engine) -> None:
    """Process every launched job, as ``Engine.step`` does when nothing is left to launch."""
    while engine.queue.in_flight:
        engine._process(*engine.queue.pop_oldest(), [])


@pytest.mark.parametrize("policy,options,overlap", [("fixed", {"k": WIDTH}, False), ("fixed", {"k": 2}, False),
                                                    ("adaptive", {}, False), ("fixed", {"k": WIDTH}, True)])
def test_stepwise_draft_context_equals_a_fresh_prefill(policy, options, overlap):
    target, draft = tiny_pair(seed=4, block_size=WIDTH + 1)
    prompts = random_prompts(3, seed=11)
    references = greedy_references(target, prompts, MAX_TOKENS + 4)
    oracle = OracleDraft(draft, {tuple(p): ref for p, ref in zip(prompts, references)}, seed=2, corrupt=0.3)
    engine = Engine(target, oracle, EngineConfig(draft_width=WIDTH, request_buckets=(1, 2, 4), max_model_len=256,
                                                 policy=policy, policy_options=options, schedule_overlap=overlap))
    oracle.engine = engine
    if policy == "adaptive":
        engine.install_table(synthetic_table(WIDTH, (1, 2, 4)))
    accepted: list[int] = []
    engine.add_observer(lambda report: accepted.extend(report.accepted))
    requests = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for p in prompts]
    snapshots = []
    steps = 0
    while any(r.finish_reason is None for r in requests):
        engine.step()
        steps += 1
        if overlap:
            if steps % 3:
                continue  # two of three steps launch while the previous one is still unprocessed
            _drain(engine)
        assert not engine.queue.in_flight  # without overlap every step is processed before it returns
        for r in requests:
            if r.finish_reason is None and len(r.output) >= 2:
                snapshots.append((list(r.prompt), list(r.output), *_real_proposal(engine, draft, r.slot)))
    engine.close()
    assert max(accepted) >= 2  # drafted rows were kept: the context grew by several rows in one step
    assert len(snapshots) >= (8 if overlap else 15)
    for prompt, output, anchors, positions, tokens, confidences in snapshots:
        fresh_anchors, fresh_positions, fresh_tokens, fresh_confidences = _fresh_proposal(
            target, draft, prompt + output[:-2], output[-2:])
        assert torch.equal(fresh_anchors, anchors) and torch.equal(fresh_positions, positions)
        assert torch.equal(fresh_tokens, tokens), f"after {len(output)} tokens of prompt {prompt[:5]}…"
        torch.testing.assert_close(fresh_confidences, confidences)
