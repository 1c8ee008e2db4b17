"""Shrinking a draft's vocabulary: same proposals where the kept tokens suffice, a clean CLI."""

import json

import pytest
import torch

from dspark_core.cli import main
from dspark_core.errors import ConfigError
from dspark_core.models.base import make_forward_batch
from dspark_core.models.random_models import random_draft, random_target, tiny_target_config
from dspark_core.models.speculators_io import load_draft, save_draft
from dspark_core.train.features import FeatureSet
from dspark_core.train.vocab import keep_most_frequent, shard_token_scores, shrink_vocabulary


def _models(draft_vocab=60, lm_head=False):
    cfg = tiny_target_config(max_position=128)
    target = random_target(cfg, seed=3, dtype=torch.float64)
    draft = random_draft(cfg, seed=3, block_size=5, draft_vocab_size=draft_vocab).to(torch.float64)
    with torch.no_grad():  # a non-zero Markov head, so its sliced rows matter
        draft.markov_head.markov_w2.weight.normal_(0.0, 0.5)
    if lm_head:
        draft.lm_head = torch.nn.Parameter(torch.randn(draft_vocab, cfg.hidden_size, dtype=torch.float64), requires_grad=False)
    return target, draft


def _propose(draft, target, prompts):
    """Proposals and confidences of every request's block after its prompt."""
    draft.bind_target(target).allocate_context(len(prompts), 64)
    cache = target.new_cache(len(prompts), 64)
    batch = make_forward_batch(prompts, [0] * len(prompts), list(range(len(prompts))))
    out = target.forward(batch, cache, hidden_layers=draft.config.aux_layer_ids)
    slots = torch.tensor([s for s, p in enumerate(prompts) for _ in p])
    draft.extend_context(out.hidden, batch.positions, slots)
    anchors = torch.tensor([p[-1] for p in prompts])
    return draft.propose(anchors, torch.tensor([len(p) - 1 for p in prompts]), torch.arange(len(prompts)))


@pytest.mark.parametrize("lm_head", [False, True])
def test_shrunk_draft_proposes_the_same_blocks_when_its_tokens_are_kept(lm_head):
    target, draft = _models(lm_head=lm_head)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 90, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (24,), generator=g)]
    tokens, conf = _propose(draft, target, prompts)
    proposed = torch.unique(tokens)
    others = draft.draft_to_target()[~torch.isin(draft.draft_to_target(), proposed)]
    # keep every proposed token and drop half of the others: each block must come out unchanged
    keep = torch.cat([proposed, others[::2]]).sort().values
    small = shrink_vocabulary(draft, keep)
    assert small.config.draft_vocab_size == keep.numel() < draft.config.draft_vocab_size
    assert torch.equal(small.draft_to_target(), keep)
    small_tokens, small_conf = _propose(small, target, prompts)
    assert torch.equal(small_tokens, tokens)
    assert torch.allclose(small_conf, conf)
    # dropping a proposed token changes the blocks that proposed it, and only to kept tokens
    dropped = tokens[0, 0]
    fewer = keep[keep != dropped]
    fewer_tokens, _ = _propose(shrink_vocabulary(draft, fewer), target, prompts)
    assert fewer_tokens[0, 0] != dropped
    assert torch.isin(fewer_tokens, fewer).all()


def test_keep_most_frequent_ranks_by_score_with_ties_to_the_smaller_id():
    _, draft = _models(draft_vocab=10)
    ids = draft.draft_to_target()
    scores = torch.zeros(draft.config.target_vocab_size, dtype=torch.float64)
    scores[ids[7]], scores[ids[2]] = 5.0, 3.0  # the rest tie at 0: the smallest id goes first
    outside = [t for t in range(97) if t not in ids.tolist()][0]
    scores[outside] = 100.0  # a token outside the draft vocabulary is never kept
    assert keep_most_frequent(draft, scores, 3).tolist() == sorted([ids[7].item(), ids[2].item(), ids[0].item()])
    with pytest.raises(ConfigError, match="--draft_vocab must be in 1..10"):
        keep_most_frequent(draft, scores, 11)


