"""Tiny random Llama targets: cached packed-row forwards must equal full recompute."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_core.errors import ModelError
from dspark_core.graphs import static_shapes
from dspark_core.models.base import ForwardBatch, make_forward_batch
from dspark_core.models.attention import (_default_attention, attend, context_block_attention, folded_attention, grouped_mask,
                                         set_attention_kernel)
from dspark_core.models.layers import apply_rope, apply_rope_, greedy_tokens, rope_constants, rope_cos_sin
from dspark_core.models.row_layout import RowLayout
from dspark_core.models.kv_cache import KVCache
from dspark_core.models.random_models import random_target, tiny_target_config
from dspark_core.models.reference import full_forward, greedy_generate, greedy_generate_batch

VARIANTS = {
    "llama": tiny_target_config(),
    "qwen2": tiny_target_config(architecture="qwen2", qkv_bias=True, tie_embeddings=False),
    "qwen3": tiny_target_config(architecture="qwen3", qk_norm=True, num_kv_heads=1),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def model(request):
    return random_target(VARIANTS[request.param], seed=3)


def test_decode_step_by_step_equals_full_recompute(model):
    tokens = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    ref, _ = full_forward(model, tokens)
    cache = model.new_cache(2, 16)
    rows = [model.forward(make_forward_batch([tokens[:4]], [0], [1]), cache).logits]
    for pos in range(4, len(tokens)):
        rows.append(model.forward(make_forward_batch([[tokens[pos]]], [pos], [1]), cache).logits)
    torch.testing.assert_close(torch.cat(rows), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_rope_gives_the_bits_of_the_textbook_rotate_half(dtype, head_dim):
    """apply_rope rolls the vector and takes the sign from its sine table: the same bits as
    ``x * cos + cat(-x2, x1) * sin`` with plain tables, at positions up to a long context."""
    positions = torch.arange(0, 4000, 7)
    x = torch.randn(positions.shape[0], 5, head_dim, generator=torch.Generator().manual_seed(head_dim)).to(dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]
    half = head_dim // 2
    textbook = x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
    assert torch.equal(apply_rope(x, *rope_cos_sin(positions, head_dim, 10000.0, dtype)), textbook)


def test_rope_tables_from_a_model_s_constants_are_the_tables_built_from_scratch():
    positions = torch.arange(0, 5000, 3)
    for head_dim, theta in ((64, 10000.0), (128, 500000.0)):
        constants = rope_constants(head_dim, theta, "cpu")
        for dtype in (torch.float32, torch.bfloat16):
            built, given = rope_cos_sin(positions, head_dim, theta, dtype), rope_cos_sin(positions, head_dim, theta, dtype, constants)
            assert all(torch.equal(a, b) for a, b in zip(built, given))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_rope_on_a_fused_projection_gives_the_bits_and_keeps_the_value_heads(dtype):
    """The target rotates the query and key heads of its fused projection's output in place: the bits
    apply_rope gives, and the value heads beside them untouched."""
    generator = torch.Generator().manual_seed(1)
    positions = torch.arange(0, 3000, 11)
    n, heads, kv_heads, head_dim = positions.shape[0], 9, 3, 64
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    before = qkv.clone()
    cos, sin = rope_cos_sin(positions, head_dim, 10000.0, dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(n, heads + kv_heads, head_dim)
    assert apply_rope_(qk, cos, sin) is qk
    expected = apply_rope(before[:, : (heads + kv_heads) * head_dim].view(n, heads + kv_heads, head_dim), cos, sin)
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], before[:, (heads + kv_heads) * head_dim :])


def test_one_indexed_write_stores_keys_and_values_as_two_writes_do():
    cache, other = (KVCache.allocate(2, 4, 8, 3, 5) for _ in range(2))
    generator = torch.Generator().manual_seed(2)
    kv_rows = torch.randn(3, 2, 3, 5, generator=generator)
    slots, positions = torch.tensor([2, 0, 2]), torch.tensor([1, 7, 2])
    cache.write_rows(1, slots, positions, kv_rows)
    other.write(1, slots, positions, kv_rows[:, 0], kv_rows[:, 1])
    assert torch.equal(cache.kv, other.kv) and cache.kv.any()
    assert torch.equal(cache.keys[1, 0, :, 7], kv_rows[1, 0]) and torch.equal(cache.values[1, 2, :, 2], kv_rows[2, 1])


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_varlen_batch_equals_per_request(data):
    model = random_target(VARIANTS["llama"], seed=5)
    n = data.draw(st.integers(1, 4), label="requests")
    seqs = [data.draw(st.lists(st.integers(0, 96), min_size=2, max_size=12), label=f"seq{b}") for b in range(n)]
    splits = [data.draw(st.integers(1, len(s) - 1), label=f"split{b}") for b, s in enumerate(seqs)]
    slots = data.draw(st.permutations(range(5)), label="slots")[:n]
    cache = model.new_cache(5, 16)
    # Prefill prefixes of different lengths together, then the remaining rows of every request together.
    model.forward(make_forward_batch([s[:k] for s, k in zip(seqs, splits)], [0] * n, slots), cache)
    batch = make_forward_batch([s[k:] for s, k in zip(seqs, splits)], splits, slots)
    out = model.forward(batch, cache, hidden_layers=(0, 2)).logits
    for b, s in enumerate(seqs):
        ref, _ = full_forward(model, s)
        got = out[batch.row_offsets[b] : batch.row_offsets[b + 1]]
        torch.testing.assert_close(got, ref[splits[b] :], atol=1e-4, rtol=1e-4)


def test_hidden_states_match_reference(model):
    tokens = [5, 6, 7, 8, 9]
    layers = (0, 1, model.config.num_layers)
    _, ref_hidden = full_forward(model, tokens, hidden_layers=layers)
    out = model.forward(make_forward_batch([tokens], [0], [0]), model.new_cache(1, 8), hidden_layers=layers)
    assert out.hidden.shape == (5, len(layers) * model.config.hidden_size)
    assert out.logits.dtype == torch.float32
    torch.testing.assert_close(out.hidden, ref_hidden, atol=1e-4, rtol=1e-4)


def test_hidden_layers_in_any_order_and_repeated_fill_their_own_columns(model):
    """Each asked-for layer's states land in its own columns, in the order asked, a repeat included."""
    batch = make_forward_batch([[5, 6, 7], [8, 9]], [0, 0], [0, 1])
    d = model.config.hidden_size
    alone = {i: model.forward(batch, model.new_cache(2, 8), hidden_layers=(i,)).hidden for i in (0, 2)}
    mixed = model.forward(batch, model.new_cache(2, 8), hidden_layers=(2, 0, 2)).hidden
    assert mixed.shape == (5, 3 * d)
    for column, layer in enumerate((2, 0, 2)):
        assert torch.equal(mixed[:, column * d : (column + 1) * d], alone[layer])


