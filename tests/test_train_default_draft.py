"""The shipped default draft for SmolLM2 (uses the real model: slow)."""

import json

import pytest
import torch

from dspark_core.errors import ModelError
from dspark_core.models.drafts import default_draft_path, resolve_draft_path


def test_default_draft_path_resolution(tmp_path):
    path = default_draft_path("smollm2")
    assert path.name == "smollm2" and (path / "config.json").is_file()
    assert default_draft_path("/somewhere/SmolLM2-135M-Instruct.Q4_1.gguf") == path
    assert resolve_draft_path("default", "smollm2") == path
    assert resolve_draft_path(tmp_path, "smollm2") == tmp_path
    with pytest.raises(ModelError, match="no default draft"):
        default_draft_path("llama-70b")


def test_shipped_artifact_is_small_and_calibrated():
    path = default_draft_path("smollm2")
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size <= 30 * 1024 * 1024
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dspark" and cfg["block_size"] == 7 and cfg["sample_from_anchor"]
    temps = cfg["dspark_core"]["sts_temperatures"]
    assert len(temps) == 7 and all(t > 0 for t in temps)


@pytest.mark.slow
def test_default_draft_binds_to_smollm2_and_proposes():
    from dspark_core.models.base import make_forward_batch
    from dspark_core.models.loading import load_target
    from dspark_core.models.speculators_io import load_draft

    target = load_target("smollm2")
    draft = load_draft(default_draft_path("smollm2")).bind_target(target)
    assert draft.fc.weight.dtype == torch.float32
    tok = target.tokenizer
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
                 "How do I reverse a list in Python?", "Explain photosynthesis in one sentence.", "Say hello in Spanish."]
    prompts = [tok.encode_chat(q) for q in questions]
    b, n = len(prompts), max(map(len, prompts)) + 16
    cache = target.new_cache(b, n)
    batch = make_forward_batch(prompts, [0] * b, list(range(b)))
    out = target.forward(batch, cache, hidden_layers=draft.config.aux_layer_ids)
    draft.allocate_context(b, n)
    draft.extend_context(out.hidden, batch.positions, torch.repeat_interleave(batch.slot_ids, batch.row_offsets.diff()))
    anchor = out.logits[batch.row_offsets[1:] - 1].argmax(-1)  # the target's first answer token
    positions = torch.tensor([len(p) for p in prompts])
    tokens, conf = draft.propose(anchor, positions, torch.arange(b))
    assert tokens.shape == (b, 7) and conf.shape == (b, 7)
    assert tokens.dtype == torch.long and int(tokens.min()) >= 0 and int(tokens.max()) < target.config.vocab_size
    assert bool(((conf > 0) & (conf < 1)).all())
    # the target's own next token after the anchor: a trained draft gets some first proposals right (a random one: none)
    rows = [p + [int(a)] for p, a in zip(prompts, anchor)]
    nxt = target.forward(make_forward_batch([[r[-1]] for r in rows], positions.tolist(), list(range(b))), cache).logits.argmax(-1)
    assert int((tokens[:, 0] == nxt).sum()) >= 1, (tokens[:, 0].tolist(), nxt.tolist())
