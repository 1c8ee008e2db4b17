"""Tokenizer wrapper (``tokenizers`` library) plus chat-template rendering.

Chat templates are Jinja programs. jinja2 is not a declared dependency, so
when it is importable we render the checkpoint's own template in a sandbox;
otherwise ChatML templates (``<|im_start|>role\\ncontent<|im_end|>\\n``, used
by SmolLM2 and Qwen) are rendered by a small built-in renderer, and any other
template is refused with a clear error.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

from attrs import define, field

from dspark_core.convert import int_tuple
from dspark_core.errors import ModelError

_CHATML_START = "<|im_start|>"
_CHATML_END = "<|im_end|>"
# A ChatML template may inject a default system turn when the first message is not a system one.
_DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system\s*?\n(.*?)<\|im_end\|>", re.S)


def render_chatml(template: str, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
    """Render ChatML without Jinja, including the template's default system prompt if it has one."""
    if _CHATML_START not in template:
        raise ModelError("chat template is not ChatML and jinja2 is not installed; cannot render it")
    parts: list[str] = []
    default = _DEFAULT_SYSTEM.search(template)
    if default and messages and messages[0].get("role") != "system":
        parts.append(f"{_CHATML_START}system\n{default.group(1)}{_CHATML_END}\n")
    for message in messages:
        parts.append(f"{_CHATML_START}{message['role']}\n{message['content']}{_CHATML_END}\n")
    if add_generation_prompt:
        parts.append(f"{_CHATML_START}assistant\n")
    return "".join(parts)


def _refuse(message: str) -> None:
    raise ModelError(f"chat template refused the conversation: {message}")


@functools.lru_cache(maxsize=16)
def _compiled_template(template: str) -> Any:
    """The sandboxed jinja2 template of ``template``, compiled once: compiling costs milliseconds, far more than
    rendering, and training tokenizes tens of thousands of conversations with one template."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _refuse
    return env.from_string(template)


def render_jinja(template: str, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool, special: Mapping[str, str]) -> str:
    """Render the template with jinja2 in a sandbox (raises ImportError without jinja2)."""
    return _compiled_template(template).render(messages=list(messages), add_generation_prompt=add_generation_prompt, **special)


@define
class Tokenizer:
    """Text <-> token ids, special ids and the chat template of one checkpoint."""

    backend: object  # tokenizers.Tokenizer
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=(), converter=int_tuple)
    chat_template: str | None = None
    add_bos: bool = False

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it are matched as specials."""
        ids = list(self.backend.encode(text, add_special_tokens=False).ids)
        if self.add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of ``ids`` (special tokens dropped unless ``skip_special`` is False)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def token_text(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """Render a conversation to the prompt text the model was trained on."""
        if not self.chat_template:
            raise ModelError("this checkpoint has no chat template (tokenizer.chat_template); use a plain prompt")
        special = {
            "bos_token": self.token_text(self.bos_token_id) if self.bos_token_id is not None else "",
            "eos_token": self.token_text(self.eos_token_ids[0]) if self.eos_token_ids else "",
        }
        try:
            return render_jinja(self.chat_template, messages, add_generation_prompt, special)
        except ImportError:
            return render_chatml(self.chat_template, messages, add_generation_prompt)

    def encode_chat(self, user_text: str) -> list[int]:
        """Token ids of a one-turn user conversation with the generation prompt."""
        return self.encode(self.apply_chat_template([{"role": "user", "content": user_text}]))


def bpe_tokenizer_from_vocab(tokens: Sequence[str], merges: Sequence[str], special_ids: Sequence[int], pre: str | None):
    """A GPT-2 style byte-level BPE ``tokenizers.Tokenizer`` built from GGUF-like vocab data.

    ``pre`` is llama.cpp's pre-tokenizer name; it decides how text is split
    before BPE (digits one by one for SmolLM/StarCoder, the Llama-3/Qwen regex
    for those families, plain GPT-2 otherwise).
    """
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bad = [m for m, p in zip(merges, pairs, strict=True) if len(p) != 2]
    if bad:
        raise ModelError(f"tokenizer.ggml.merges: malformed merge entry {bad[0]!r}")
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("llama-bpe", "llama3", "qwen2", "deepseek-llm"):
        split = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special_ids])
    return backend