def test_logit_rows_select_rows_and_keep_every_hidden_state(model):
    """A prefill asks for each prompt's last row only: the same logits as the full forward's rows,
    while the hidden states (the draft's context) still cover every row."""
    prompts, slots = [[3, 4, 5, 6], [7, 8], [9, 10, 11]], [2, 0, 1]
    batch = make_forward_batch(prompts, [0, 0, 0], slots)
    full = model.forward(batch, model.new_cache(3, 8), hidden_layers=(1,))
    last = batch.row_offsets[1:] - 1
    picked = model.forward(batch, model.new_cache(3, 8), hidden_layers=(1,), logit_rows=last)
    assert picked.logits.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(picked.logits, full.logits[last], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(picked.hidden, full.hidden, atol=0, rtol=0)


def test_rejected_rows_need_no_rollback(model):
    prompt, accepted = [1, 2, 3], [4, 5]
    cache = model.new_cache(1, 16)
    model.forward(make_forward_batch([prompt], [0], [0]), cache)
    # A "verify" writes 4 rows; pretend only the first is accepted, then continue from there.
    model.forward(make_forward_batch([[accepted[0], 60, 61, 62]], [3], [0]), cache)
    got = model.forward(make_forward_batch([[accepted[1]]], [4], [0]), cache).logits
    ref, _ = full_forward(model, prompt + accepted)
    torch.testing.assert_close(got[0], ref[-1], atol=1e-4, rtol=1e-4)


def test_greedy_single_equals_batched():
    model = random_target(VARIANTS["qwen2"], seed=1)
    prompts = [[1, 2, 3], [9], [40, 41, 42, 43, 44]]
    batched = greedy_generate_batch(model, prompts, 6)
    assert batched == [greedy_generate(model, p, 6) for p in prompts]


def test_greedy_stops_at_eos():
    model = random_target(VARIANTS["llama"], seed=2)
    free = greedy_generate(model, [1, 2, 3], 8)
    stopped = greedy_generate(model, [1, 2, 3], 8, eos_token_ids=[free[2]])
    assert stopped == free[: free.index(free[2]) + 1]


def test_errors_are_clear():
    model = random_target(VARIANTS["llama"])
    cache = model.new_cache(1, 4)
    with pytest.raises(ModelError, match="position 5 does not fit"):
        model.forward(make_forward_batch([[1, 2]], [4], [0]), cache)
    with pytest.raises(ModelError, match="hidden layer index 9"):
        model.forward(make_forward_batch([[1]], [0], [0]), cache, hidden_layers=(9,))
    with pytest.raises(ValueError, match="at least one token"):
        make_forward_batch([[]], [0], [0])
    with pytest.raises(ModelError, match="context limit"):
        model.new_cache(1, 10_000)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_packed_linear_matches_f_linear_for_every_row_count(rows, monkeypatch):
    # without the packed oneDNN path, 2-3 rows are padded to 4 on the CPU (a faster BLAS path);
    # the padding must never leak out
    from dspark_core.models.layers import linear

    monkeypatch.setenv("DSPARK_CPU_LINEAR", "aten")
    gen = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 24, generator=gen), torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    out = linear(x, w, b)
    assert out.shape == (rows, 40)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)


