"""Tiny-mode draft training: the loss falls, checkpoints round-trip, blocks match the serving maths."""

import argparse

import pytest
import torch

from dspark_core.errors import ModelError
from dspark_core.models.base import make_forward_batch
from dspark_core.models.random_models import random_draft, random_target
from dspark_core.models.speculators_io import load_draft
from dspark_core.train.blocks import train_blocks
from dspark_core.train.options import PipelineOptions
from dspark_core.train.pipeline import run_pipeline
from dspark_core.train.train import TrainSettings


def tiny_options(out, steps=60, **kw):
    settings = TrainSettings(steps=steps, seqs_per_step=4, anchors_per_seq=8, lr=3e-3, warmup=5, save_every=1000, seed=kw.pop("seed", 0))
    return PipelineOptions(output=out, prompts=24, heldout=6, max_tokens=40, gen_batch=8, block_size=4, draft_vocab=64,
                           markov_rank=8, tiny=True, settings=settings, **kw)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-run")
    draft, target, losses, held = run_pipeline(tiny_options(out), progress=False, log=lambda m: None)
    return out, draft, target, losses, held


def test_tiny_training_lowers_the_loss(trained):
    _, _, _, losses, held = trained
    assert len(losses) == 60
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.8 * first, (first, last)
    assert held.is_file() and len(held.read_text().splitlines()) == 6


def test_checkpoint_round_trip_gives_identical_proposals(trained):
    out, draft, target, _, _ = trained
    loaded = load_draft(out / "draft").bind_target(target)
    assert loaded.config == draft.config
    assert torch.equal(loaded.d2t, draft.d2t)
    # the draft is stored in float16: compare against the same rounding of the in-memory weights
    ref = load_draft(out / "draft").bind_target(target)
    ref.load_state_dict({k: v.half().float() if v.is_floating_point() else v for k, v in draft.state_dict().items()})
    prompt = torch.randint(0, 90, (2, 12), generator=torch.Generator().manual_seed(1))
    cache = target.new_cache(2, 32)
    hid = target.forward(make_forward_batch(prompt.tolist(), [0, 0], [0, 1]), cache, hidden_layers=draft.config.aux_layer_ids).hidden
    results = []
    for d in (loaded, ref):
        d.allocate_context(2, 32)
        d.extend_context(hid, torch.arange(12).repeat(2), torch.tensor([0] * 12 + [1] * 12))
        results.append(d.propose(prompt[:, -1], torch.tensor([11, 11]), torch.tensor([0, 1])))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.allclose(results[0][1], results[1][1])
    assert results[0][0].shape == (2, 4)


def test_resume_continues_from_the_checkpoint(tmp_path):
    opts = tiny_options(tmp_path, steps=12)
    _, _, straight, _ = run_pipeline(opts, progress=False, log=lambda m: None)
    other = tmp_path / "two-legs"
    run_pipeline(tiny_options(other, steps=6), progress=False, log=lambda m: None)
    said: list[str] = []
    _, _, resumed, _ = run_pipeline(tiny_options(other, steps=12), progress=False, log=said.append)
    assert len(resumed) == 12
    assert any(m.startswith(f"resuming {other / 'checkpoint.pt'} at step 6 ") for m in said)  # the log says so
    assert resumed[:6] == pytest.approx(straight[:6])  # same seed: same data order and init


def test_differentiable_blocks_match_forward_block():
    target = random_target()
    draft = random_draft(target.config, block_size=5, markov_head_type="rnn").bind_target(target)
    toks = torch.randint(0, 90, (2, 20), generator=torch.Generator().manual_seed(3))
    out = target.forward(make_forward_batch(toks.tolist(), [0, 0], [0, 1]), target.new_cache(2, 20), hidden_layers=draft.config.aux_layer_ids)
    anchors = torch.tensor([[3, 7, 10], [5, 12, 14]])
    k = draft.config.num_speculative_tokens
    prev = torch.stack([torch.stack([toks[b, p : p + k] for p in anchors[b]]) for b in range(2)])
    blocks = train_blocks(draft, out.hidden.view(2, 20, -1), anchors, prev)
    assert blocks.logits.requires_grad
    draft.allocate_context(2, 20)
    draft.extend_context(out.hidden, torch.arange(20).repeat(2), torch.tensor([0] * 20 + [1] * 20))
    for b in range(2):
        for i in range(3):
            ref = draft.forward_block(prev[b, i][None], anchors[b, i][None], torch.tensor([b]))
            assert torch.allclose(ref.logits[0], blocks.logits[b, i], atol=1e-4)
            assert torch.allclose(ref.confidence_logits[0], blocks.confidence_logits[b, i], atol=1e-4)


