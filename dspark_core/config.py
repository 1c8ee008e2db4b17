"""Every ``dspark-core serve`` flag, defined once.

:class:`ServeConfig` is the single source of truth: the argument parser, the
supported-configuration rules and the generated CLI reference (``docs/cli.md``)
are all derived from its fields. Flags use the spec's spelling
(``--num_speculative_tokens=7``) and booleans are written ``true``/``false``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import attrs
from attrs import field, frozen

from dspark_core.errors import ConfigError

REQUIRED = "(required)"


def flag(default: Any, help: str, *, choices: Sequence[Any] | None = None, group: str = "general",
         kind: str | None = None) -> Any:
    """Declare a config field together with its CLI documentation; ``kind`` names its type in the
    CLI reference where the annotation alone would misname it (an optional string that is no path)."""
    return field(default=default, metadata={"help": help, "choices": tuple(choices) if choices else None,
                                            "group": group, "kind": kind})


def parse_bool(text: str) -> bool:
    """Parse the spec's boolean spelling: ``true`` or ``false`` (any case)."""
    lowered = text.strip().lower()
    if lowered == "true":
        return True
    if lowered == "false":
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


@frozen
class ServeConfig:
    """The launch configuration of one rank, as given on the command line."""

    # --- model and execution ---
    model: str | None = flag(None, "Target checkpoint: a GGUF file, an HF directory, or the alias `smollm2`.", group="model")
    draft_model: str | None = flag(None, "DSpark draft checkpoint directory (speculators format); `default` picks the draft shipped for the target.", group="model")
    backend: str = flag("llm", "Serving backend; only `llm` (text generation) exists.", choices=["llm"], group="model")
    model_impl: str = flag("python", "Model implementation; dspark-core runs its own PyTorch (`python`) models.", choices=["python"], group="model")
    npu_kernel_backend: str = flag("TORCH", "Kernel backend on Ascend NPUs; `TORCH` uses torch ops supported by torch_npu.", choices=["TORCH"], group="model")
    device: str = flag("auto", "Device plugin to run on (`auto` picks cuda, then npu, then cpu).", group="model")
    dtype: str = flag("auto", "Compute dtype (`auto`: the device's default: float32 on CPU and CUDA, where greedy output must match target-only decoding token for token; bfloat16 on NPU). On the CPU, targets run batch-invariant forwards, so speculative output matches target-only decoding in the same dtype bit for bit, bfloat16 included; on CPUs with native bfloat16 (AVX512-BF16, AMX) `bfloat16` serves 1.4-1.5x faster, but it is numerically another model, whose answers differ from float32's (docs/architecture.md).", choices=["auto", "float32", "bfloat16", "float16"], group="model")
    draft_dtype: str = flag("auto", "Draft compute dtype (`auto`: the device's draft default, bfloat16 on CPUs with native bfloat16 products, else the resolved --dtype). The draft only proposes tokens and the target verifies them, so this never changes the output, only how fast proposals come and how often they are accepted.", choices=["auto", "float32", "bfloat16", "float16"], group="model")
    batch_invariant: str = flag("auto", "Batch-invariant target forwards: a verified row's logits equal the target-only row's bit for bit, whatever else is in the batch, so greedy speculative output cannot part from target-only decoding at a near-tie. They exist on the CPU device only. `auto`: on for float32 and bfloat16 (and float16 where this CPU's products measured row-invariant), off elsewhere; `on`: on for every CPU dtype (refused on other devices); `off`: the plain kernels, whose steps ran 2-12 per cent faster on the development CPU, exact only up to near-ties. A saved cost table records `on`/`off` and is reused only with the same setting.", choices=["auto", "on", "off"], group="model")
    cpu_threads: int = flag(0, "Torch intra-op threads on the CPU device. `0` (auto): PyTorch's default, every core, for a one-rank launch; one thread per rank when --nnodes is above 1 (CPU ranks usually share one host's cores). On the 2-core development CPU, two threads served 1.4-1.6x faster than one at 16 requests and no slower at 1 or 4 (benchmarks/results/avx2, one intra-op thread or two). A saved cost table records the count and is reused only with it.", group="model")
    max_model_len: int = flag(4096, "KV cache length per request (capped by the model's context limit).", group="model")
    # --- distributed launch ---
    nnodes: int = flag(1, "Number of ranks in the service.", group="distributed")
    node_rank: int = flag(0, "This rank's index, 0 .. nnodes-1. Rank 0 serves HTTP.", group="distributed")
    master_node_addr: str = flag("127.0.0.1:27000", "host:port of rank 0's rendezvous.", group="distributed")
    dp_size: int = flag(1, "Data-parallel size. The adaptive path requires 1.", group="distributed")
    cp_size: int = flag(1, "Context-parallel size. The adaptive path requires 1.", group="distributed")
    # --- HTTP ---
    host: str = flag("127.0.0.1", "Address the HTTP server listens on.", group="http")
    port: int = flag(8000, "Port the HTTP server listens on (0: a free port, named in the log). It is held from startup, so a port in use fails at once.", group="http")
    max_pending_requests: int = flag(256, "Requests admitted at once (running + waiting); more get 429.", group="http")
    served_model_name: str | None = flag(None, "Model name in the API (`model` field); defaults to the --model value's name.", group="http", kind="string")
    log_requests: bool = flag(True, "Log one structured `request` event per ended request (status, prompt and output tokens, seconds, time to first token, finish reason, accepted length per step; the error for refusals); `false` turns this access log off.", group="http")
    # --- speculative decoding ---
    speculative_algorithm: str = flag("DSpark", "Speculative algorithm; `none` serves the target alone.", choices=["DSpark", "none"], group="speculative")
    num_speculative_tokens: int = flag(7, "Draft width K: tokens drafted per request per step. Adaptive DSpark supports 5 or 7.", group="speculative")
    draft_sampling_mode: str = flag("greedy", "How the draft picks its tokens. dspark-core decodes greedily: only `greedy` runs, and `sample` is refused at startup wherever a draft runs.", choices=["greedy", "sample"], group="speculative")
    enable_adaptive_speculative_decode: bool = flag(True, "Choose each step's verify budget from confidences and calibrated costs (false: always verify all K).", group="speculative")
    copy_proposals: str = flag("auto", "Copy proposals (prompt lookup): where the request's last tokens occurred before in its prompt or output, the tokens that followed lead the draft's block. `auto`: as the draft's config says (the shipped SmolLM2 draft: on, keys of 6 down to 2 tokens); `on`: the draft's keys or 6 down to 2; `off`: the draft alone. Never changes greedy output, only how many tokens a step commits.", choices=["auto", "on", "off"], group="speculative")
    draft_depths: str = flag("auto", "Tokens the draft proposes per request at each request bucket, where fewer than K: its block is cut after them, so a proposal costs less where steps verify only a request's first few drafted tokens. `auto`: the device's default (CPU: 4 from 4 requests on, 2 from 16 on; other devices: K everywhere); `full`: K everywhere; or bucket:depth pairs such as `8:4,16:2` (other buckets K). A policy that always verifies more than a bucket's depth (fixed k) gets all K there. Never changes greedy output, only what a step costs and what it can accept. Part of a saved cost table's fingerprint.", group="speculative")
    budget_policy: str = flag("auto", "Budget policy plugin (`auto`: adaptive, fixed or none from the flags above; any name `dspark-core plugins` lists).", group="speculative")
    budget_policy_options: str = flag("{}", "JSON object of options for the budget policy, e.g. `{\"k\": 3}` for fixed.", group="speculative")
    # --- graphs and scheduling ---
    enable_graph: bool = flag(True, "Run decode steps through captured/warmed graphs.", group="graphs")
    python_graph_backend: str = flag("auto", "Graph backend plugin (`auto`: static on CPU, cudagraph on CUDA, aclgraph on NPU).", group="graphs")
    disable_graph_warmup: bool = flag(False, "Skip warming graphs at startup. Refused on the adaptive path.", group="graphs")
    enable_schedule_overlap: bool = flag(True, "Prepare step t+1 on the host while step t runs.", group="graphs")
    enable_task_pipeline: bool = flag(True, "Return results and confidences asynchronously (two steps in flight).", group="graphs")
    enable_unified_mtp_graph: bool = flag(False, "Fuse draft and target into one graph. Must stay false on the adaptive path.", group="graphs")
    captured_target_rows: str = flag("all", "Target-row tiers to capture per request bucket: every legal tier, or only multiples of the bucket (one tier per average verify length; far fewer graphs to warm on a CPU).", choices=["all", "bucket_multiples"], group="graphs")
    captured_kv_spans: str = flag("auto", "KV lengths the decode keys are also captured for, besides the whole cache: a step reads the shortest that holds its requests' positions, so attention over short contexts does not pay for the longest one. `auto`: 256, 512, ... below --max_model_len on a backend that captures device graphs (cudagraph, aclgraph), none on one that runs eagerly (static), which reads only what each step needs; `off`; or a comma-separated list such as `512,1024`. Each span multiplies the keys to capture.", group="graphs")
    max_seqs_per_batch: int = flag(16, "Most requests decoded together; the largest request bucket.", group="graphs")
    acl_graph_decode_batch_size_limit: int = flag(16, "Largest captured decode request bucket.", group="graphs")
    # --- calibration and cost tables ---
    adaptive_dspark_calibration: str | None = flag(None, "JSON file overriding the built-in calibration settings; `demo` picks the short demo grid shipped for the draft width (K=5 or 7), over the captured request buckets.", group="calibration")
    adaptive_dspark_cost_table: str | None = flag(None, "Saved cost table to reuse: skips calibration and fitting, not warmup.", group="calibration")
    adaptive_dspark_cost_table_output: str | None = flag(None, "Where to save the fitted cost table; the file must not exist, its directory must.", group="calibration")
    # --- plugins ---
    plugin: tuple[str, ...] = flag((), "Extra plugin to load: an entry-point name or an importable module (repeatable).", group="plugins")

    @property
    def speculative(self) -> bool:
        """True when a draft proposes tokens (fixed-width or adaptive)."""
        return self.speculative_algorithm == "DSpark"

    @property
    def adaptive(self) -> bool:
        """True on the adaptive DSpark path, the one the spec's rules govern."""
        return self.speculative and self.enable_adaptive_speculative_decode


