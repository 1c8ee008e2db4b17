"""Compatibility of a saved bundle with a launch: every mismatch reported, widths never mixed."""

from __future__ import annotations

import pytest
from attrs import evolve

from dspark_core.config import parse_serve_args
from dspark_core.costs.fingerprint import ModelIdentity, identity_of, launch_fingerprint
from dspark_core.errors import ConfigError, TableError
from dspark_core.geometry import Geometry
from dspark_core.table import check_compatible, fit_table
from test_costs_support import LOOKUP, fingerprint, grid_samples, settings, simple_cost


def bundle(draft_width=3, buckets=(1, 2, 4)):
    samples = grid_samples(simple_cost, buckets, draft_width)
    return fit_table(settings(draft_width=draft_width, buckets=buckets), samples, LOOKUP, fingerprint(draft_width, buckets))


def test_identical_launch_passes_with_a_full_check():
    assert check_compatible(bundle(), fingerprint(), draft_width=3) is None


def test_every_mismatching_field_is_reported_one_per_line():
    launch = fingerprint(device="cuda", dtype="bfloat16", dp=2)
    launch = evolve(launch, target=ModelIdentity("target.gguf", "sha256:cc", 1000))
    with pytest.raises(TableError) as err:
        check_compatible(bundle(), launch, draft_width=3)
    lines = str(err.value).splitlines()
    assert lines[0] == "cost table <memory> does not match this launch (4 field(s) differ):"
    assert lines[1:] == [
        '  target.config_digest: saved "sha256:aa", launch "sha256:cc"',
        "  parallelism.dp: saved 1, launch 2",
        '  execution.device: saved "cpu", launch "cuda"',
        '  execution.dtype: saved "float32", launch "bfloat16"',
    ]


def test_width_mismatch_is_always_an_error_and_listed_with_the_rest():
    with pytest.raises(TableError) as err:
        check_compatible(bundle(draft_width=7), fingerprint(draft_width=5), draft_width=5)
    text = str(err.value)
    assert "draft_width: saved 7, launch 5" in text
    assert "execution.geometry.draft_width: saved 7, launch 5" in text


def test_width_is_checked_even_without_a_launch_fingerprint():
    with pytest.raises(TableError, match="draft_width: saved 3, launch 7"):
        check_compatible(bundle(), None, draft_width=7)
    assert "only its draft width was checked" in check_compatible(bundle(), None, draft_width=3)


def test_different_captured_geometry_is_a_mismatch():
    with pytest.raises(TableError, match=r"execution.geometry.request_buckets: saved \[1, 2, 4\], launch \[1, 2\]"):
        check_compatible(bundle(), fingerprint(buckets=(1, 2)), draft_width=3)


def test_identity_of_a_directory_and_a_file(tmp_path):
    ckpt = tmp_path / "dspark"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"block_size": 8}')
    (ckpt / "model.safetensors").write_bytes(b"x" * 100)
    ident = identity_of(ckpt)
    assert ident.name == "dspark" and ident.size_bytes == 100 + len('{"block_size": 8}')
    (ckpt / "config.json").write_text('{"block_size": 6}')
    assert identity_of(ckpt).config_digest != ident.config_digest
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    assert identity_of(gguf) == ModelIdentity("t.gguf", identity_of(gguf).config_digest, 64)
    with pytest.raises(ConfigError, match="no such file or directory"):
        identity_of(tmp_path / "missing")


def test_launch_fingerprint_from_serve_flags(tmp_path):
    target = tmp_path / "t.gguf"
    target.write_bytes(b"GGUF")
    config = parse_serve_args([f"--model={target}", "--nnodes=4", "--dp_size=1", "--cp_size=1", "--device=cpu",
                               "--python_graph_backend=static", "--dtype=float32", "--num_speculative_tokens=5"])
    geometry = Geometry.all_tiers(5, (1, 2))
    fp = launch_fingerprint(config, geometry, draft_path=None)
    assert fp.parallelism.tp == 4 and fp.parallelism.nnodes == 4
    assert fp.execution.device == "cpu" and fp.execution.graph_backend == "static" and fp.execution.geometry == geometry
    assert fp.target.name == "t.gguf" and fp.draft is None
