"""Batch-invariant CPU forwards: a row's bits must not depend on the rows computed beside it.

Greedy exactness rests on this: a verify row at position p (computed with the other drafted rows
and the other requests of a step) must give the very logits the target-only row at p gives (one
row per request). Without it the two runs agree only where the target's best token leads the
second by more than rounding.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_core.models import attention, layers, row_bands
from dspark_core.models.base import make_forward_batch
from dspark_core.models.cpu_linear import bfloat16_packed_supported
from dspark_core.models.attention import KEY_BLOCK, attend, grouped_mask, invariant_cache_length, invariant_kv_length
from dspark_core.models.layers import INVARIANT_PRODUCT_ROWS, invariant_linear, products_rows_invariant
from dspark_core.models.row_layout import RowLayout
from dspark_core.models.random_models import random_target, tiny_target_config
from dspark_core.models.row_bands import RowBand, banded_attention, plan_bands, plan_cuts

# Shapes of a real small model (64-wide heads, grouped queries, several key chunks of context), so
# the products take the kernels serving takes; a few layers keep it fast.
MID = tiny_target_config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=64, max_position=1024)
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not bfloat16_packed_supported(), reason="no native bfloat16 products on this CPU"))]


def _attend_rows(q, keys, values, counts, starts):
    """Invariant attention of packed rows as the target runs it: the keys of a cache as long as
    ``keys``, read in whole blocks up to what the rows need."""
    positions = torch.tensor([s + j for s, c in zip(starts, counts) for j in range(c)])
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    layout = RowLayout.build(positions, torch.arange(len(counts)), offsets)
    kv_len = invariant_kv_length(layout.kv_len, keys.shape[2])
    layout = RowLayout.build(positions, torch.arange(len(counts)), offsets, kv_len=kv_len)
    mask = grouped_mask(layout.causal_mask(), q.shape[1] // keys.shape[1], q.dtype)
    return attend(q, keys[:, :, :kv_len], values[:, :, :kv_len], layout, mask, invariant=True)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_invariant_attention_gives_each_row_the_bits_it_gets_alone(data):
    """Rows of several requests together against each row alone (one request, one row, reading only
    the blocks it needs). One key head and one query head per key head are drawn too: calls of a
    single (request, key head) pair and of fewer than MIN_FOLDED_ROWS rows take other paths."""
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    counts = data.draw(st.lists(st.integers(1, 8), min_size=1, max_size=4), label="rows per request")
    starts = [data.draw(st.integers(0, 2 * KEY_BLOCK + 100), label=f"context{b}") for b in range(len(counts))]
    kv_heads = data.draw(st.sampled_from([1, 2]), label="key heads")
    heads = kv_heads * data.draw(st.sampled_from([1, 3]), label="query heads per key head")
    # the cache as the target allocates it: its length rounded up to one the reads are checked for
    cache_length = invariant_cache_length(max(s + c for s, c in zip(starts, counts))
                                          + data.draw(st.integers(0, KEY_BLOCK), label="cache past the last row"))
    head_dim, requests = 64, len(counts)
    keys, values = (torch.randn(requests, kv_heads, cache_length, head_dim, generator=generator) for _ in range(2))
    q = torch.randn(sum(counts), heads, head_dim, generator=generator)
    together = _attend_rows(q, keys, values, counts, starts)
    row = 0
    for b, (start, count) in enumerate(zip(starts, counts)):
        for j in range(count):  # the same row as a one-row request that reads only what it needs
            alone = _attend_rows(q[row : row + 1], keys[b : b + 1], values[b : b + 1], [1], [start + j])
            assert torch.equal(together[row], alone[0]), f"request {b} row {j} depends on the batch"
            row += 1


def test_an_invariant_cache_ends_on_a_length_its_reads_are_checked_for():
    tails = attention.invariant_key_tails()
    for max_len in (1, 2, 3, 100, 128, 129, 384, 385, 512, 513, 514, 2048, 2051):
        length = invariant_cache_length(max_len)
        assert length >= max_len and (length % KEY_BLOCK == 0 or length % KEY_BLOCK in tails)
        assert length - max_len < KEY_BLOCK
    assert invariant_cache_length(2048) == 2048  # SmolLM2's lengths allocate nothing more
    # the case that found it (a cache of exactly 2 keys gave the second row other bits beside the
    # first on the development CPU): two rows of one request against the second row alone
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(1, 1, invariant_cache_length(2), 64, generator=generator) for _ in range(2))
    q = torch.randn(2, 1, 64, generator=generator)
    assert torch.equal(_attend_rows(q, keys, values, [2], [0])[1], _attend_rows(q[1:], keys, values, [1], [1])[0])


def test_invariant_attention_reads_whole_key_blocks_or_a_checked_short_one():
    whole = ()
    assert [invariant_kv_length(n, 2048, whole) for n in (1, 512, 513, 1500)] == [512, 512, 1024, 1536]
    assert [invariant_kv_length(n, 700, whole) for n in (1, 512, 513, 700)] == [512, 512, 700, 700]
    assert invariant_kv_length(90, 96, whole) == 96  # a cache shorter than a block is read whole
    short = (128, 384)
    assert [invariant_kv_length(n, 2048, short) for n in (1, 128, 129, 385, 600, 1000)] == [128, 128, 384, 512, 640, 1024]
    assert [invariant_kv_length(n, 700, short) for n in (100, 400, 513)] == [128, 512, 700]  # 640 would cut the cache's last block
    # the tails in use are the candidates this CPU's check accepts, each checked on its own
    tails = attention.invariant_key_tails()
    assert set(tails) <= set(attention.CANDIDATE_KEY_TAILS) and list(tails) == sorted(tails)
    assert tails == tuple(t for t in attention.CANDIDATE_KEY_TAILS if attention.key_tail_invariant(t))


def test_a_key_tail_the_kernel_sums_otherwise_is_rejected(monkeypatch):
    """The check must be able to fail: a kernel whose bits depend on how many keys it reads (here a
    rounding step that grows with the read) has no tail accepted."""
    real = attention.invariant_attention

    def length_dependent(q, keys, values, mask):
        out = real(q, keys, values, mask)
        return out + out * (keys.shape[2] * 2.0**-20)  # a change that grows with the read length

    monkeypatch.setattr(attention, "invariant_attention", length_dependent)
    assert not any(attention.key_tail_invariant(t) for t in attention.CANDIDATE_KEY_TAILS)
    monkeypatch.setattr(attention, "invariant_attention", real)
    assert attention.key_tail_invariant(attention.CANDIDATE_KEY_TAILS[0]) == (
        attention.CANDIDATE_KEY_TAILS[0] in attention.invariant_key_tails())


def test_invariant_attention_is_softmax_attention():
    generator = torch.Generator().manual_seed(2)
    keys, values = (torch.randn(1, 1, 600, 64, generator=generator) for _ in range(2))
    q = torch.randn(3, 2, 64, generator=generator)
    out = _attend_rows(q, keys, values, [3], [550])
    for j in range(3):
        for h in range(2):
            k, v = keys[0, 0, : 551 + j], values[0, 0, : 551 + j]
            expected = torch.softmax(k @ q[j, h] / 8.0, dim=0) @ v
            torch.testing.assert_close(out[j, h * 64 : (h + 1) * 64], expected)


def test_invariant_attention_with_scores_far_below_the_maximum():
    """Score spreads of several hundred stay softmax attention, and keys past a row's own position
    get exact zero weights: huge values there never show."""
    generator = torch.Generator().manual_seed(5)
    keys, values = (torch.randn(1, 1, 200, 64, generator=generator) for _ in range(2))
    q = 40.0 * torch.randn(2, 2, 64, generator=generator)  # score spreads of several hundred
    values[0, 0, 151:] = 1e38  # beyond both rows' last key: any weight but an exact zero shows
    out = _attend_rows(q, keys, values, [2], [149])
    for j in range(2):
        for h in range(2):
            k, v = keys[0, 0, : 150 + j].double(), values[0, 0, : 150 + j].double()
            scores = k @ q[j, h].double() / 8.0
            assert (scores.max() - scores).max() > 200  # far below the maximum
            expected = torch.softmax(scores, dim=0) @ v
            torch.testing.assert_close(out[j, h * 64 : (h + 1) * 64].double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_linear_rows_do_not_depend_on_the_row_count(dtype):
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(1536, 576, generator=generator) * 0.05).to(dtype)
    x = torch.randn(3 * INVARIANT_PRODUCT_ROWS + 5, 576, generator=generator).to(dtype)
    one_by_one = torch.cat([invariant_linear(x[i : i + 1], weight) for i in range(x.shape[0])])
    for rows in (2, INVARIANT_PRODUCT_ROWS, INVARIANT_PRODUCT_ROWS + 1, 2 * INVARIANT_PRODUCT_ROWS + 7, x.shape[0]):
        assert torch.equal(invariant_linear(x[:rows], weight), one_by_one[:rows]), f"{rows} rows"


@pytest.mark.parametrize("dtype", DTYPES)
def test_target_logits_of_a_row_do_not_depend_on_the_batch(dtype):
    """Verify-shaped forwards (several rows per request, several requests, prompts prefilled together)
    against the target-only shape (each request alone, one row per forward): equal bits."""
    model = random_target(MID, seed=11, dtype=dtype, batch_invariant=True)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 1000, (n,), generator=generator).tolist() for n in (40, 170, 290)]
    drafted = [torch.randint(0, 1000, (n,), generator=generator).tolist() for n in (8, 3, 6)]

    together_cache = model.new_cache(4, 320)  # not whole key chunks: the last one is padded, and must not matter
    model.forward(make_forward_batch(prompts, [0, 0, 0], [0, 1, 2]), together_cache)
    batch = make_forward_batch(drafted, [len(p) for p in prompts], [0, 1, 2])
    together = model.forward(batch, together_cache).logits

    alone_cache = model.new_cache(4, 320)
    for b, (prompt, rows) in enumerate(zip(prompts, drafted)):
        model.forward(make_forward_batch([prompt], [0], [b]), alone_cache)
        for j, token in enumerate(rows):
            alone = model.forward(make_forward_batch([[token]], [len(prompt) + j], [b]), alone_cache).logits[0]
            row = int(batch.row_offsets[b]) + j
            assert torch.equal(together[row], alone), f"request {b} row {j}: max diff {(together[row] - alone).abs().max()}"


def test_invariant_forwards_default_on_for_cpu_float32_and_bfloat16():
    from dspark_core.errors import ModelError
    from dspark_core.models.llama import batch_invariant_default

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert batch_invariant_default(cpu, torch.float32)
    # bfloat16 and float16: on where this CPU's products in them measured row-invariant
    assert batch_invariant_default(cpu, torch.bfloat16) == products_rows_invariant(torch.bfloat16)
    assert batch_invariant_default(cpu, torch.float16) == products_rows_invariant(torch.float16)
    if bfloat16_packed_supported():
        assert batch_invariant_default(cpu, torch.bfloat16)
    assert not batch_invariant_default(cpu, torch.float64)  # test models keep the reference kernels
    assert not batch_invariant_default(cuda, torch.bfloat16)
    with pytest.raises(ModelError, match="CPU only, not cuda"):
        random_target(MID, batch_invariant=True, device="cuda")


def test_serve_flag_turns_invariant_forwards_on_and_off():
    """``--batch_invariant`` reaches the target through startup.apply_batch_invariance, and a target
    without invariant forwards refuses ``on`` by name."""
    from dspark_core.errors import ConfigError, ModelError
    from dspark_core.startup import apply_batch_invariance

    target = random_target(MID, dtype=torch.float64)  # float64: off by default
    assert not target.batch_invariant
    apply_batch_invariance(target, "on")
    assert target.batch_invariant
    apply_batch_invariance(target, "auto")  # auto leaves the target's setting alone
    assert target.batch_invariant
    apply_batch_invariance(target, "off")
    assert not target.batch_invariant
    target.device = torch.device("cuda")  # as a CUDA target would be: on is refused, off is fine
    with pytest.raises(ModelError, match="CPU only, not cuda"):
        target.set_batch_invariant(True)
    target.set_batch_invariant(False)

    class Plain:  # a plugin family's target with no invariant forwards
        pass

    apply_batch_invariance(Plain(), "off")  # nothing to turn off
    with pytest.raises(ConfigError, match="--batch_invariant=on: the Plain target has no batch-invariant forwards"):
        apply_batch_invariance(Plain(), "on")


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_product_self_check_passes_here_and_catches_one_large_product(dtype, monkeypatch):
    """products_rows_invariant measures what invariant_linear promises; with no row limit (one large
    product) the bfloat16 check must fail, since oneDNN's large-product kernels sum rows past the first
    block in another order (float32 products are invariant as they come)."""
    assert products_rows_invariant(dtype)
    monkeypatch.setattr(layers, "INVARIANT_PRODUCT_ROWS", 10_000)
    if dtype == torch.bfloat16:
        assert not products_rows_invariant(dtype)


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.integers(0, 12), min_size=1, max_size=16), gather=st.integers(0, 30))
def test_row_band_plans_cover_every_row_and_never_cost_more_than_one_band(counts, gather):
    cuts = plan_cuts(counts, gather_rows=gather)
    assert cuts[0] == 0 and cuts[-1] == max(counts) and cuts == sorted(set(cuts))

    def cost(plan):
        total = 0
        for j, (lo, hi) in enumerate(zip(plan, plan[1:])):
            members = len(counts) if lo == 0 else sum(c > lo for c in counts)
            total += members * (hi - lo) + (0 if j == 0 else len(counts) + gather * members)
        return total

    assert cost(cuts) <= cost(sorted({0, max(counts)}))
    assert all(any(c > lo for c in counts) for lo in cuts[1:-1])  # no band without a request in it


@pytest.mark.parametrize("length", [256, 1024])
def test_row_bands_give_each_row_the_bits_of_one_padded_call(monkeypatch, length):
    """Uneven rows per request (an adaptive verify step): attention in bands, some with copied keys,
    must give every real row exactly what one padded invariant-attention call gives. At 1 024 keys
    the banded requests reach only the first block, so their bands copy and read at most that."""
    generator = torch.Generator().manual_seed(3)
    counts, kv_heads, groups, head_dim = [1, 8, 2, 0, 5, 2, 7, 1], 2, 3, 64
    rows = max(counts)
    positions = torch.tensor([[100 + 17 * b + r for r in range(rows)] for b in range(len(counts))])
    causal = (torch.arange(length)[None, None, None, :] <= positions[:, None, :, None])
    q = torch.randn(len(counts), rows, kv_heads * groups, head_dim, generator=generator)
    keys = torch.randn(len(counts), kv_heads, length, head_dim, generator=generator)
    values = torch.randn(len(counts), kv_heads, length, head_dim, generator=generator)
    monkeypatch.setattr(row_bands, "GATHER_ROWS", 0)  # copies priced at nothing: a split is planned
    extents = (positions.amax(1) + 1).tolist()
    bands = plan_bands(causal, counts, groups, torch.float32, extents)
    assert len(bands) > 1 and any(band.members is not None for band in bands)  # the split is exercised
    # the banded requests see at most 227 keys: their bands read one block, or the shortest tail
    # covering them where this CPU allows one, or the whole cache where it is shorter than a block
    covering = [t for t in attention.invariant_key_tails() if t >= 227]
    expected = length if length < KEY_BLOCK else (covering[0] if covering else KEY_BLOCK)
    assert [band.mask.shape[-1] for band in bands if band.members is not None] == [expected] * (len(bands) - 1)
    assert bands[0].members is None and bands[0].mask.shape[-1] == length
    banded = banded_attention(q, keys, values, bands)
    whole = banded_attention(q, keys, values, [RowBand(0, rows, None, grouped_mask(causal, groups, torch.float32))])
    for b, count in enumerate(counts):
        assert torch.equal(banded[b, :count], whole[b, :count]), f"request {b}"


@pytest.mark.parametrize("rows", [2, 3])
def test_one_request_with_one_key_head_gets_the_bits_it_gets_in_a_batch(rows):
    """A call of one (request, key head) pair runs outside the flash kernel's parallel region, where
    the product it calls splits its work across threads and, at some sizes (6 and 9 folded rows
    here), sums in another order; invariant_attention then computes a second copy of the request.
    Two threads, as serving runs on a 2-core machine (the suite runs on one)."""
    generator = torch.Generator().manual_seed(8)
    keys, values = (torch.randn(2, 1, 512, 64, generator=generator) for _ in range(2))
    q = torch.randn(2 * rows, 3, 64, generator=generator)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        together = _attend_rows(q, keys, values, [rows, rows], [300, 200])
        alone = _attend_rows(q[:rows], keys[:1], values[:1], [rows], [300])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together[:rows], alone)
