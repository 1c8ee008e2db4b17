"""Read a Llama-family GGUF file: config, dequantized weights (HF names) and tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark_core.errors import ModelError
from dspark_core.models.base import TargetConfig
from dspark_core.models.gguf_file import GGUFFile, GGUFTensor, read_gguf_file
from dspark_core.models.tokenizer import Tokenizer, bpe_tokenizer_from_vocab

SUPPORTED = ("llama", "qwen2", "qwen3")

# GGUF tensor suffix -> Hugging Face suffix (per layer).
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def _field(reader: GGUFFile, path: Path, key: str, default: Any = ModelError) -> Any:
    if key not in reader.fields:
        if default is ModelError:
            raise ModelError(f"{path}: GGUF metadata field {key!r} is missing")
        return default
    return reader.fields[key]


def gguf_architecture(path: str | Path) -> str:
    """The ``general.architecture`` string of a GGUF file (lower case)."""
    path = Path(path)
    return str(_field(read_gguf_file(path), path, "general.architecture")).lower()


def unpermute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row interleave so the weights match rotate-half rotary.

    The converter reorders each head's rows from [first half; second half] to
    alternating pairs; this restores the original order.
    """
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _config(reader: GGUFFile, path: Path, arch: str, tensor_shapes: dict[str, tuple[int, ...]]) -> TargetConfig:
    a = arch
    d = int(_field(reader, path, f"{a}.embedding_length"))
    heads = int(_field(reader, path, f"{a}.attention.head_count"))
    kv_heads = int(_field(reader, path, f"{a}.attention.head_count_kv", heads))
    scaling = _field(reader, path, f"{a}.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in tensor_shapes:
        raise ModelError(f"{path}: rope scaling ({scaling or 'rope_freqs'}) is not supported")
    if "token_embd.weight" not in tensor_shapes:
        raise ModelError(f"{path}: tensor 'token_embd.weight' is missing")
    eos = [int(_field(reader, path, "tokenizer.ggml.eos_token_id", -1)), int(_field(reader, path, "tokenizer.ggml.eot_token_id", -1))]
    bos = _field(reader, path, "tokenizer.ggml.bos_token_id", None)
    return TargetConfig(
        architecture=arch,
        vocab_size=tensor_shapes["token_embd.weight"][0],
        hidden_size=d,
        intermediate_size=int(_field(reader, path, f"{a}.feed_forward_length")),
        num_layers=int(_field(reader, path, f"{a}.block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(_field(reader, path, f"{a}.attention.key_length", d // heads)),
        max_position=int(_field(reader, path, f"{a}.context_length")),
        rope_theta=float(_field(reader, path, f"{a}.rope.freq_base", 10000.0)),
        rms_eps=float(_field(reader, path, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        tie_embeddings="output.weight" not in tensor_shapes,
        qkv_bias="blk.0.attn_q.bias" in tensor_shapes,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(e for e in eos if e >= 0)),
    )


def _tensor(t: GGUFTensor) -> torch.Tensor:
    import gguf

    data = np.asarray(gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.tensor_type)), dtype=np.float32)
    # Unquantized tensors come back as read-only views of the memory map: copy those.
    if not data.flags.writeable or not data.flags.c_contiguous:
        data = np.array(data, dtype=np.float32, order="C")
    return torch.from_numpy(data)


def _tokenizer(reader: GGUFFile, path: Path, cfg: TargetConfig) -> Tokenizer:
    model = _field(reader, path, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelError(f"{path}: tokenizer.ggml.model {model!r} is not supported (only byte-level BPE 'gpt2')")
    tokens = list(_field(reader, path, "tokenizer.ggml.tokens"))
    merges = list(_field(reader, path, "tokenizer.ggml.merges"))
    types = list(_field(reader, path, "tokenizer.ggml.token_type", [1] * len(tokens)))
    # Types 3 (control) and 4 (user defined) are matched whole, never split by BPE.
    specials = [i for i, t in enumerate(types) if t in (3, 4)]
    backend = bpe_tokenizer_from_vocab(tokens, merges, specials, _field(reader, path, "tokenizer.ggml.pre", None))
    return Tokenizer(
        backend,
        bos_token_id=cfg.bos_token_id,
        eos_token_ids=cfg.eos_token_ids,
        chat_template=_field(reader, path, "tokenizer.chat_template", None),
        add_bos=bool(_field(reader, path, "tokenizer.ggml.add_bos_token", False)),
    )


def read_gguf(path: str | Path) -> tuple[TargetConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, float32 weights with Hugging Face names, and tokenizer of a GGUF file."""
    path = Path(path)
    reader = read_gguf_file(path)
    arch = str(_field(reader, path, "general.architecture")).lower()
    if arch not in SUPPORTED:
        raise ModelError(f"{path}: GGUF architecture {arch!r} is not a Llama-family model ({', '.join(SUPPORTED)})")
    shapes = {t.name: t.shape for t in reader.tensors}
    cfg = _config(reader, path, arch, shapes)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = t.name
        if name in _GLOBAL_NAMES:
            hf = _GLOBAL_NAMES[name]
        elif name.startswith("blk."):
            _, layer, suffix = name.split(".", 2)
            if suffix not in _LAYER_NAMES:
                raise ModelError(f"{path}: unexpected tensor {name!r}")
            hf = f"model.layers.{layer}.{_LAYER_NAMES[suffix]}"
        else:
            raise ModelError(f"{path}: unexpected tensor {name!r}")
        w = _tensor(t)
        if arch == "llama" and suffix_is(name, "attn_q.weight"):
            w = unpermute_rope_rows(w, cfg.num_heads)
        elif arch == "llama" and suffix_is(name, "attn_k.weight"):
            w = unpermute_rope_rows(w, cfg.num_kv_heads)
        tensors[hf] = w
    return cfg, tensors, _tokenizer(reader, path, cfg)


def suffix_is(name: str, suffix: str) -> bool:
    return name.startswith("blk.") and name.endswith("." + suffix)
