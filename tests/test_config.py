"""Serve flags: parsing of every flag, the supported-configuration rules, the CLI."""

from __future__ import annotations

import subprocess
import sys

import attrs
import pytest

from dspark_core.config import ServeConfig, config_fields, parse_serve_args, type_name
from dspark_core.errors import ConfigError
from dspark_core.validate import ADAPTIVE_RULES, check_config, config_problems

SPEC_FLAGS = """model draft_model backend model_impl npu_kernel_backend nnodes node_rank host port
master_node_addr speculative_algorithm num_speculative_tokens draft_sampling_mode
enable_adaptive_speculative_decode enable_graph python_graph_backend disable_graph_warmup
enable_schedule_overlap enable_task_pipeline enable_unified_mtp_graph dp_size cp_size
max_seqs_per_batch acl_graph_decode_batch_size_limit adaptive_dspark_calibration
adaptive_dspark_cost_table adaptive_dspark_cost_table_output""".split()

VALID = ["--model=smollm2", "--draft_model=default"]


def test_every_spec_flag_is_a_config_field():
    names = {a.name for a in config_fields()}
    assert set(SPEC_FLAGS) <= names
    assert {"device", "dtype", "plugin"} <= names


def _non_default_text(attribute: attrs.Attribute) -> tuple[str, object]:
    """A command-line value differing from the default, and its parsed form."""
    kind = type_name(attribute)
    if attribute.metadata["choices"]:
        choices = attribute.metadata["choices"]
        value = next((c for c in choices if c != attribute.default), choices[0])
        return str(value), value
    if kind == "bool":
        return ("false", False) if attribute.default else ("true", True)
    if kind == "int":
        return "3", 3
    if kind.startswith("string (repeatable)"):
        return "some.module", ("some.module",)
    return "/x/y", "/x/y"


@pytest.mark.parametrize("attribute", config_fields(), ids=lambda a: a.name)
def test_each_flag_parses_in_the_spec_spelling(attribute):
    text, expected = _non_default_text(attribute)
    config = parse_serve_args([f"--{attribute.name}={text}"])
    assert getattr(config, attribute.name) == expected
    # every other field keeps its default
    for other in config_fields():
        if other.name != attribute.name:
            assert getattr(config, other.name) == other.default


def test_spec_launch_example_parses():
    argv = """--model=/models/target --draft_model=/models/dspark --backend=llm --model_impl=python
    --npu_kernel_backend=TORCH --nnodes=16 --node_rank=0 --host=127.0.0.1 --port=8000
    --master_node_addr=127.0.0.1:27000 --speculative_algorithm=DSpark --num_speculative_tokens=7
    --draft_sampling_mode=greedy --enable_adaptive_speculative_decode=true --enable_graph=true
    --python_graph_backend=aclgraph --disable_graph_warmup=false --enable_schedule_overlap=true
    --enable_task_pipeline=true --enable_unified_mtp_graph=false --dp_size=1 --cp_size=1
    --max_seqs_per_batch=16 --acl_graph_decode_batch_size_limit=16
    --adaptive_dspark_cost_table_output=/results/dspark-costs.json""".split()
    config = parse_serve_args(argv)
    assert config.nnodes == 16 and config.python_graph_backend == "aclgraph"
    assert config.adaptive and config_problems(config) == []