def _forward_twice(model, batch_parts, padding_slot):
    """The same decode batch through the slot window (keys read in place) and through gathered keys."""
    import attrs

    from dspark_core.models import row_layout

    prefill, decode = batch_parts
    outputs, layouts = [], []
    build = row_layout.RowLayout.build
    for window in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(row_layout, "_MAX_WINDOW_SLOTS_PER_REQUEST", 2 if window else 0)
            patch.setattr(row_layout.RowLayout, "build",
                          classmethod(lambda cls, *a, **k: layouts.append(build(*a, **k)) or layouts[-1]))
            cache = model.new_cache(8, 24)
            model.forward(prefill, cache)
            outputs.append(model.forward(attrs.evolve(decode, padding_slot=padding_slot), cache, hidden_layers=(1,)))
    return outputs, layouts


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
def test_a_static_forward_reads_a_dense_cache_in_place_with_the_gathered_results(invariant, monkeypatch):
    """Static-shape mode reads every slot of a cache in place when the batch has a request for at
    least half of them (the largest bucket): the same logits for live rows as gathering each
    request's keys (bit for bit where forwards are batch-invariant), with requests on slots out of
    order, an empty entry and the padding request on the scratch slot, and a padding request longer
    than the row bound. The scratch slot, the cache's last, is left out of the read."""
    from dspark_core.models import row_layout

    model = random_target(VARIANTS["llama"], seed=11, batch_invariant=invariant)
    cache = model.new_cache(4, 40)
    model.forward(make_forward_batch([[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]], [0, 0, 0], [2, 0, 1]), cache)
    tokens = torch.tensor([20, 21, 22, 23, 24, 25] + [0] * 6)
    positions = torch.tensor([4, 5, 3, 5, 6, 7] + [0] * 6)
    # slots 2, 0, 1, an empty bucket entry on the scratch slot 3, and the padding request (6 rows) there
    batch = ForwardBatch(tokens, positions, torch.tensor([2, 0, 1, 3, 3]), torch.tensor([0, 2, 3, 6, 6, 12]),
                         padding_slot=3, max_request_rows=4)
    layouts = []
    build, window = RowLayout.build, RowLayout.static_window
    monkeypatch.setattr(RowLayout, "static_window", classmethod(lambda cls, *a, **k: layouts.append(window(*a, **k)) or layouts[-1]))
    with static_shapes():
        in_place = model.forward(batch, cache).logits
        monkeypatch.setattr(row_layout, "_MAX_WINDOW_SLOTS_PER_REQUEST", 0)
        gathered = model.forward(batch, cache).logits
    # slots 0-2 in place: the scratch slot (the last) gets no cell, and its padding rows read back cell 0
    assert len(layouts) == 1 and layouts[0].first_slot == 0 and tuple(layouts[0].pad_index.shape) == (3, 4)
    if invariant:
        assert torch.equal(in_place[:6], gathered[:6])
    else:
        torch.testing.assert_close(in_place[:6], gathered[:6])
    assert torch.isfinite(in_place).all()


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_slot_window_equals_gathered_keys_bit_for_bit(data):
    """Reading a run of cache slots in place (idle slots get dummy queries, padding requests come back
    as a copy of a live row) must give every live row exactly what gathering its slot's keys gives."""
    model = random_target(VARIANTS["llama"], seed=7)
    n = data.draw(st.integers(1, 4), label="live requests")
    slots = data.draw(st.permutations(range(7)), label="slots")[:n]
    padding = data.draw(st.integers(0, 2), label="padding requests")  # on slot 7, as the engine's scratch slot
    seqs = [data.draw(st.lists(st.integers(0, 96), min_size=2, max_size=10), label=f"seq{b}") for b in range(n)]
    rows = [data.draw(st.integers(1, 4), label=f"rows{b}") for b in range(n)]
    prefill = make_forward_batch(seqs, [0] * n, slots)
    new = [[(7 * b + j) % 90 for j in range(r)] for b, r in enumerate(rows)] + [[1, 2]] * padding
    decode = make_forward_batch(new, [len(s) for s in seqs] + [0] * padding, slots + [7] * padding)
    (windowed, gathered), layouts = _forward_twice(model, (prefill, decode), 7)
    live_rows = sum(rows)
    assert torch.equal(windowed.logits[:live_rows], gathered.logits[:live_rows])
    assert torch.equal(windowed.hidden[:live_rows], gathered.hidden[:live_rows])
    assert torch.isfinite(windowed.logits).all()  # padding rows: a copy of a live row, never NaN
    width = max(slots) - min(slots) + 1
    assert layouts[1].first_slot == (min(slots) if width <= 2 * n else None)  # the decode forward's layout
    assert layouts[3].first_slot is None


