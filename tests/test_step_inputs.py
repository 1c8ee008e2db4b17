"""The step's inputs arrive padded to the request bucket, and its result is one packed copy.

The planner builds slots and caps on the host already padded (the scratch slot, cap -1), the
proposal key's bucket-sized outputs go to the verify key as they are, and the verify key packs what
the host reads; ``collect`` copies that tensor once, and what it returns must not change when the
key's output buffer is written again by the next replay.
"""

from __future__ import annotations

import numpy as np
import torch

from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.engine.request import SamplingParams
from dspark_core.engine.runner import pad_to
from dspark_core.engine.step import Budget, Proposal, Verification, collect
from dspark_core.plugins import default_hooks
from dspark_core.policy import TierChoice
from dspark_kernels.accept_commit import Acceptance
from dspark_kernels.pack import PackedRows
from engine_support import random_prompts, synthetic_table, tiny_pair

WIDTH, BUCKETS = 3, (1, 4)


def test_pad_to_appends_fill_rows_and_leaves_a_full_tensor_alone():
    full = torch.tensor([5, 6, 7, 8])
    assert pad_to(full, 4, -1) is full
    assert pad_to(torch.tensor([5, 6]), 4, -1).tolist() == [5, 6, -1, -1]
    block = pad_to(torch.ones(1, 3), 3, 0)
    assert block.shape == (3, 3) and block[1:].abs().sum() == 0


def test_planner_pads_slots_and_caps_to_the_bucket_and_the_step_sees_their_views():
    target, draft = tiny_pair(seed=2, block_size=WIDTH)
    hooks = default_hooks()
    engine = Engine(target, draft, EngineConfig(draft_width=WIDTH, policy="adaptive", request_buckets=BUCKETS,
                                                max_model_len=96),
                    hooks=hooks, graphs=hooks.graph_backend("static", hooks.device("cpu")))
    engine.install_table(synthetic_table(WIDTH, BUCKETS))
    engine.warmup()
    engine.mark_ready()
    steps = []
    inner = engine.decode_on_device
    engine.decode_on_device = lambda step: (steps.append(step), inner(step))[1]
    for prompt in random_prompts(3, seed=4):
        engine.add_request(prompt, SamplingParams(max_tokens=6))
    while engine.has_work:
        engine.step()
    three = [s for s in steps if s.slots.shape[0] == 3]
    assert three, "no decode step ran three requests in the bucket of four"
    for step in three:
        assert step.bucket_slots.tolist()[3] == engine.runner.scratch_slot
        assert step.bucket_caps.tolist()[3] == -1
        assert torch.equal(step.bucket_slots[:3], step.slots) and torch.equal(step.bucket_caps[:3], step.caps)
        assert step.slots.data_ptr() == step.bucket_slots.data_ptr()  # a view, not a second copy
    engine.close()


def test_collect_copies_the_packed_result_out_of_the_key_buffer():
    width = 2
    # accepted, length, committed (K+1), confidences (K) for two requests
    packed = torch.tensor([[1, 2, 11, 12, 13, 0.5, 0.25], [0, 1, 21, 0, 0, 0.75, 0.5]], dtype=torch.float64)
    verification = Verification(PackedRows(*(torch.zeros(1, dtype=torch.int64),) * 4),
                                Acceptance(torch.tensor([1, 0]), torch.zeros(2, 3, dtype=torch.int64)),
                                committed=True, lengths=torch.tensor([2, 1]), host_result=packed)
    proposal = Proposal(torch.zeros(2, width, dtype=torch.int64), torch.zeros(2, width))
    result = collect(proposal, Budget(TierChoice(4), None), verification)
    packed.fill_(-7)  # the next replay writes the key's output buffer again
    assert result.accepted == [1, 0] and result.lengths == [2, 1]
    assert result.committed == [[11, 12, 13], [21, 0, 0]]
    np.testing.assert_array_equal(result.confidences, [[0.5, 0.25], [0.75, 0.5]])
