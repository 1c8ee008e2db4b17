"""The greedy head: bfloat16 product + proven bound + exact float32 dots picks the same tokens as
the float32 dots over the whole vocabulary, row by row, whatever the batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_core.errors import ModelError
from dspark_core.models import greedy_head
from dspark_core.models.base import ForwardBatch
from dspark_core.models.greedy_head import BOUND_FACTOR, UNIT_ROUNDOFF, GreedyHead
from dspark_core.models.layers import greedy_tokens, linear
from dspark_core.models.llama import LlamaTarget
from dspark_core.models.random_models import random_target_tensors, tiny_target_config


def _every_dot(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Every token's float32 logit, each dot on its own (what the head computes for its candidates)."""
    return torch.stack([(row * weight).sum(-1) for row in hidden])


def _near_tie_head(generator: torch.Generator, vocab: int, width: int, spread: float) -> torch.Tensor:
    """A head whose rows come in near-copies: their logits differ by about ``spread`` of their size,
    far below what a bfloat16 product resolves (2^-8)."""
    base = torch.randn(vocab // 2 + 1, width, generator=generator)
    rows = torch.cat([base, base + spread * torch.randn(base.shape, generator=generator)])
    return rows[torch.randperm(rows.shape[0], generator=generator)][:vocab].contiguous()


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), vocab=st.sampled_from([200, 1000, 1027]), spread=st.sampled_from([0.0, 1e-6, 1e-4]),
       scale=st.sampled_from([0.1, 3.0, 40.0]))
def test_picks_the_first_largest_float32_dot(seed, vocab, spread, scale):
    generator = torch.Generator().manual_seed(seed)
    weight = _near_tie_head(generator, vocab, 64, spread)
    if spread == 0.0:  # exact ties: the first index must win
        weight[vocab - 1] = weight[3]
    hidden = scale * torch.randn(9, 64, generator=generator)
    hidden[0] = weight[3] / weight[3].norm()  # a row whose best tokens tie exactly (spread 0)
    expected = greedy_tokens(_every_dot(hidden, weight))
    assert torch.equal(GreedyHead(weight)(hidden), expected)


def test_a_row_gets_its_token_whatever_the_batch():
    generator = torch.Generator().manual_seed(1)
    weight = _near_tie_head(generator, 4000, 96, 1e-5)
    hidden = 5.0 * torch.randn(40, 96, generator=generator)
    head = GreedyHead(weight)
    together = head(hidden)
    alone = torch.cat([head(hidden[i : i + 1]) for i in range(hidden.shape[0])])
    assert torch.equal(together, alone)
    assert torch.equal(head(hidden[7:23]), together[7:23])


def test_the_bound_column_lifts_every_logit_above_its_true_value():
    """What the candidate search rests on: the bfloat16 product with the bound column is at least
    each exact (float64) logit, including for large hidden states and large logits."""
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(3000, 128, generator=generator)
    hidden = torch.cat([40.0 * torch.randn(16, 128, generator=generator), 1e-3 * torch.randn(4, 128, generator=generator)])
    head = GreedyHead(weight)
    bound = torch.zeros(hidden.shape[0], head.augmented.shape[1] - hidden.shape[1])
    bound[:, 0] = BOUND_FACTOR * UNIT_ROUNDOFF * hidden.norm(dim=-1)
    upper = linear(torch.cat([hidden, bound], 1).to(torch.bfloat16), head.augmented).double()
    exact = hidden.double() @ weight.double().T
    assert (upper >= exact).all()
    # and without the column it is not: the bound is doing the work
    assert not (linear(hidden.to(torch.bfloat16), weight.to(torch.bfloat16)).double() >= exact).all()


def test_a_random_model_makes_many_candidates_and_still_picks_right():
    """Near-uniform logits (a random model, small hidden states): most tokens are candidates, and
    their dots are computed in pieces."""
    generator = torch.Generator().manual_seed(4)
    weight = 0.01 * torch.randn(20000, 32, generator=generator)
    hidden = 1e-3 * torch.randn(3, 32, generator=generator)
    assert torch.equal(GreedyHead(weight)(hidden), greedy_tokens(_every_dot(hidden, weight)))


@pytest.fixture
def tiny_target():
    config = tiny_target_config(vocab_size=700, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=16, max_position=128)
    return LlamaTarget(config, random_target_tensors(config, seed=5))


def _batch(tokens: list[int]) -> ForwardBatch:
    n = len(tokens)
    return ForwardBatch(torch.tensor(tokens), torch.arange(n), torch.tensor([0]), torch.tensor([0, n]))


@pytest.mark.parametrize("head_on", [True, False])
def test_target_forward_gives_greedy_tokens_only_when_asked(tiny_target, head_on, monkeypatch):
    monkeypatch.setattr(greedy_head, "_enabled_override", head_on)
    tokens = [5, 17, 300, 2, 9, 44]
    full = tiny_target.forward(_batch(tokens), tiny_target.new_cache(1, 16))
    greedy = tiny_target.forward(_batch(tokens), tiny_target.new_cache(1, 16), greedy_only=True)
    assert greedy.logits is None and full.tokens is None
    assert torch.equal(greedy.tokens, greedy_tokens(full.logits))
    cached = getattr(tiny_target, "_greedy_head_cache", None)
    assert (cached is not None) == head_on
    if head_on:  # built once: later forwards reuse it
        tiny_target.forward(_batch(tokens[:2]), tiny_target.new_cache(1, 16), greedy_only=True)
        assert tiny_target._greedy_head_cache[1] is cached[1]
    with pytest.raises(ModelError, match="greedy_only=True"):
        greedy.full_logits()