def test_a_bound_on_request_rows_sizes_static_attention_and_keeps_live_rows(monkeypatch):
    """A captured verify forward cannot read its row counts: with ``max_request_rows`` its attention
    is sized for that many rows per request, not the batch's; live rows keep their result and the
    padding request's rows past the bound (nine here, at position 0 of the scratch slot) stay finite.
    An eager forward refuses a live request above the bound."""
    model = random_target(VARIANTS["llama"], seed=5)
    cache = model.new_cache(8, 32)  # more than two slots per request: keys are gathered, not read in place
    model.forward(make_forward_batch([[5, 6, 7, 8], [9, 10, 11]], [0, 0], [0, 1]), cache)
    tokens = torch.tensor([12, 13, 14, 15, 16] + [0] * 9)
    positions = torch.tensor([4, 5, 6, 3, 4] + [0] * 9)
    batch = ForwardBatch(tokens, positions, torch.tensor([0, 1, 3]), torch.tensor([0, 3, 5, 14]), padding_slot=3)
    layouts = []
    build = RowLayout.build
    monkeypatch.setattr(RowLayout, "build", classmethod(lambda cls, *a, **k: layouts.append(build(*a, **k)) or layouts[-1]))
    reads = []
    read = type(cache).read
    monkeypatch.setattr(type(cache), "read", lambda self, layer, slots, length: reads.append(slots.tolist()) or read(self, layer, slots, length))
    with static_shapes():
        whole = model.forward(batch, cache).logits
        bounded = model.forward(attrs.evolve(batch, max_request_rows=4), cache).logits
        # the padding request is last: left out of attention, its keys are not gathered
        last = model.forward(attrs.evolve(batch, max_request_rows=4, padding_last=True), cache).logits
    assert [tuple(layout.pad_index.shape) for layout in layouts] == [(3, 14), (3, 4), (2, 4)]
    layers = model.config.num_layers
    assert reads == [[0, 1, 3]] * (2 * layers) + [[0, 1]] * layers
    torch.testing.assert_close(bounded[:5], whole[:5])
    torch.testing.assert_close(last[:5], whole[:5])
    assert torch.isfinite(bounded).all() and torch.isfinite(last).all()
    with pytest.raises(ModelError, match="padding_last=True needs the padding_slot"):
        attrs.evolve(batch, padding_slot=None, padding_last=True)
    with pytest.raises(ModelError, match="padding_last=True needs a request before the padding one"):
        ForwardBatch(tokens[9:], positions[9:], torch.tensor([3]), torch.tensor([0, 5]), padding_slot=3, padding_last=True)
    with pytest.raises(ModelError, match=r"request 0 \(slot 0\) has 3 rows, more than the batch's max_request_rows 2"):
        model.forward(attrs.evolve(batch, max_request_rows=2), cache)


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_grouped_attention_equals_per_head_softmax(data):
    """attend() folds the query heads sharing a key head into its rows: every row of every head
    must still get softmax(q k^T / sqrt(d)) v over its own request's keys up to its position,
    with query head h reading key head h // (H / KV)."""
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    kv_heads = data.draw(st.sampled_from([1, 2, 3]), label="kv heads")
    heads = kv_heads * data.draw(st.sampled_from([1, 2, 3]), label="group")
    counts = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3), label="rows per request")
    lengths = [data.draw(st.integers(0, 6), label=f"context{b}") for b in range(len(counts))]
    head_dim, requests = 4, len(counts)
    positions = torch.tensor([lengths[b] + j for b, c in enumerate(counts) for j in range(c)])
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    layout = RowLayout.build(positions, torch.arange(requests), offsets)
    keys = torch.randn(requests, kv_heads, layout.kv_len, head_dim, generator=generator)
    values = torch.randn(requests, kv_heads, layout.kv_len, head_dim, generator=generator)
    q = torch.randn(int(offsets[-1]), heads, head_dim, generator=generator)
    mask = grouped_mask(layout.causal_mask(), heads // kv_heads, q.dtype)
    for kernel in ("sdpa", "matmul"):  # SDPA, and the matmul form CUDA decode steps take
        set_attention_kernel(kernel)
        try:
            out = attend(q, keys, values, layout, mask)
            # one gather each way (RowLayout.head_folding) gives the bits of padding, folding and back
            padded = folded_attention(layout.pad(q), keys, values, mask, _default_attention)
            assert torch.equal(out, layout.unpad(padded).reshape(q.shape[0], -1))
        finally:
            set_attention_kernel("auto")
        row = 0
        for b, count in enumerate(counts):
            for j in range(count):
                seen = lengths[b] + j + 1
                for h in range(heads):
                    k, v = keys[b, h // (heads // kv_heads), :seen], values[b, h // (heads // kv_heads), :seen]
                    expected = torch.softmax(k @ q[row, h] / head_dim**0.5, dim=0) @ v
                    torch.testing.assert_close(out[row, h * head_dim : (h + 1) * head_dim], expected)
                row += 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 23], ids=["scored-apart", "sdpa-past-64-folded-rows"])
