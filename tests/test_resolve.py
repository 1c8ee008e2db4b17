"""dspark_core.resolve: one resolution of ``auto`` and of the launch fingerprint, shared by startup and ``table``."""

from __future__ import annotations

import attrs
import pytest
import torch

from dspark_core.commands.table import _launch
from dspark_core.costs.fingerprint import compare
from dspark_core.config import parse_serve_args
from dspark_core.device import DeviceSpec, resolve_draft_dtype
from dspark_core.geometry import Geometry, kv_reserve
from dspark_core.plugins import default_hooks
from dspark_core.resolve import captured_geometry, fingerprint_for, graph_backend_for, pick_device

GPU = DeviceSpec(name="gpu", torch_device="cpu", default_dtype="bfloat16", default_graph_backend="gpugraph",
                 distributed_backend="gloo")


def test_graph_backend_auto_explicit_and_disabled():
    assert graph_backend_for(parse_serve_args([]), GPU) == "gpugraph"
    assert graph_backend_for(parse_serve_args(["--python_graph_backend=static"]), GPU) == "static"
    assert graph_backend_for(parse_serve_args(["--enable_graph=false"]), GPU) == "disabled"


def test_captured_geometry_follows_the_flags():
    flags = ["--num_speculative_tokens=3", "--max_seqs_per_batch=2"]
    assert captured_geometry(parse_serve_args(flags)) == Geometry.all_tiers(3, (1, 2))
    multiples = parse_serve_args([*flags, "--captured_target_rows=bucket_multiples"])
    assert captured_geometry(multiples) == Geometry.bucket_multiples(3, (1, 2))
    assert captured_geometry(parse_serve_args([*flags, "--speculative_algorithm=none"])).draft_width == 0


def test_table_validate_and_a_launch_build_the_same_fingerprint(tmp_path):
    target = tmp_path / "target.gguf"
    target.write_bytes(b"GGUF" + bytes(100))
    flags = [f"--model={target}", "--num_speculative_tokens=3", "--max_seqs_per_batch=2", "--device=cpu",
             "--captured_target_rows=bucket_multiples"]
    config = parse_serve_args(flags)
    device = pick_device(default_hooks(), "cpu")
    launch = fingerprint_for(config, device, geometry=captured_geometry(config), target_path=target)
    described, width = _launch(flags, default_hooks())
    assert (described, width) == (launch, 3)
    assert launch.execution.graph_backend == "static" and launch.execution.dtype == device.default_dtype


def test_kv_reserve_is_two_launched_steps_of_k_plus_one_rows():
    assert kv_reserve(7) == 16 and kv_reserve(0) == 2


def test_draft_dtype_auto_is_the_device_draft_default_else_the_target_dtype():
    narrow = attrs.evolve(GPU, default_draft_dtype="bfloat16")
    assert resolve_draft_dtype("auto", GPU, "float32") == "float32"
    assert resolve_draft_dtype("auto", narrow, "float32") == "bfloat16"
    assert resolve_draft_dtype("float16", narrow, "float32") == "float16"


def test_fingerprint_records_the_draft_dtype_only_where_it_differs(tmp_path):
    target = tmp_path / "target.gguf"
    target.write_bytes(b"GGUF" + bytes(100))
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    config = parse_serve_args([f"--model={target}", f"--draft_model={draft}", "--dtype=float32"])
    cpu = attrs.evolve(GPU, default_dtype="float32")
    same = fingerprint_for(config, cpu, target_path=target, draft_path=draft)
    narrow = fingerprint_for(config, attrs.evolve(cpu, default_draft_dtype="bfloat16"), target_path=target,
                             draft_path=draft)
    assert same.execution.draft_dtype is None and narrow.execution.draft_dtype == "bfloat16"
    assert [m.field for m in compare(same, narrow)] == ["execution.draft_dtype"]
    no_draft = parse_serve_args([f"--model={target}", "--draft_dtype=bfloat16"])  # nothing drafts: nothing recorded
    assert fingerprint_for(no_draft, cpu, target_path=target).execution.draft_dtype is None


@pytest.mark.parametrize("capability,expected", [({"avx512_bf16": True}, "bfloat16"), ({"amx_bf16": True}, "bfloat16"),
                                                 ({"avx512_bf16": False}, None)])
def test_cpu_drafts_in_bfloat16_only_where_products_are_native(monkeypatch, capability, expected):
    import torch

    monkeypatch.setattr(torch._C._cpu, "_get_cpu_capability", lambda: capability)
    assert pick_device(default_hooks(), "cpu").default_draft_dtype == expected


def test_generate_refuses_an_unusable_device_before_loading_the_model(tmp_path, capsys):
    from dspark_core.cli import main

    missing = tmp_path / "missing.gguf"  # never read: the device is checked first
    assert main(["generate", f"--model={missing}", "--prompt=x", "--device=tpu"]) == 2
    assert "no device named 'tpu' (available: cpu, cuda, npu)" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["generate", f"--model={missing}", "--prompt=x", "--device=cuda:0"]) == 2
        assert "device=cuda: this PyTorch build sees no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--draft_model=default", "--num_speculative_tokens=0"],
     "--num_speculative_tokens must be >= 1 with a draft, got 0 (omit --draft_model"),
    (["--num_speculative_tokens=-2"], "--num_speculative_tokens must be >= 0, got -2"),
    (["--max_batch=0"], "--max_batch must be >= 1, got 0"),
    (["--policy_options=[1]"], "--policy_options: must be a JSON object, got '[1]'"),
    (["--policy=adaptiv"], "adaptiv"),
    (["--policy=fixed", '--policy_options={"k": -1}'], "k must be an integer >= 0, got -1"),
])
def test_generate_refuses_bad_flags_before_loading_the_model(tmp_path, capsys, flags, message):
    from dspark_core.cli import main

    missing = tmp_path / "missing.gguf"  # never read: the width is checked first
    assert main(["generate", f"--model={missing}", "--prompt=x", *flags]) == 2
    assert message in capsys.readouterr().err


def test_generate_reads_its_prompts_file_before_the_model(tmp_path, capsys):
    from dspark_core.cli import main

    missing = tmp_path / "missing.gguf"
    assert main(["generate", f"--model={missing}", f"--prompts={tmp_path / 'nope.jsonl'}"]) == 2
    err = capsys.readouterr().err
    assert "nope.jsonl" in err and "missing.gguf" not in err


def test_an_unknown_flag_gets_the_commands_usage_and_the_flag_probably_meant(capsys):
    from dspark_core.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model=smollm2", "--num-speculative-tokens=5", "--bogus_flag=1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: dspark-core serve" in err  # the command's usage, not the top level's
    assert "unrecognized arguments: --num-speculative-tokens=5 --bogus_flag=1" in err
    assert "--num-speculative-tokens: did you mean --num_speculative_tokens?" in err
    assert "--bogus_flag: did you mean" not in err  # nothing close: no guess