def test_shrink_rejects_tokens_outside_the_draft_vocabulary():
    _, draft = _models(draft_vocab=10)
    outside = [t for t in range(97) if t not in draft.draft_to_target().tolist()][0]
    with pytest.raises(ConfigError, match="inside the draft's vocabulary"):
        shrink_vocabulary(draft, torch.tensor([outside]))


def _write_shard(directory, tokens, prompt_len):
    n = len(tokens)
    feats = FeatureSet(tokens=torch.tensor(tokens), offsets=torch.tensor([0, n]), prompt_lens=torch.tensor([prompt_len]),
                       hidden=torch.zeros(n, 4, dtype=torch.float16), topk_ids=torch.zeros(n, 1, dtype=torch.long),
                       topk_probs=torch.zeros(n, 1, dtype=torch.float16))
    directory.mkdir(parents=True, exist_ok=True)
    torch.save({"prompts": [tokens[:prompt_len]], "answers": [tokens[prompt_len:]], "features": feats.to_dict()},
               directory / "part-00000-1.pt")


def test_shrink_draft_command_scores_the_training_shards(tmp_path, capsys):
    target, draft = _models(draft_vocab=30)
    src = tmp_path / "draft"
    save_draft(draft.float(), src, verifier="tiny")
    ids = draft.draft_to_target().tolist()
    frequent = ids[5:9]
    _write_shard(tmp_path / "shards", [ids[0]] * 3 + frequent * 6 + [ids[1]], prompt_len=3)
    out = tmp_path / "small"
    assert main(["shrink-draft", f"--draft_model={src}", f"--features={tmp_path / 'shards'}", "--draft_vocab=5",
                 f"--output={out}", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["draft_vocab_before"] == 30 and report["draft_vocab_after"] == 5 and report["shards"] == 1
    small = load_draft(out)
    # the four answer tokens, then the answer token seen once (prompt tokens weigh a tenth)
    assert small.draft_to_target().tolist() == sorted(frequent + [ids[1]])
    assert json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == "tiny"


@pytest.mark.parametrize("args, message", [
    (["--draft_vocab=5"], "no such directory"),
    (["--draft_vocab=0"], "--draft_vocab must be in 1..30"),
    (["--draft_vocab=5", "same"], "is the input draft"),
])
def test_shrink_draft_command_errors_name_the_flag(tmp_path, capsys, args, message):
    _, draft = _models(draft_vocab=30)
    save_draft(draft.float(), tmp_path / "draft")
    _write_shard(tmp_path / "shards", draft.draft_to_target().tolist()[:6], prompt_len=2)
    features = tmp_path / ("missing" if message == "no such directory" else "shards")
    output = tmp_path / ("draft" if "same" in args else "out")
    argv = ["shrink-draft", f"--draft_model={tmp_path / 'draft'}", f"--features={features}", f"--output={output}",
            *[a for a in args if a != "same"]]
    assert main(argv) != 0
    assert message in capsys.readouterr().err


def test_shard_scores_refuse_an_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no feature shards"):
        shard_token_scores([tmp_path / "empty"], 97)


def test_train_draft_vocab_defaults_to_the_starting_drafts_own(tmp_path):
    """Fine-tuning a shrunk draft needs no --draft_vocab; a fresh draft keeps 24576; the flag wins."""
    import argparse

    from dspark_core.commands import train_draft

    _, draft = _models(draft_vocab=30)
    save_draft(draft.float(), tmp_path / "small")
    parser = argparse.ArgumentParser()
    train_draft.add_arguments(parser)
    vocab = lambda *argv: train_draft.options_from_args(parser.parse_args(list(argv))).draft_vocab  # noqa: E731
    assert vocab(f"--init_draft={tmp_path / 'small'}") == 30
    assert vocab() == 24576
    assert vocab(f"--init_draft={tmp_path / 'small'}", "--draft_vocab=20") == 20
