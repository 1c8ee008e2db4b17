"""Architecture of a GLM-DSA target and its translation from a Hugging Face ``config.json``.

GLM-DSA (HF ``model_type`` ``glm_moe_dsa``; DeepSeek-V3.2 ``deepseek_v32`` has the
same layout) combines multi-head latent attention (MLA), a lightning indexer that
picks the ``index_topk`` most relevant cached positions for every query
(DeepSeek sparse attention), and a mixture-of-experts feed-forward with shared
experts after ``first_k_dense_replace`` dense layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attrs import field, frozen

from dspark_core.convert import int_tuple, str_tuple
from dspark_core.errors import ModelError

#: HF model_type values (and aliases) this family reads.
GLM_DSA_ARCHITECTURES = ("glm_moe_dsa", "glm_dsa", "deepseek_v32")


@frozen
class GlmDsaConfig:
    """Everything the GLM-DSA target needs; field names follow the published config where one exists."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense layers' SwiGLU width
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    max_position: int
    mlp_layer_types: tuple[str, ...] = field(converter=str_tuple)  # "dense" | "sparse" per layer
    indexer_types: tuple[str, ...] = field(converter=str_tuple)  # "full" | "shared" per layer
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"
    rope_theta: float = 10000.0
    rope_interleave: bool = False  # main attention's rope pairs (x0,x1),(x2,x3)... instead of halves
    rms_eps: float = 1e-5
    tie_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=(), converter=int_tuple)

    def __attrs_post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "q_lora_rank", "kv_lora_rank",
                    "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ModelError(f"GLM-DSA config: {name} must be positive, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ModelError(f"GLM-DSA config: qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if not self.qk_rope_head_dim <= self.index_head_dim:
            raise ModelError("GLM-DSA config: index_head_dim must hold the rope dims (>= qk_rope_head_dim)")
        for name, allowed in (("mlp_layer_types", ("dense", "sparse")), ("indexer_types", ("full", "shared"))):
            values = getattr(self, name)
            if len(values) != self.num_layers or not set(values) <= set(allowed):
                raise ModelError(f"GLM-DSA config: {name} needs one of {allowed} per layer, got {list(values)}")
        if self.indexer_types[0] != "full":
            raise ModelError("GLM-DSA config: the first layer must run its own indexer (indexer_types[0] == 'full')")
        if "sparse" in self.mlp_layer_types:
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts or self.moe_intermediate_size <= 0:
                raise ModelError("GLM-DSA config: MoE layers need n_routed_experts >= num_experts_per_tok > 0")
            if self.n_routed_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
                raise ModelError(f"GLM-DSA config: {self.n_routed_experts} experts do not split into n_group={self.n_group} "
                                 f"groups with topk_group={self.topk_group}")
            if self.scoring_func not in ("sigmoid", "softmax"):
                raise ModelError(f"GLM-DSA config: scoring_func {self.scoring_func!r} is not sigmoid or softmax")
        if "dense" in self.mlp_layer_types and self.intermediate_size <= 0:
            raise ModelError("GLM-DSA config: dense layers need intermediate_size > 0")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def full_indexer_layers(self) -> tuple[int, ...]:
        """Layers that compute (and cache keys for) their own top-k selection."""
        return tuple(i for i, kind in enumerate(self.indexer_types) if kind == "full")


def default_mlp_layer_types(num_layers: int, first_k_dense_replace: int, moe_layer_freq: int = 1,
                            has_experts: bool = True) -> tuple[str, ...]:
    """Dense for the first ``first_k_dense_replace`` layers, then MoE every ``moe_layer_freq`` layers."""
    freq = max(int(moe_layer_freq), 1)
    return tuple("sparse" if has_experts and i >= first_k_dense_replace and i % freq == 0 else "dense"
                 for i in range(num_layers))


def default_indexer_types(num_layers: int, raw: dict[str, Any]) -> tuple[str, ...]:
    """Per-layer indexer mode from ``indexer_types``, ``index_topk_pattern`` or the freq/offset schedule."""
    if raw.get("indexer_types") is not None:
        return tuple(str(v) for v in raw["indexer_types"])
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        letters = {"F": "full", "S": "shared"}
        return tuple(letters.get(c, c) for c in pattern) if isinstance(pattern, str) else tuple(pattern)
    freq = max(int(raw.get("index_topk_freq", 1)), 1)
    offset = int(raw.get("index_skip_topk_offset", 2))
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))