def test_context_block_attention_equals_a_softmax_over_context_and_block(dtype, rows):
    """A draft block's attention scores its context and its own keys apart under one softmax (SDPA on
    the joined keys past 64 folded rows per key head): every row of every query head gets
    softmax(q k^T / sqrt(d)) v over its visible context positions and every key of its block, with
    query head h reading key head h // (H / KV)."""
    g = torch.Generator().manual_seed(4)
    batch, heads, kv_heads, length, head_dim = 3, 6, 2, 9, 4
    q = torch.randn(batch, heads, rows, head_dim, generator=g)
    context = tuple(torch.randn(batch, kv_heads, length, head_dim, generator=g) for _ in range(2))
    block = tuple(torch.randn(batch, kv_heads, rows, head_dim, generator=g) for _ in range(2))
    sees = torch.rand(batch, length, generator=g) < 0.6
    sees[2] = False  # an empty context (a block at position 0) sees its block only
    out = context_block_attention(q.to(dtype), tuple(t.to(dtype) for t in context), tuple(t.to(dtype) for t in block), sees)
    assert out.dtype == dtype and out.shape == q.shape
    tolerance = {} if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for b in range(batch):
        for h in range(heads):
            kv = h // (heads // kv_heads)
            keys = torch.cat([context[0][b, kv, sees[b]], block[0][b, kv]])
            values = torch.cat([context[1][b, kv, sees[b]], block[1][b, kv]])
            for r in range(rows):
                expected = torch.softmax(keys @ q[b, h, r] / head_dim**0.5, dim=0) @ values
                torch.testing.assert_close(out[b, h, r].float(), expected, **tolerance)


