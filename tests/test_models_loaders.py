"""GGUF and Hugging Face loaders on small synthetic checkpoints written by the tests."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from dspark_core.errors import ModelError
from dspark_core.models.base import make_forward_batch
from dspark_core.models.gguf_file import read_gguf_file
from dspark_core.models.gguf_loader import gguf_architecture, read_gguf
from dspark_core.models.hf_loader import read_hf_dir
from dspark_core.models.llama import LlamaTarget
from dspark_core.models.loading import checkpoint_architecture, load_target
from dspark_core.models.random_models import random_target_tensors, tiny_target_config
from dspark_core.models.tokenizer import render_chatml

from checkpoint_support import CFG, CHATML, MERGES, VOCAB, assert_same_as_gguf_reader, byte_chars, write_hf  # noqa: F401



def interleave_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (the loader must undo it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, tensors: dict[str, torch.Tensor], arch: str = "llama") -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(CFG.num_layers)
    w.add_context_length(CFG.max_position)
    w.add_embedding_length(CFG.hidden_size)
    w.add_feed_forward_length(CFG.intermediate_size)
    w.add_head_count(CFG.num_heads)
    w.add_head_count_kv(CFG.num_kv_heads)
    w.add_rope_freq_base(CFG.rope_theta)
    w.add_layer_norm_rms_eps(CFG.rms_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(VOCAB)
    w.add_token_merges(MERGES)
    w.add_token_types([1] * (len(VOCAB) - 2) + [3, 3])
    w.add_bos_token_id(CFG.bos_token_id)
    w.add_eos_token_id(CFG.eos_token_ids[0])
    w.add_chat_template(CHATML)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for hf, t in tensors.items():
        a = t.numpy().astype(np.float32)
        if hf in names:
            name = names[hf]
        else:
            _, _, i, rest = hf.split(".", 3)
            base = rest.rsplit(".", 1)[0]
            name = f"blk.{i}.{layer[base]}.weight"
            if arch == "llama" and base == "self_attn.q_proj":
                a = interleave_rope_rows(a, CFG.num_heads)
            elif arch == "llama" and base == "self_attn.k_proj":
                a = interleave_rope_rows(a, CFG.num_kv_heads)
        if name == "token_embd.weight":  # exercise the dequantization path
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tensors():
    return random_target_tensors(CFG, seed=21)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_matches_original_weights(tmp_path, tensors, arch):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tensors, arch)
    assert gguf_architecture(path) == arch == checkpoint_architecture(path)
    cfg, loaded, tok = read_gguf(path)
    assert cfg.tie_embeddings and cfg.num_layers == 2 and cfg.vocab_size == len(VOCAB)
    embed = tensors["model.embed_tokens.weight"].numpy()
    expected = dict(tensors)
    expected["model.embed_tokens.weight"] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(embed, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0))
    ours = load_target(path)
    ref = LlamaTarget(CFG, expected)
    batch = make_forward_batch([[5, 70, 33, 260]], [0], [0])
    torch.testing.assert_close(ours.forward(batch, ours.new_cache(1, 8)).logits, ref.forward(batch, ref.new_cache(1, 8)).logits, atol=1e-5, rtol=1e-5)
    # Tokenizer from metadata: merges, byte fallback, special tokens, chat template.
    ids = tok.encode("a the he<|im_end|>")
    assert ids[-1] == CFG.eos_token_ids[0] and VOCAB.index("Ġthe") in ids
    assert tok.decode(tok.encode("Hi, the café!")) == "Hi, the café!"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"


def test_chatml_fallback_matches_jinja_and_keeps_default_system():
    template = "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nBe kind.<|im_end|>\n' }}{% endif %}" + CHATML
    msgs = [{"role": "user", "content": "hello"}]
    text = render_chatml(template, msgs)
    assert text == "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ModelError, match="not ChatML"):
        render_chatml("{{ bos_token }}{{ messages[0]['content'] }}", msgs)


def test_jinja_template_compiled_once_and_refusals_named():
    pytest.importorskip("jinja2")
    from dspark_core.models.tokenizer import _compiled_template, render_jinja

    template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}" + CHATML
    before = _compiled_template.cache_info()
    for word in ("one", "two", "three"):
        text = render_jinja(template, [{"role": "user", "content": word}], True, {})
        assert text == f"<|im_start|>user\n{word}<|im_end|>\n<|im_start|>assistant\n"
    after = _compiled_template.cache_info()
    assert after.misses - before.misses == 1 and after.hits - before.hits == 2  # compiled on first use only
    with pytest.raises(ModelError, match="chat template refused the conversation: no system turns"):
        render_jinja(template, [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}], True, {})


def test_gguf_file_reads_what_the_gguf_package_reads(tmp_path, tensors):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tensors)
    w = gguf.GGUFWriter(str(tmp_path / "kinds.gguf"), "llama")  # every kind of value and a float16 tensor
    w.add_uint8("k.u8", 7)
    w.add_int16("k.i16", -3)
    w.add_uint64("k.u64", 2**40)
    w.add_float64("k.f64", 0.125)
    w.add_bool("k.bool", True)
    w.add_array("k.ints", [1, 2, 3])
    w.add_array("k.floats", [0.5, -1.5])
    w.add_array("k.strings", ["a", "é", ""])
    w.add_tensor("half", np.arange(64, dtype=np.float16).reshape(2, 32))
    w.add_tensor("q8", gguf.quants.quantize(np.ones((2, 64), np.float32), gguf.GGMLQuantizationType.Q8_0),
                 raw_shape=(2, 68), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for file in (path, tmp_path / "kinds.gguf"):
        assert_same_as_gguf_reader(file)
    kinds = read_gguf_file(tmp_path / "kinds.gguf")
    assert kinds.fields["k.strings"] == ["a", "é", ""] and kinds.fields["k.u64"] == 2**40
    assert [t.shape for t in kinds.tensors] == [(2, 32), (2, 64)]


def test_damaged_gguf_files_are_named(tmp_path, tensors):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tensors)
    whole = path.read_bytes()
    for cut, message in ((len(whole) // 3, "not a readable GGUF file"), (0, "not a readable GGUF file"),
                         (2, r"not a GGUF file \(bad magic\)")):
        damaged = tmp_path / f"cut-{cut}.gguf"
        damaged.write_bytes(whole[:cut])
        with pytest.raises(ModelError, match=f"{damaged}: {message}"):
            read_gguf_file(damaged)
    zero = gguf.GGUFWriter(str(tmp_path / "zero.gguf"), "llama")
    zero.add_uint32("general.alignment", 0)
    zero.write_header_to_file()
    zero.write_kv_data_to_file()
    zero.close()
    with pytest.raises(ModelError, match="general.alignment is 0, not a positive integer"):
        read_gguf_file(tmp_path / "zero.gguf")
    twice = gguf.GGUFWriter(str(tmp_path / "twice.gguf"), "llama")
    twice.add_tensor("wa", np.zeros(4, np.float32))
    twice.add_tensor("wb", np.ones(4, np.float32))
    twice.write_header_to_file()
    twice.write_kv_data_to_file()
    twice.write_tensors_to_file()
    twice.close()
    raw = (tmp_path / "twice.gguf").read_bytes()
    assert raw.count(b"wb") == 1  # the writer refuses a repeated name: rename the second one in place
    (tmp_path / "twice.gguf").write_bytes(raw.replace(b"wb", b"wa"))
    with pytest.raises(ModelError, match="tensor 'wa' appears twice"):
        read_gguf_file(tmp_path / "twice.gguf")
    header_only = tmp_path / "header.gguf"  # the metadata whole, the tensor data cut off
    header_only.write_bytes(whole[: len(whole) - 100])
    with pytest.raises(ModelError, match="not a readable GGUF file"):
        read_gguf_file(header_only)


def test_gguf_errors(tmp_path, tensors):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ModelError, match="bad magic"):
        load_target(bad)
    with pytest.raises(ModelError, match="no such model"):
        load_target(tmp_path / "missing.gguf")
    partial = dict(tensors)
    del partial["model.layers.1.mlp.up_proj.weight"]
    path = tmp_path / "partial.gguf"
    write_gguf(path, partial)
    with pytest.raises(ModelError, match="model.layers.1.mlp.up_proj.weight"):
        load_target(path)


def test_hf_dir_qwen3(tmp_path):
    cfg = tiny_target_config(vocab_size=len(VOCAB), num_layers=2, qk_norm=True, tie_embeddings=False, architecture="qwen3")
    tensors = random_target_tensors(cfg, seed=2)
    write_hf(tmp_path / "m", tensors)
    model = load_target(tmp_path / "m")
    ref = LlamaTarget(cfg, tensors)
    batch = make_forward_batch([[1, 2, 3]], [0], [0])
    torch.testing.assert_close(model.forward(batch, model.new_cache(1, 4)).logits, ref.forward(batch, ref.new_cache(1, 4)).logits)
    assert model.tokenizer.encode_chat("the")[-1] == VOCAB.index(byte_chars()[10])


def test_hf_dir_errors(tmp_path, tensors):
    write_hf(tmp_path / "a", tensors, model_type="llama", tie_word_embeddings=True)
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    del cfg["num_attention_heads"]
    (tmp_path / "a" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="'num_attention_heads' is missing"):
        read_hf_dir(tmp_path / "a")
    write_hf(tmp_path / "b", tensors, model_type="gpt_neox")
    with pytest.raises(ModelError, match="model_type 'gpt_neox'"):
        read_hf_dir(tmp_path / "b")
    with pytest.raises(ModelError, match="architecture 'gpt_neox' is not supported"):
        load_target(tmp_path / "b")
    write_hf(tmp_path / "c", tensors, model_type="llama", tie_word_embeddings=False)
    with pytest.raises(ModelError, match="'lm_head.weight'"):
        load_target(tmp_path / "c")
    (tmp_path / "c" / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match="tokenizer.json: file not found"):
        read_hf_dir(tmp_path / "c")