def _need(raw: dict[str, Any], key: str, path: Path) -> Any:
    if raw.get(key) is None:
        raise ModelError(f"{path}: field {key!r} is missing")
    return raw[key]


def _rope(raw: dict[str, Any], path: Path) -> float:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type"))
    if kind not in (None, "default"):
        raise ModelError(f"{path}: rope type {kind!r} is not supported by the GLM-DSA target (only default rope)")
    return float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))


def glm_dsa_config_from_hf(raw: dict[str, Any], path: Path) -> GlmDsaConfig:
    """Translate a Hugging Face ``config.json`` dict into a :class:`GlmDsaConfig`."""
    arch = str(_need(raw, "model_type", path)).lower()
    if arch not in GLM_DSA_ARCHITECTURES:
        raise ModelError(f"{path}: model_type {arch!r} is not a GLM-DSA model ({', '.join(GLM_DSA_ARCHITECTURES)})")
    if raw.get("quantization_config"):
        raise ModelError(f"{path}: quantized checkpoints ({raw['quantization_config'].get('quant_method', '?')}) are "
                         "not supported; convert the weights to bf16/fp16/fp32 safetensors first")
    if raw.get("q_lora_rank") is None:
        raise ModelError(f"{path}: the GLM-DSA target needs q_lora_rank (the indexer reads the low-rank query)")
    layers = int(_need(raw, "num_hidden_layers", path))
    experts = int(raw.get("n_routed_experts") or raw.get("num_experts") or 0)
    mlp_types = raw.get("mlp_layer_types") or default_mlp_layer_types(
        layers, int(raw.get("first_k_dense_replace", 0)), int(raw.get("moe_layer_freq", 1)), experts > 0)
    eos = raw.get("eos_token_id")
    heads = int(_need(raw, "num_attention_heads", path))
    try:
        return GlmDsaConfig(
            architecture=arch, vocab_size=int(_need(raw, "vocab_size", path)),
            hidden_size=int(_need(raw, "hidden_size", path)), intermediate_size=int(raw.get("intermediate_size") or 0),
            num_layers=layers, num_heads=heads, q_lora_rank=int(raw["q_lora_rank"]),
            kv_lora_rank=int(_need(raw, "kv_lora_rank", path)), qk_nope_head_dim=int(_need(raw, "qk_nope_head_dim", path)),
            qk_rope_head_dim=int(_need(raw, "qk_rope_head_dim", path)), v_head_dim=int(_need(raw, "v_head_dim", path)),
            index_n_heads=int(_need(raw, "index_n_heads", path)), index_head_dim=int(_need(raw, "index_head_dim", path)),
            index_topk=int(_need(raw, "index_topk", path)), moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            n_routed_experts=experts, n_shared_experts=int(raw.get("n_shared_experts") or 0),
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
            max_position=int(raw.get("max_position_embeddings", 4096)), mlp_layer_types=tuple(mlp_types),
            indexer_types=default_indexer_types(layers, raw), n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1), norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            scoring_func=str(raw.get("scoring_func", "sigmoid")), rope_theta=_rope(raw, path),
            rope_interleave=bool(raw.get("rope_interleave", arch == "deepseek_v32")),
            rms_eps=float(raw.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)), bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        )
    except (TypeError, ValueError) as exc:
        raise ModelError(f"{path}: bad value in config ({exc})") from None
