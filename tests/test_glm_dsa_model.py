"""GLM-DSA target on CPU: cached prefill/decode/verify equal a cache-free recompute, the indexer
really selects, packed multi-request batches behave, and HF checkpoints load by their published names."""

from __future__ import annotations

import json

import pytest
import torch

from dspark_core.errors import ModelError
from dspark_core.models.base import ForwardBatch, make_forward_batch
from dspark_core.models.glm_dsa import GlmDsaTarget, read_glm_dsa_dir
from dspark_core.models.glm_dsa.reference import full_forward
from dspark_core.models.glm_dsa.tiny import (hf_config_dict, random_glm_dsa_target, random_glm_dsa_tensors,
                                             save_hf_checkpoint, tiny_glm_dsa_config)
from dspark_core.models.loading import load_target
from dspark_core.models.reference import greedy_generate

TOL = 1e-9


def tokens(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def cached_logits(model, toks, chunks):
    """Prefill the first chunk, then feed the rest chunk by chunk (decode = 1, verify > 1 rows)."""
    cache = model.new_cache(3, 64)
    outs, start = [], 0
    for size in chunks:
        outs.append(model.forward(make_forward_batch([toks[start:start + size]], [start], [2]), cache).logits)
        start += size
    return torch.cat(outs)


@pytest.fixture(scope="module")
def model():
    return random_glm_dsa_target(tiny_glm_dsa_config(), seed=0, dtype=torch.float64)


def test_prefill_decode_and_verify_equal_full_recompute(model):
    toks = tokens(30)
    ref, _ = full_forward(model, toks)
    got = cached_logits(model, toks, [12, 1, 1, 5, 1, 8, 2])  # prefill, decodes, verify blocks
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=TOL, rtol=0)


def test_logit_rows_select_rows(model):
    batch = make_forward_batch([tokens(7, 8), tokens(5, 9)], [0, 0], [1, 0])
    full = model.forward(batch, model.new_cache(3, 16), hidden_layers=(2,))
    rows = torch.tensor([6, 11])
    picked = model.forward(batch, model.new_cache(3, 16), hidden_layers=(2,), logit_rows=rows)
    torch.testing.assert_close(picked.logits, full.logits[rows], atol=TOL, rtol=0)
    torch.testing.assert_close(picked.hidden, full.hidden, atol=0, rtol=0)


def test_interleaved_rope_and_biases_match_the_reference():
    cfg = tiny_glm_dsa_config(rope_interleave=True, attention_bias=True, n_group=1, topk_group=1, scoring_func="softmax",
                              indexer_types=("full", "full", "shared"), mlp_layer_types=("dense", "dense", "sparse"))
    m = random_glm_dsa_target(cfg, seed=4, dtype=torch.float64)
    toks = tokens(25, seed=2)
    torch.testing.assert_close(cached_logits(m, toks, [10, 1, 7, 1, 6]), full_forward(m, toks)[0], atol=TOL, rtol=0)


def test_topk_covering_the_context_is_dense_attention_and_small_topk_is_not():
    toks = tokens(40, seed=3)
    cfg = tiny_glm_dsa_config(index_topk=64)
    wide = random_glm_dsa_target(cfg, seed=5, dtype=torch.float64)
    dense = full_forward(wide, toks, index_topk=10_000)[0]
    torch.testing.assert_close(cached_logits(wide, toks, [40]), dense, atol=TOL, rtol=0)
    narrow = GlmDsaTarget(tiny_glm_dsa_config(index_topk=4), random_glm_dsa_tensors(cfg, seed=5), dtype=torch.float64)
    sparse = cached_logits(narrow, toks, [20, 1, 1, 18])
    torch.testing.assert_close(sparse, full_forward(narrow, toks)[0], atol=TOL, rtol=0)
    assert torch.allclose(sparse[:4], dense[:4], atol=TOL)  # four or fewer positions: nothing to drop
    assert (sparse[8:] - dense[8:]).abs().amax(dim=-1).min() > 1e-3  # every longer row lost something


def test_packed_requests_with_empty_ones_match_single_runs(model):
    prompts = [tokens(9, 5), tokens(17, 6), tokens(4, 7)]
    singles = [full_forward(model, p)[0] for p in prompts]
    cache = model.new_cache(5, 48)
    flat = [t for p in prompts for t in p]
    offsets = [0, 0, 9, 26, 26, 30]  # requests 0 and 3 contribute no rows
    batch = ForwardBatch(torch.tensor(flat), torch.tensor([i for p in prompts for i in range(len(p))]),
                         torch.tensor([4, 0, 3, 1, 2]), torch.tensor(offsets))
    out = model.forward(batch, cache, hidden_layers=(0, 2, 3))
    torch.testing.assert_close(out.logits, torch.cat(singles), atol=TOL, rtol=0)
    assert out.hidden.shape == (30, 3 * model.config.hidden_size)
    _, hidden = full_forward(model, prompts[1], hidden_layers=(0, 2, 3))
    torch.testing.assert_close(out.hidden[9:26], hidden, atol=TOL, rtol=0)
    # a decode step of the three requests together, then compare with the single references
    nxt = [int(s[-1].argmax()) for s in singles]
    step = model.forward(make_forward_batch([[t] for t in nxt], [9, 17, 4], [0, 3, 2]), cache).logits
    for b, p in enumerate(prompts):
        torch.testing.assert_close(step[b], full_forward(model, p + [nxt[b]])[0][-1], atol=TOL, rtol=0)