@pytest.mark.parametrize("argv,match", [
    (["--enable_graph=yes"], r"--enable_graph: expected true or false, got 'yes'"),
    (["--num_speculative_tokens=seven"], r"--num_speculative_tokens: invalid int value: 'seven'"),
    (["--speculative_algorithm=Medusa"], r"--speculative_algorithm: invalid choice: 'Medusa'"),
    (["--no_such_flag=1"], r"unrecognized arguments: --no_such_flag=1"),
])
def test_bad_flags_name_the_flag(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_serve_args(argv)


RULE_CASES = {
    "_width": ("--num_speculative_tokens=6", "num_speculative_tokens=6: adaptive DSpark supports 5 or 7"),
    "_greedy": ("--draft_sampling_mode=sample", "draft_sampling_mode=sample: adaptive DSpark requires greedy"),
    "_dp": ("--dp_size=2", "dp_size=2: adaptive DSpark requires dp_size=1"),
    "_cp": ("--cp_size=2", "cp_size=2: adaptive DSpark requires cp_size=1"),
    "_graphs": ("--enable_graph=false", "enable_graph=false: adaptive DSpark requires graphs"),
    "_warmup": ("--disable_graph_warmup=true", "disable_graph_warmup=true: adaptive DSpark requires graph warmup"),
    "_overlap": ("--enable_schedule_overlap=false", "enable_schedule_overlap=false"),
    "_pipeline": ("--enable_task_pipeline=false", "enable_task_pipeline=false"),
    "_unified": ("--enable_unified_mtp_graph=true", "enable_unified_mtp_graph=true"),
}


def test_rule_cases_cover_every_adaptive_rule():
    assert {rule.__name__ for rule in ADAPTIVE_RULES} == set(RULE_CASES)


@pytest.mark.parametrize("rule", sorted(RULE_CASES))
def test_each_adaptive_rule_has_its_message(rule):
    flag, message = RULE_CASES[rule]
    config = parse_serve_args(VALID + [flag])
    problems = config_problems(config)
    assert len(problems) == 1 and message in problems[0]
    with pytest.raises(ConfigError, match="unsupported configuration"):
        check_config(config)
    # fixed-width DSpark and target-only serving keep their own contract
    assert config_problems(parse_serve_args(VALID + [flag, "--enable_adaptive_speculative_decode=false"])) == [] \
        or rule in ("_width", "_greedy")


def test_the_cli_reference_names_paths_and_plain_strings_apart():
    kinds = {a.name: type_name(a) for a in config_fields()}
    assert kinds["model"] == kinds["adaptive_dspark_cost_table"] == "path"
    assert kinds["served_model_name"] == "string"  # a name in the API, not a file


def test_sampling_drafts_are_refused_on_every_drafting_path():
    """The engine's drafts propose greedily; fixed-width DSpark must not accept `sample` and run greedy."""
    fixed = config_problems(parse_serve_args(VALID + ["--draft_sampling_mode=sample",
                                                      "--enable_adaptive_speculative_decode=false"]))
    assert fixed == ["draft_sampling_mode=sample: not implemented; dspark-core drafts and verifies greedily "
                     "(draft_sampling_mode=greedy)"]
    # serving the target alone runs no draft, so the flag is moot there
    assert config_problems(parse_serve_args(VALID + ["--draft_sampling_mode=sample",
                                                     "--speculative_algorithm=none"])) == []


def test_all_violations_are_reported_together():
    config = parse_serve_args(VALID + ["--num_speculative_tokens=6", "--dp_size=2", "--enable_graph=false"])
    assert len(config_problems(config)) == 3


def test_fixed_width_and_no_speculation_are_accepted():
    fixed = parse_serve_args(VALID + ["--enable_adaptive_speculative_decode=false", "--num_speculative_tokens=4",
                                      "--enable_schedule_overlap=false"])
    assert config_problems(fixed) == []
    none = parse_serve_args(["--model=smollm2", "--speculative_algorithm=none"])
    assert config_problems(none) == []


@pytest.mark.parametrize("argv,message", [
    (["--node_rank=2", "--nnodes=2"], "node_rank=2: must be in 0..1"),
    (["--port=70000"], "port=70000"),
    (["--max_pending_requests=0"], "max_pending_requests=0: must be >= 1"),
    (["--adaptive_dspark_cost_table=a.json", "--adaptive_dspark_calibration=b.json"], "are exclusive"),
    (["--adaptive_dspark_cost_table=a.json", "--adaptive_dspark_cost_table_output=b.json"], "not re-saved"),
    (["--enable_adaptive_speculative_decode=false", "--adaptive_dspark_calibration=b.json"], "need adaptive DSpark"),
])
def test_basic_launch_checks(argv, message):
    assert any(message in p for p in config_problems(parse_serve_args(VALID + argv)))


@pytest.mark.parametrize("argv,message", [
    (["--budget_policy=adaptiv"], "adaptiv"),
    (["--budget_policy=fixed", '--budget_policy_options={"k": -1}'], "k must be an integer >= 0, got -1"),
])
def test_the_budget_policy_is_built_before_any_model_is_read(tmp_path, argv, message):
    from dspark_core.errors import DSparkError
    from dspark_core.startup import resolve_launch

    # the checkpoint does not exist: the error must be the policy's, found before it is looked for
    config = parse_serve_args([f"--model={tmp_path / 'missing.gguf'}", "--draft_model=default",
                               "--enable_adaptive_speculative_decode=false", *argv])
    with pytest.raises(DSparkError, match=message) as info:
        resolve_launch(config)
    assert "missing.gguf" not in str(info.value)


def test_model_is_required():
    assert any("model: required" in p for p in config_problems(ServeConfig()))


def test_serve_refuses_unsupported_width_via_console_script():
    result = subprocess.run(
        [sys.executable, "-m", "dspark_core.cli", "serve", "--model=smollm2", "--draft_model=default",
         "--num_speculative_tokens=6", "--enable_adaptive_speculative_decode=true"],
        capture_output=True, text=True,
    )
    assert result.returncode != 0
    assert "num_speculative_tokens=6: adaptive DSpark supports 5 or 7" in result.stderr


def test_serve_help_lists_every_flag():
    result = subprocess.run([sys.executable, "-m", "dspark_core.cli", "serve", "--help"],
                            capture_output=True, text=True, check=True)
    for name in SPEC_FLAGS:
        assert f"--{name}" in result.stdout
