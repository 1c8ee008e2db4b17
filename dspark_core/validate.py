"""Launch-time rules for a :class:`~dspark_core.config.ServeConfig`.

Two layers: basic sanity of every launch (ranges, mutually exclusive flags) and
the spec's supported-configuration rules, which apply only when adaptive
DSpark is on. Fixed-width DSpark and target-only serving keep their own
contract and are not held to the adaptive rules. All violations are reported
together, one line each, so a user fixes a launch in one go.
"""

from __future__ import annotations

from collections.abc import Callable

from dspark_core.config import ServeConfig
from dspark_core.errors import ConfigError
from dspark_core.geometry import kv_spans

SUPPORTED_WIDTHS = (5, 7)

Rule = Callable[[ServeConfig], str | None]


def _width(c: ServeConfig) -> str | None:
    if c.num_speculative_tokens not in SUPPORTED_WIDTHS:
        return f"num_speculative_tokens={c.num_speculative_tokens}: adaptive DSpark supports 5 or 7"
    return None


def _greedy(c: ServeConfig) -> str | None:
    if c.draft_sampling_mode != "greedy":
        return f"draft_sampling_mode={c.draft_sampling_mode}: adaptive DSpark requires greedy"
    return None


def _dp(c: ServeConfig) -> str | None:
    return None if c.dp_size == 1 else f"dp_size={c.dp_size}: adaptive DSpark requires dp_size=1"


def _cp(c: ServeConfig) -> str | None:
    return None if c.cp_size == 1 else f"cp_size={c.cp_size}: adaptive DSpark requires cp_size=1"


def _graphs(c: ServeConfig) -> str | None:
    return None if c.enable_graph else "enable_graph=false: adaptive DSpark requires graphs (enable_graph=true)"


def _warmup(c: ServeConfig) -> str | None:
    if c.disable_graph_warmup:
        return "disable_graph_warmup=true: adaptive DSpark requires graph warmup (disable_graph_warmup=false)"
    return None


def _overlap(c: ServeConfig) -> str | None:
    if not c.enable_schedule_overlap:
        return "enable_schedule_overlap=false: adaptive DSpark requires schedule overlap"
    return None


def _pipeline(c: ServeConfig) -> str | None:
    return None if c.enable_task_pipeline else "enable_task_pipeline=false: adaptive DSpark requires the task pipeline"


def _unified(c: ServeConfig) -> str | None:
    if c.enable_unified_mtp_graph:
        return "enable_unified_mtp_graph=true: adaptive DSpark does not run with unified MTP graphs"
    return None


#: The supported-configuration rules of the adaptive path, in the spec's order.
ADAPTIVE_RULES: tuple[Rule, ...] = (_width, _greedy, _dp, _cp, _graphs, _warmup, _overlap, _pipeline, _unified)


def _basic_problems(c: ServeConfig) -> list[str]:
    problems = []
    for name in ("nnodes", "dp_size", "cp_size", "max_seqs_per_batch", "acl_graph_decode_batch_size_limit",
                 "max_pending_requests"):
        if getattr(c, name) < 1:
            problems.append(f"{name}={getattr(c, name)}: must be >= 1")
    if not 0 <= c.node_rank < max(c.nnodes, 1):
        problems.append(f"node_rank={c.node_rank}: must be in 0..{c.nnodes - 1} for nnodes={c.nnodes}")
    if c.cpu_threads < 0:
        problems.append(f"cpu_threads={c.cpu_threads}: must be >= 0 (0 = torch's default)")
    if c.max_model_len < 2:
        problems.append(f"max_model_len={c.max_model_len}: must be >= 2")
    else:
        try:
            kv_spans(c.captured_kv_spans, c.max_model_len, captured=True)
        except ConfigError as exc:
            problems.append(str(exc).removeprefix("--"))
    if not 0 <= c.port <= 65535:
        problems.append(f"port={c.port}: must be in 0..65535")
    if c.speculative and c.num_speculative_tokens < 1:
        problems.append(f"num_speculative_tokens={c.num_speculative_tokens}: must be >= 1 with DSpark")
    if c.speculative and not c.adaptive and c.draft_sampling_mode != "greedy":
        # fixed-width decoding keeps its own contract, but this engine's drafts only propose greedily:
        # accepting the flag would silently run greedy drafts instead
        problems.append(f"draft_sampling_mode={c.draft_sampling_mode}: not implemented; dspark-core drafts and "
                        "verifies greedily (draft_sampling_mode=greedy)")
    if c.adaptive_dspark_cost_table and c.adaptive_dspark_calibration:
        problems.append(
            "adaptive_dspark_cost_table and adaptive_dspark_calibration are exclusive: a saved table skips calibration"
        )
    if c.adaptive_dspark_cost_table and c.adaptive_dspark_cost_table_output:
        problems.append(
            "adaptive_dspark_cost_table and adaptive_dspark_cost_table_output are exclusive: a reused table is not re-saved"
        )
    uses_table_flags = c.adaptive_dspark_calibration or c.adaptive_dspark_cost_table or c.adaptive_dspark_cost_table_output
    if uses_table_flags and not c.adaptive:
        problems.append(
            "adaptive_dspark_* flags need adaptive DSpark "
            "(speculative_algorithm=DSpark and enable_adaptive_speculative_decode=true)"
        )
    if c.model is None:
        problems.append("model: required (a GGUF file, an HF directory, or `smollm2`)")
    if c.speculative and c.draft_model is None:
        problems.append("draft_model: required with speculative_algorithm=DSpark (or use `default`)")
    return problems


def config_problems(c: ServeConfig) -> list[str]:
    """Every rule ``c`` violates, one message each (empty when the launch is valid)."""
    problems = _basic_problems(c)
    if c.adaptive:
        problems.extend(msg for rule in ADAPTIVE_RULES if (msg := rule(c)) is not None)
    return problems


def check_config(c: ServeConfig) -> None:
    """Raise :class:`ConfigError` listing every violated rule."""
    problems = config_problems(c)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"unsupported configuration ({len(problems)} problem(s)):\n{lines}")