def test_greedy_generate_runs_and_cache_limits_are_checked(model):
    out = greedy_generate(model, tokens(6), 10)
    assert len(out) == 10 and all(0 <= t < model.config.vocab_size for t in out)
    with pytest.raises(ModelError, match="does not fit"):
        model.forward(make_forward_batch([[1]], [64], [0]), model.new_cache(1, 64))
    with pytest.raises(ModelError, match="context limit"):
        model.new_cache(1, model.config.max_position + 1)
    with pytest.raises(ModelError, match="hidden layer index"):
        model.forward(make_forward_batch([[1]], [0], [0]), model.new_cache(1, 4), hidden_layers=(4,))


@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked-experts"])
def test_hf_directory_loads_through_the_family_plugin(tmp_path, stacked):
    cfg = tiny_glm_dsa_config(eos_token_ids=(3,))
    tensors = random_glm_dsa_tensors(cfg, seed=8, stacked_experts=stacked)
    tensors["model.layers.3.self_attn.q_a_proj.weight"] = torch.zeros(2, 2)  # an extra (MTP) layer is skipped
    save_hf_checkpoint(cfg, tensors, tmp_path)
    loaded = load_target(tmp_path, dtype=torch.float64)
    assert isinstance(loaded, GlmDsaTarget) and loaded.config == cfg and loaded.tokenizer is None
    direct = GlmDsaTarget(cfg, tensors, dtype=torch.float64)
    toks = tokens(15)
    torch.testing.assert_close(full_forward(loaded, toks)[0], full_forward(direct, toks)[0], atol=0, rtol=0)


def test_config_translation_defaults_and_errors(tmp_path):
    raw = hf_config_dict(tiny_glm_dsa_config())
    for key in ("mlp_layer_types", "indexer_types"):
        raw.pop(key)
    raw.update(first_k_dense_replace=1, index_topk_pattern="FSF")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    from dspark_core.models.glm_dsa.config import glm_dsa_config_from_hf
    cfg = glm_dsa_config_from_hf(raw, tmp_path / "config.json")
    assert cfg.mlp_layer_types == ("dense", "sparse", "sparse") and cfg.indexer_types == ("full", "shared", "full")
    with pytest.raises(ModelError, match="rope type 'yarn'"):
        glm_dsa_config_from_hf({**raw, "rope_parameters": {"rope_type": "yarn", "factor": 4}}, tmp_path)
    with pytest.raises(ModelError, match="quantized"):
        glm_dsa_config_from_hf({**raw, "quantization_config": {"quant_method": "fp8"}}, tmp_path)
    with pytest.raises(ModelError, match="not a GLM-DSA"):
        glm_dsa_config_from_hf({**raw, "model_type": "llama"}, tmp_path)
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        read_glm_dsa_dir(tmp_path)


def test_bfloat16_forward_runs_and_tracks_float32():
    """The NPU default dtype: scores/softmax/router run in float32 inside, outputs stay close."""
    cfg = tiny_glm_dsa_config(index_topk=64)  # dense selection: no bf16-induced selection flips
    tensors = random_glm_dsa_tensors(cfg, seed=9)
    toks = tokens(20, seed=4)
    low = cached_logits(GlmDsaTarget(cfg, tensors, dtype=torch.bfloat16), toks, [12, 1, 7])
    high = cached_logits(GlmDsaTarget(cfg, tensors, dtype=torch.float32), toks, [12, 1, 7])
    assert low.dtype == torch.float32 and torch.isfinite(low).all()
    assert (low - high).abs().max() < 0.1 * high.abs().max()


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "glm_dsa", "deepseek_v32", "GLM_MOE_DSA"])
def test_family_plugin_is_registered_for_each_architecture(arch):
    from dspark_core.plugins import default_hooks
    from dspark_plugins.models.glm_dsa import GlmDsaFamily

    hooks = default_hooks()
    assert isinstance(hooks.model_family(arch), GlmDsaFamily)
    assert "glm_dsa" in {c.name for c in hooks.components("model_family")}


def static_model(seed: int = 0, **overrides) -> GlmDsaTarget:
    m = random_glm_dsa_target(tiny_glm_dsa_config(**overrides), seed=seed, dtype=torch.float64)
    m.static_shapes = True
    return m


def test_static_shape_mode_equals_the_reference():
    """The graph-capture forward (each row alone, full cache scan, every expert run) computes the same."""
    m = static_model(seed=0)
    toks = tokens(30)
    torch.testing.assert_close(cached_logits(m, toks, [12, 1, 1, 5, 1, 8, 2]), full_forward(m, toks)[0], atol=TOL, rtol=0)
    prompts = [tokens(9, 5), tokens(4, 7)]
    batch = ForwardBatch(torch.tensor(prompts[0] + prompts[1]), torch.tensor(list(range(9)) + list(range(4))),
                         torch.tensor([2, 0, 1]), torch.tensor([0, 9, 9, 13]))  # middle request: no rows
    out = m.forward(batch, m.new_cache(3, 16), hidden_layers=(1,))
    torch.testing.assert_close(out.logits, torch.cat([full_forward(m, p)[0] for p in prompts]), atol=TOL, rtol=0)


def test_static_shape_forward_has_no_host_reads_or_dynamic_shapes():
    """Traced whole with torch.compile(fullgraph=True): any .item(), .tolist(), nonzero or unique
    (what a device graph cannot record) would be a graph break and raise here."""
    m = static_model(seed=1)
    cache = m.new_cache(3, 32)

    @torch.no_grad()
    def verify(batch):
        logits, hidden = m.forward_tensors(batch, cache, hidden_layers=(1, 3))
        return logits.argmax(-1), hidden

    batch = make_forward_batch([[5, 6, 7], [8, 9]], [4, 2], [0, 2])
    traced = torch.compile(verify, fullgraph=True, backend="eager", dynamic=False)
    got, hidden = traced(batch)
    want, want_hidden = verify(batch)
    assert got.tolist() == want.tolist()
    torch.testing.assert_close(hidden, want_hidden, atol=TOL, rtol=0)