def test_attention_kernel_choice():
    from dspark_core.models import attention

    q = torch.zeros(1, 1, attention.MATMUL_ATTENTION_MAX_ROWS, 4)
    assert not attention._matmul_attention_for(q)  # auto: SDPA off CUDA
    set_attention_kernel("matmul")
    try:
        assert attention._matmul_attention_for(q)
        with pytest.raises(ValueError, match="attention kernel 'flash': choose one of auto, sdpa, matmul"):
            set_attention_kernel("flash")
        assert attention._matmul_attention_for(q)  # a refused name changes nothing
    finally:
        set_attention_kernel("auto")


def test_model_decode_counts_aten_calls_per_forward(tmp_path):
    # benchmarks/model_decode.py --count_ops: the floor of a GPU step's kernel count, measured on the CPU
    from checkpoint_support import write_tiny_pair
    from script_support import load_script

    from dspark_core.models.loading import load_target

    module = load_script("model_decode")
    model = load_target(str(write_tiny_pair(tmp_path)[0]))
    one, four = module.ops_per_forward(model, 1, 8), module.ops_per_forward(model, 4, 8)
    layers = model.config.num_layers
    # every layer makes its norms, products, rotary, cache write/read and attention calls
    assert one >= 10 * layers and four >= 10 * layers
    assert abs(one - four) <= 4 * layers  # the count is per layer, not per request


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), vocab=st.integers(1, 300), levels=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_greedy_tokens_pick_argmax_first_index_under_ties(rows, vocab, levels, seed):
    # few distinct values make ties common: the engine's greedy token must still be argmax's (the
    # first maximal index), or speculative and target-only decoding could part on a tie
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(levels, (rows, vocab), generator=g).float()
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    wide = torch.randn(2, 3, 49152, generator=g)
    wide[0, 1, 7] = wide[0, 1, 40000] = wide.max() + 1  # a tie far apart in a SmolLM2-sized row
    assert torch.equal(greedy_tokens(wide), wide.argmax(dim=-1))
    assert int(greedy_tokens(wide)[0, 1]) == 7


def test_the_cuda_residual_product_adds_inside_the_product_with_the_separate_results():
    """On CUDA a layer's output projections add into the residual inside the product (an in-place
    ``addmm_``, one kernel): forced on here, the logits match the separate product and add, and a bad
    name is refused."""
    from dspark_core.models import layers

    model = random_target(VARIANTS["llama"], seed=9, batch_invariant=False)
    batch = make_forward_batch([[5, 6, 7, 8, 9], [10, 11]], [0, 0], [0, 1])
    outputs = {}
    for mode in ("fused", "separate"):
        layers.set_residual_product(mode)
        try:
            outputs[mode] = model.forward(batch, model.new_cache(2, 16), hidden_layers=(0, 1, 2))
        finally:
            layers.set_residual_product("auto")
    torch.testing.assert_close(outputs["fused"].logits, outputs["separate"].logits, atol=1e-5, rtol=1e-5)
    # the saved hidden states are the residual stream after their layer, not after the last one
    torch.testing.assert_close(outputs["fused"].hidden, outputs["separate"].hidden, atol=1e-5, rtol=1e-5)
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        addmm_ = torch.Tensor.addmm_
        patch.setattr(torch.Tensor, "addmm_", lambda self, *a, **k: calls.append(self) or addmm_(self, *a, **k))
        layers.set_residual_product("fused")
        try:
            model.forward(batch, model.new_cache(2, 16))
        finally:
            layers.set_residual_product("auto")
    assert len(calls) == 2 * model.config.num_layers  # attention output and MLP down, every layer
    with pytest.raises(ValueError, match="residual product 'both': choose one of auto, fused, separate"):
        layers.set_residual_product("both")