def config_fields() -> tuple[attrs.Attribute, ...]:
    """The fields of :class:`ServeConfig` in declaration order."""
    return attrs.fields(ServeConfig)


def type_name(attribute: attrs.Attribute) -> str:
    """A human name for a field's type, used by the parser and the CLI reference."""
    if attribute.metadata.get("kind"):
        return str(attribute.metadata["kind"])
    text = str(attribute.type)
    if "tuple" in text:
        return "string (repeatable)"
    if "bool" in text:
        return "bool"
    if "int" in text:
        return "int"
    return "path" if "None" in text else "string"


def _arg_type(attribute: attrs.Attribute) -> Any:
    kind = type_name(attribute)
    if kind == "bool":
        return parse_bool
    if kind == "int":
        return int
    return str


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one ``--flag`` per :class:`ServeConfig` field to ``parser``."""
    groups: dict[str, Any] = {}
    for attribute in config_fields():
        group_name = attribute.metadata["group"]
        group = groups.get(group_name) or parser.add_argument_group(group_name)
        groups[group_name] = group
        kwargs: dict[str, Any] = {"type": _arg_type(attribute), "help": attribute.metadata["help"], "dest": attribute.name}
        if attribute.metadata["choices"]:
            kwargs["choices"] = attribute.metadata["choices"]
        if type_name(attribute) == "string (repeatable)":
            kwargs["action"] = "append"
        kwargs["metavar"] = type_name(attribute).split()[0].upper()
        kwargs["default"] = argparse.SUPPRESS  # unset flags fall back to the attrs default
        group.add_argument(f"--{attribute.name}", **kwargs)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """Build a :class:`ServeConfig` from parsed arguments (absent flags keep defaults)."""
    values = {a.name: getattr(args, a.name) for a in config_fields() if hasattr(args, a.name)}
    if "plugin" in values:
        values["plugin"] = tuple(values["plugin"])
    return ServeConfig(**values)


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def parse_serve_args(argv: Sequence[str]) -> ServeConfig:
    """Parse serve flags (e.g. for ``table validate --against``); errors raise ConfigError."""
    parser = _RaisingParser(prog="dspark-core serve", add_help=False)
    add_serve_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))
