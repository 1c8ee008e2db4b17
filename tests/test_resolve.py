"""dspark_core.resolve: one resolution of ``auto`` and of the launch fingerprint, shared by startup and ``table``."""

from __future__ import annotations

from dspark_core.commands.table import _launch
from dspark_core.config import parse_serve_args
from dspark_core.device import DeviceSpec
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
    assert launch.execution.graph_backend == "static" and launch.execution.dtype == "float32"


def test_kv_reserve_is_two_launched_steps_of_k_plus_one_rows():
    assert kv_reserve(7) == 16 and kv_reserve(0) == 2
