"""Tiny checkpoints on disk (HF directory + byte-level BPE tokenizer) shared by tests."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from dspark_core.models.gguf_file import read_gguf_file
from dspark_core.models.random_models import tiny_target_config

CHATML = "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"


def byte_chars() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for raw bytes."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


VOCAB = byte_chars() + ["he", "Ġt", "Ġthe", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "Ġ t", "Ġt he"]
CFG = tiny_target_config(vocab_size=len(VOCAB), num_layers=2, bos_token_id=len(VOCAB) - 2, eos_token_ids=(len(VOCAB) - 1,))


def write_hf(directory: Path, tensors: dict[str, torch.Tensor], **config_overrides) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "qwen3", "vocab_size": CFG.vocab_size, "hidden_size": CFG.hidden_size, "intermediate_size": CFG.intermediate_size,
              "num_hidden_layers": CFG.num_layers, "num_attention_heads": CFG.num_heads, "num_key_value_heads": CFG.num_kv_heads,
              "head_dim": CFG.head_dim, "max_position_embeddings": CFG.max_position, "rope_theta": CFG.rope_theta,
              "rms_norm_eps": CFG.rms_eps, "tie_word_embeddings": False, "eos_token_id": CFG.eos_token_ids[0]}
    config.update(config_overrides)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    from dspark_core.models.tokenizer import bpe_tokenizer_from_vocab

    bpe_tokenizer_from_vocab(VOCAB, MERGES, [len(VOCAB) - 2, len(VOCAB) - 1], "smollm").save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return directory


def write_tiny_pair(root: Path, *, seed: int = 0, block_size: int = 7, max_position: int = 512) -> tuple[Path, Path]:
    """A tiny Llama HF directory and a DSpark draft (speculators format) for it."""
    from dspark_core.models.random_models import random_draft, random_target_tensors
    from dspark_core.models.speculators_io import save_draft

    cfg = tiny_target_config(vocab_size=len(VOCAB), num_layers=2, max_position=max_position,
                             bos_token_id=len(VOCAB) - 2, eos_token_ids=(len(VOCAB) - 1,))
    target_dir = write_hf(root / "target", random_target_tensors(cfg, seed), model_type="llama",
                          tie_word_embeddings=True, max_position_embeddings=max_position)
    draft = random_draft(cfg, seed=seed, block_size=block_size)
    save_draft(draft, root / "draft")
    return target_dir, root / "draft"


def assert_same_as_gguf_reader(path: Path) -> None:
    """The project's GGUF reader gives every field and tensor that the gguf package's reader gives."""
    ours, theirs = read_gguf_file(path), gguf.GGUFReader(str(path))
    expected = {key: field.contents() for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    assert ours.fields == expected
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert mine.shape == tuple(reversed(reference.shape.tolist())) and mine.tensor_type == int(reference.tensor_type)
        assert mine.data.dtype == reference.data.dtype and np.array_equal(mine.data, reference.data)
