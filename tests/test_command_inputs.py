"""Counts and input files of the draft tools are checked before any work: a zero that would break a
loop after minutes of feature generation is an argparse error naming the flag, and a prompts or
generations file that cannot be read is a clear error naming the file (and line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark_core.cli import main
from dspark_core.commands.eval_draft import read_eval_prompts
from dspark_core.errors import ConfigError
from dspark_core.train.data import read_generations


@pytest.mark.parametrize("command,flag", [
    ("train-draft", "--save_every"), ("train-draft", "--seqs_per_step"), ("train-draft", "--anchors_per_seq"),
    ("train-draft", "--shard_size"), ("train-draft", "--gen_batch"), ("eval-draft", "--bins"),
    ("eval-draft", "--max_tokens"), ("eval-draft", "--batch"), ("calibrate-confidence", "--bins"),
])
def test_a_zero_count_is_refused_when_the_flags_are_read(capsys, command, flag):
    with pytest.raises(SystemExit) as exit_info:
        main([command, f"{flag}=0"])
    assert exit_info.value.code == 2
    assert f"{flag}: expected an integer >= 1, got 0" in capsys.readouterr().err


def test_generations_and_prompt_files_name_what_is_wrong(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"nope.jsonl: cannot read"):
        read_eval_prompts(tmp_path / "nope.jsonl")
    generations = tmp_path / "heldout.jsonl"
    generations.write_text('{"prompt_ids": [1, 2], "answer_ids": [3]}\n\n{"prompt_ids": [4]}\n')
    with pytest.raises(ConfigError, match=r"heldout.jsonl:3: expected an object with `prompt_ids` and `answer_ids`"):
        read_eval_prompts(generations)
    generations.write_text('{"prompt_ids": "12", "answer_ids": [3]}\n')
    with pytest.raises(ConfigError, match=r"heldout.jsonl:1: expected an object with `prompt_ids` and `answer_ids` lists"):
        read_generations(generations)
    generations.write_text('{"prompt_ids": [1, 2], "answer_ids": [3]}\n{"prompt_ids": [4], \n')
    with pytest.raises(ConfigError, match=r"heldout.jsonl:2: not valid JSON"):
        read_generations(generations)
    generations.write_text('{"prompt_ids": [1, 2], "answer_ids": [3]}\n')
    assert read_eval_prompts(generations) == [[1, 2]] and read_generations(generations) == [([1, 2], [3])]


def test_the_shipped_draft_is_never_calibrated_in_place(capsys):
    assert main(["calibrate-confidence", "--draft_model=default"]) == 2
    assert "would rewrite the draft shipped in the package; pass --output=DIR to write a calibrated copy, or " \
        "--in_place" in capsys.readouterr().err


def test_eval_draft_refuses_widths_its_draft_cannot_propose_before_loading_the_target(tmp_path, capsys):
    # the shipped SmolLM2 draft proposes 7 tokens; the target is never loaded
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    assert main(["eval-draft", "--target=smollm2", "--draft_model=default", "--widths=5,9", f"--prompts={prompts}"]) == 2
    err = capsys.readouterr().err
    assert "--widths=5,9: the draft at" in err and "proposes at most 7 tokens per block" in err
