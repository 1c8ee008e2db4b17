"""Tiny text-capable models for the server tests and the soak benchmark.

A random tiny target has no tokenizer, so this module gives it one: a
byte-level BPE with no merges (one token per byte, exactly like GPT-2's byte
alphabet) plus three ChatML special tokens and a ChatML chat template. Any
text round-trips, chat requests render like SmolLM2's, and a forward pass of
the tiny model still takes about a millisecond.
"""

from __future__ import annotations

import torch

from dspark_core.models.llama import LlamaTarget
from dspark_core.models.random_models import random_draft, random_target_tensors, tiny_target_config
from dspark_core.models.tokenizer import Tokenizer

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_tokenizer(*, eos: str | None = "<|im_end|>") -> Tokenizer:
    """One token per byte (ids 0-255) and the ChatML specials after them (256-258)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for i, special in enumerate(SPECIALS):
        vocab[special] = 256 + i
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    eos_ids = () if eos is None else (vocab[eos],)
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=eos_ids, chat_template=CHATML_TEMPLATE)


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's byte -> printable character map."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), ord("\xff") + 1))
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def tiny_text_pair(seed: int = 0, *, block_size: int = 7, max_position: int = 512, eos: bool = True):
    """A float64 tiny target with the byte tokenizer attached, and a random DSpark draft for it.

    With ``eos`` the target stops on ``<|im_end|>`` like a chat model (a random
    model emits it rarely); without, requests run to ``max_tokens``.
    """
    tokenizer = byte_tokenizer(eos="<|im_end|>" if eos else None)
    cfg = tiny_target_config(vocab_size=256 + len(SPECIALS), max_position=max_position,
                             eos_token_ids=tokenizer.eos_token_ids)
    target = LlamaTarget(cfg, random_target_tensors(cfg, seed), dtype=torch.float64, tokenizer=tokenizer)
    draft = random_draft(cfg, seed=seed, block_size=block_size).to(torch.float64)
    return target, draft


def tiny_engine(seed: int = 0, *, policy: str = "fixed", options=None, buckets=(1, 2, 4), max_model_len: int = 256,
                overlap: bool = True, eos: bool = True, width: int = 7):
    """An Engine over :func:`tiny_text_pair` (equal arguments give equal, independent engines)."""
    from dspark_core.engine.engine import Engine, EngineConfig

    target, draft = tiny_text_pair(seed, block_size=width, max_position=max_model_len, eos=eos)
    config = EngineConfig(draft_width=width, policy=policy, policy_options=options if options is not None else {"k": 3},
                          request_buckets=buckets, max_model_len=max_model_len, schedule_overlap=overlap)
    return Engine(target, draft, config)