def test_train_draft_command_tiny(tmp_path, capsys):
    from dspark_core.commands import train_draft

    parser = argparse.ArgumentParser()
    train_draft.add_arguments(parser)
    args = parser.parse_args([f"--output={tmp_path}", "--tiny", "--steps=8", "--no_progress"])
    assert train_draft.run(args) == 0
    assert (tmp_path / "draft" / "model.safetensors").is_file()
    assert "trained 8 steps" in capsys.readouterr().out


def test_calibrate_confidence_on_heldout_features(trained, tmp_path):
    from dspark_core.commands.calibrate_confidence import calibrate

    out, _, target, _, held = trained
    report = calibrate(out / "draft", target, out / "heldout-features.pt", output=tmp_path / "cal", copy_orders=(3, 2))
    assert report["blocks"] > 0 and len(report["temperatures"]) == 4
    calibrated = load_draft(tmp_path / "cal").config
    assert calibrated.sts_temperatures == pytest.approx(tuple(report["temperatures"]), rel=1e-5)
    assert calibrated.copy_orders == (3, 2)
    assert [list(row) for row in calibrated.copy_confidences] == report["copies"]["confidences"]
    assert report["copies"]["anchors"] > 0
    source = load_draft(out / "draft").config
    assert source.sts_temperatures is None and source.copy_order == 0  # the source stays as it was
    # the same fit from the generations file (features recomputed by the target); the held-out
    # answers are the target's greedy ones, so the copies see the same sequences
    again = calibrate(out / "draft", target, held, output=tmp_path / "cal2", copy_orders=(3, 2))
    assert again["temperatures"] == pytest.approx(report["temperatures"], rel=1e-3)
    assert again["copies"] == report["copies"]
    plain = calibrate(out / "draft", target, held, output=tmp_path / "cal3")
    assert plain["copies"] is None and load_draft(tmp_path / "cal3").config.copy_order == 0


def test_eval_figures_on_the_tiny_draft(trained):
    from dspark_core.commands.eval_draft import evaluate
    from dspark_core.train.data import read_generations

    out, _, target, _, held = trained
    draft = load_draft(out / "draft")
    prompts = [p for p, _ in read_generations(held)]
    report = evaluate(target, draft, prompts, widths=(2, 4), max_tokens=12, batch=4)
    assert set(report["widths"]) == {"2", "4"}
    for k, r in report["widths"].items():
        assert 1.0 <= r["tau"] <= int(k) + 1
        assert len(r["acceptance_by_position"]) == int(k)
        assert r["survival_by_position"] == sorted(r["survival_by_position"], reverse=True)
    conf = report["confidence"]
    assert conf["blocks"] > 0 and len(conf["ece_before"]) == 4
    assert conf["ece_before"] == conf["ece_after"]  # an uncalibrated draft: temperatures are all 1


def test_eval_with_copies_reports_the_blocks_as_proposed(trained):
    from dspark_core.commands.eval_draft import evaluate
    from dspark_core.train.data import read_generations

    out, _, target, _, held = trained
    draft = load_draft(out / "draft")
    prompts = [p for p, _ in read_generations(held)]
    plain = evaluate(target, draft, prompts, widths=(4,), max_tokens=24, batch=4, copy_proposals="off")
    report = evaluate(target, draft, prompts, widths=(4,), max_tokens=24, batch=4, copy_proposals="on")
    assert plain["copy_orders"] == [] and "confidence_with_copies" not in plain
    assert report["copy_orders"] == [6, 5, 4, 3, 2]
    copies = report["confidence_with_copies"]
    assert len(copies["ece"]) == 4 and all(0 <= e <= 1 for e in copies["ece"])
    # the engine's own blocks differ only where copies lead them; the draft-only figures stay
    for key in ("blocks", "ece_after", "offline_acceptance_by_position"):
        assert report["confidence"][key] == plain["confidence"][key]
    assert copies["offline_acceptance_by_position"] != report["confidence"]["offline_acceptance_by_position"]


def test_calibrate_copies_only_keeps_the_temperatures(trained, tmp_path, capsys):
    from dspark_core.commands import calibrate_confidence

    out, _, _, _, held = trained
    parser = argparse.ArgumentParser()
    calibrate_confidence.add_arguments(parser)
    args = parser.parse_args([f"--draft_model={out / 'draft'}", f"--heldout={held}", "--copies_only",
                              "--copy_order=3", f"--output={tmp_path / 'copies'}"])
    assert calibrate_confidence.run(args) == 0
    assert "3 tokens (" in capsys.readouterr().out
    written, source = load_draft(tmp_path / "copies").config, load_draft(out / "draft").config
    assert written.copy_orders == (3, 2) and len(written.copy_confidences) == 2
    assert written.sts_temperatures == source.sts_temperatures and source.copy_orders == ()
    bad = parser.parse_args([f"--draft_model={out / 'draft'}", f"--heldout={held}", "--copies_only",
                             "--copy_order=2", "--copy_min_order=4"])
    with pytest.raises(ModelError, match="--copy_min_order=4 exceeds --copy_order=2"):
        calibrate_confidence.run(bad)
