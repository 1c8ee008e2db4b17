"""Tiny random DSpark drafts: proposal contracts, checkpoint round trip, malformed checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_core.errors import ModelError
from dspark_core.models.base import make_forward_batch
from dspark_core.models.random_models import random_draft, random_target, tiny_target_config
from dspark_core.models.speculators_io import load_draft, save_draft

CFG = tiny_target_config(num_layers=4)
PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11, 12]]
SLOTS = [2, 0, 3]


@pytest.fixture(scope="module")
def target():
    return random_target(CFG, seed=11)


def prime(target, draft):
    """Prefill the target, feed its hidden states to the draft; return anchors (next greedy tokens)."""
    cache = target.new_cache(4, 32)
    draft.allocate_context(4, 32)
    batch = make_forward_batch(PROMPTS, [0, 0, 0], SLOTS)
    out = target.forward(batch, cache, hidden_layers=draft.config.aux_layer_ids)
    draft.extend_context(out.hidden, batch.positions, torch.repeat_interleave(batch.slot_ids, batch.row_offsets.diff()))
    anchors = out.logits[batch.row_offsets[1:] - 1].argmax(-1)
    return anchors, torch.tensor([len(p) for p in PROMPTS]), torch.tensor(SLOTS)


VARIANTS = [
    dict(markov_head_type="vanilla"),
    dict(markov_head_type="gated", draft_vocab_size=40),
    dict(markov_head_type="rnn", sample_from_anchor=False, block_size=5),
    dict(markov_rank=0, num_layers=2),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={v[k]}" for k in v))
def test_proposal_contract_and_round_trip(target, variant, tmp_path):
    draft = random_draft(CFG, seed=4, **variant).bind_target(target)
    anchors, positions, slots = prime(target, draft)
    tokens, conf = draft.propose(anchors, positions, slots)
    k = draft.config.num_speculative_tokens
    assert tokens.shape == (3, k) and tokens.dtype == torch.int64
    assert conf.shape == (3, k) and conf.dtype == torch.float32
    assert int(tokens.min()) >= 0 and int(tokens.max()) < CFG.vocab_size
    assert bool(((conf > 0) & (conf < 1)).all())
    if draft.d2t is not None:  # subset vocabulary: only kept ids can be proposed
        assert bool(draft.t2d[tokens].all())
    # Teacher forcing with the proposals themselves reproduces the greedy choices and confidences.
    prev = torch.cat([anchors[:, None], tokens[:, :-1]], dim=1)
    block = draft.forward_block(prev, positions, slots)
    assert block.logits.shape == (3, k, draft.config.draft_vocab_size)
    assert torch.equal(draft.draft_to_target()[block.logits.argmax(-1)], tokens)
    torch.testing.assert_close(draft.confidence(block.confidence_logits), conf)
    save_draft(draft, tmp_path / "ckpt", verifier="tiny")
    again = load_draft(tmp_path / "ckpt").bind_target(target)
    prime(target, again)
    tokens2, conf2 = again.propose(anchors, positions, slots)
    assert torch.equal(tokens2, tokens) and torch.equal(conf2, conf)


def test_context_only_before_anchor_matters(target):
    """Rows at or after the anchor (e.g. rejected drafts) must not change the proposal."""
    draft = random_draft(CFG, seed=6).bind_target(target)
    anchors, positions, slots = prime(target, draft)
    before = draft.propose(anchors, positions, slots)
    junk = torch.randn(3, len(draft.config.aux_layer_ids) * CFG.hidden_size)
    draft.extend_context(junk, positions, slots)  # written exactly at the anchor positions
    after = draft.propose(anchors, positions, slots)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    draft.extend_context(junk, positions - 1, slots)  # overwrite real context: now it must matter
    assert not torch.equal(draft.propose(anchors, positions, slots)[1], before[1])


def test_sts_temperatures_scale_confidence_logits(target, tmp_path):
    draft = random_draft(CFG, seed=8, sts_temperatures=(1.0, 2.0, 0.5, 4.0)).bind_target(target)
    anchors, positions, slots = prime(target, draft)
    _, conf = draft.propose(anchors, positions, slots)
    tokens, _ = draft.propose(anchors, positions, slots)
    prev = torch.cat([anchors[:, None], tokens[:, :-1]], dim=1)
    raw = draft.forward_block(prev, positions, slots).confidence_logits
    torch.testing.assert_close(conf, torch.sigmoid(raw / torch.tensor([1.0, 2.0, 0.5, 4.0])))
    save_draft(draft, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dspark_core"]["sts_temperatures"] == [1.0, 2.0, 0.5, 4.0]
    assert load_draft(tmp_path).config.sts_temperatures == (1.0, 2.0, 0.5, 4.0)


def test_sample_from_anchor_inferred_from_speculative_tokens(tmp_path):
    save_draft(random_draft(CFG, sample_from_anchor=False, block_size=5), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["sample_from_anchor"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_draft(tmp_path).config.num_speculative_tokens == 4


@pytest.fixture
def saved(tmp_path) -> Path:
    save_draft(random_draft(CFG, draft_vocab_size=40), tmp_path)
    return tmp_path


def edit_config(path: Path, fn) -> None:
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_config_key(saved):
    edit_config(saved, lambda c: c.pop("mask_token_id"))
    with pytest.raises(ModelError, match="'mask_token_id' is missing"):
        load_draft(saved)


def test_missing_layer_config_key(saved):
    edit_config(saved, lambda c: c["transformer_layer_config"].pop("hidden_size"))
    with pytest.raises(ModelError, match=r"transformer_layer_config\.'hidden_size' is missing"):
        load_draft(saved)


def test_wrong_model_type(saved):
    edit_config(saved, lambda c: c.update(speculators_model_type="eagle3"))
    with pytest.raises(ModelError, match="expected 'dspark'"):
        load_draft(saved)


def test_wrong_weight_shape(saved):
    tensors = load_file(str(saved / "model.safetensors"))
    tensors["fc.weight"] = tensors["fc.weight"][:, :-1].contiguous()
    save_file(tensors, str(saved / "model.safetensors"))
    with pytest.raises(ModelError, match="'fc.weight' has shape"):
        load_draft(saved)


def test_missing_weight(saved):
    tensors = load_file(str(saved / "model.safetensors"))
    del tensors["markov_head.markov_w1.weight"]
    save_file(tensors, str(saved / "model.safetensors"))
    with pytest.raises(ModelError, match="missing weight.*markov_w1"):
        load_draft(saved)


def test_missing_files(saved, tmp_path):
    (saved / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        load_draft(saved)
    (saved / "config.json").unlink()
    with pytest.raises(ModelError, match="config.json: file not found"):
        load_draft(saved)
    with pytest.raises(ModelError, match="directory not found"):
        load_draft(tmp_path / "nope")


def test_unbound_draft_refuses(target):
    draft = random_draft(CFG)
    with pytest.raises(ModelError, match="bind_target"):
        draft.propose(torch.tensor([1]), torch.tensor([1]), torch.tensor([0]))
    wrong = random_target(tiny_target_config(hidden_size=16, head_dim=4))
    with pytest.raises(ModelError, match="does not fit target"):
        draft.bind_target(wrong)
