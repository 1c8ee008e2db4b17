"""Multi-rank pieces that need no second process: shard maths, messages, timeouts, table compatibility."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from dspark_core.calibration.settings import CalibrationSettings, ContextInterval
from dspark_core.config import parse_serve_args
from dspark_core.costs.fingerprint import launch_fingerprint
from dspark_core.distributed.control import IntervalRecorder, decode_prefill, encode_prefill
from dspark_core.distributed.group import DistributedError, RankLostError, Timeouts, collective, parse_master_addr
from dspark_core.distributed.tp import TensorParallelLlama, shard_llama, split_range
from dspark_core.errors import ConfigError, TableError
from dspark_core.geometry import Geometry
from dspark_core.models.base import make_forward_batch
from dspark_core.models.random_models import random_target, tiny_target_config
from dspark_core.costs.base import CostSample
from dspark_core.geometry import legal_tiers
from dspark_core.table import check_compatible, default_lookup, dumps_table, fit_table, loads_table


def test_split_range_covers_everything_once_with_uneven_parts():
    assert [split_range(3, 2, r) for r in (0, 1)] == [(0, 2), (2, 3)]  # SmolLM2's 3 KV heads over 2 ranks
    assert [split_range(1536, 2, r) for r in (0, 1)] == [(0, 768), (768, 1536)]
    for total, parts in [(7, 3), (16, 4), (5, 5)]:
        spans = [split_range(total, parts, r) for r in range(parts)]
        assert spans[0][0] == 0 and spans[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_sharding_refuses_more_ranks_than_kv_heads():
    target = random_target(tiny_target_config(num_kv_heads=2, num_heads=4), seed=0)
    assert shard_llama(target, 0, 1) is target  # one rank: untouched
    with pytest.raises(ConfigError, match="2 key/value heads, so at most 2"):
        shard_llama(target, 0, 3)


class ThreadReduce:
    """All-reduce between threads standing in for ranks (sums in rank order)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world)
        self.parts: list[torch.Tensor | None] = [None] * world

    def for_rank(self, rank: int):
        def reduce(partial: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = partial.clone()
            self.barrier.wait()
            total = sum(self.parts[1:], self.parts[0].clone())
            self.barrier.wait()
            partial.copy_(total)
            return partial
        return reduce


@pytest.mark.parametrize("kv_heads,heads,world", [(2, 4, 2), (3, 9, 2), (3, 6, 3)])
def test_sharded_forward_equals_the_full_model(kv_heads, heads, world):
    cfg = tiny_target_config(num_kv_heads=kv_heads, num_heads=heads, intermediate_size=50, max_position=64)
    full = random_target(cfg, seed=1, dtype=torch.float64)
    batch = make_forward_batch([[1, 2, 3, 4, 5], [9, 8, 7]], [0, 0], [0, 1])
    expected = full.forward(batch, full.new_cache(2, 32), hidden_layers=(1, cfg.num_layers)).logits
    reducer = ThreadReduce(world)
    outputs: dict[int, torch.Tensor] = {}

    def run(rank: int) -> None:
        torch.set_num_threads(1)
        shard = shard_llama(copy.deepcopy(full), rank, world)
        assert isinstance(shard, TensorParallelLlama) and shard.config == cfg
        assert shard.local.num_kv_heads == split_range(kv_heads, world, rank)[1] - split_range(kv_heads, world, rank)[0]
        shard._reduce = reducer.for_rank(rank)
        cache = shard.new_cache(2, 32)
        assert cache.keys.shape[2] == shard.local.num_kv_heads
        outputs[rank] = shard.forward(batch, cache, hidden_layers=(1, cfg.num_layers)).logits

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rank in range(world):
        torch.testing.assert_close(outputs[rank], expected, rtol=1e-9, atol=1e-9)
        assert torch.equal(outputs[rank].argmax(-1), expected.argmax(-1))


def test_prefill_messages_round_trip():
    prompts, slots = [[1, 2, 3], [7], [4, 4, 4, 4]], [2, 0, 1]
    assert decode_prefill(encode_prefill(prompts, slots)) == (prompts, slots)


def test_worker_intervals_cut_like_the_probe():
    recorder = IntervalRecorder()
    recorder.begin([2, 1, 4])  # bucket 2, warmup 1, 4 timed intervals
    times = []
    for live in [1, 2, 2, 2, 2, 2, 2]:
        recorder.decoded(live)
        if live == 2:
            times.append(recorder._stamps[-1])
    recorder.end()
    assert recorder.intervals == [b - a for a, b in zip(times[:4], times[1:5])]
    recorder.begin([2, 1, 3])  # a run that came short keeps its positions, padded with zeros
    for live in [2, 2]:
        recorder.decoded(live)
    recorder.end()
    assert len(recorder.intervals) == 7 and recorder.intervals[5:] == [0.0, 0.0] and recorder.intervals[4] > 0


def test_master_addr_and_timeouts_are_checked(monkeypatch):
    assert parse_master_addr("10.0.0.1:27000") == ("10.0.0.1", 27000)
    assert parse_master_addr("[::1]:29500") == ("::1", 29500)
    for bad in ("10.0.0.1", ":27000", "host:x", "host:70000"):
        with pytest.raises(DistributedError, match="expected host:port"):
            parse_master_addr(bad)
    monkeypatch.setenv("DSPARK_DIST_INIT_TIMEOUT", "7.5")
    assert Timeouts.from_env().init == 7.5
    monkeypatch.setenv("DSPARK_DIST_STEP_TIMEOUT", "soon")
    with pytest.raises(DistributedError, match="DSPARK_DIST_STEP_TIMEOUT"):
        Timeouts.from_env()


def test_a_table_saved_on_one_rank_is_refused_on_two(tmp_path):
    target = tmp_path / "t.gguf"
    target.write_bytes(b"GGUF")
    geometry = Geometry.all_tiers(5, (1, 2))
    common = [f"--model={target}", "--device=cpu", "--python_graph_backend=static", "--dtype=float32",
              "--num_speculative_tokens=5"]
    one = launch_fingerprint(parse_serve_args([*common, "--nnodes=1"]), geometry, draft_path=None)
    two = launch_fingerprint(parse_serve_args([*common, "--nnodes=2", "--node_rank=1"]), geometry, draft_path=None)
    assert (two.parallelism.nnodes, two.parallelism.tp) == (2, 2)
    samples = [CostSample(b, rows, 0, 0.01 * rows + 0.002 * b, 4) for b in (1, 2) for rows in legal_tiers(b, 5)]
    settings = CalibrationSettings(model="additive", draft_width=5, request_buckets=(1, 2), contexts=(ContextInterval(64, 1, 4096),),
                                   warmup_steps=1, window_steps=4, windows_per_point=1, token_seed=1)
    table = fit_table(settings, samples, default_lookup(), fingerprint=one)
    saved = loads_table(dumps_table(table), default_lookup())
    assert check_compatible(saved, one, 5) is None
    with pytest.raises(TableError) as info:
        check_compatible(saved, two, 5)
    assert "parallelism.nnodes: saved 1, launch 2" in str(info.value)
    assert "parallelism.tp: saved 1, launch 2" in str(info.value)
    # node_rank is not part of the fingerprint: every rank of one launch agrees
    other_rank = launch_fingerprint(parse_serve_args([*common, "--nnodes=2", "--node_rank=0"]), geometry, draft_path=None)
    assert other_rank == two



def test_only_communication_errors_mean_a_lost_rank():
    with pytest.raises(RankLostError, match="rank 1: decode step failed, a peer rank is gone or stuck"):
        with collective("decode step", 1):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    with pytest.raises(ValueError):  # a bug in the step itself is not blamed on a peer
        with collective("decode step", 1):
            raise ValueError("shape mismatch")
    with pytest.raises(RuntimeError, match="expected a tensor"):
        with collective("decode step", 1):
            raise RuntimeError("expected a tensor of rank 2")


def test_only_tensor_parallel_layouts_start(tmp_path):
    from dspark_core.distributed.launch import start_rank

    config = parse_serve_args([f"--model={tmp_path}", "--nnodes=2", "--dp_size=2", "--enable_adaptive_speculative_decode=false"])
    with pytest.raises(DistributedError, match="tensor parallelism only"):
        start_rank(config)
    with pytest.raises(DistributedError, match="nnodes >= 2"):
        start_rank(parse_serve_args([f"--model={tmp_path}"]))


def test_decode_announcement_carries_the_kv_span_and_draft_depth():
    """A worker replays the keys of rank 0's span and draft depth: the DECODE payload holds both, and the
    replayed step gets them (a worker's policy cannot work out the depth: it only replays decisions)."""
    from types import SimpleNamespace

    from dspark_core.distributed.control import encode_decode, replay_decode

    step = SimpleNamespace(draft=True, copy_only=False, kv_span=512, draft_depth=3, policy=SimpleNamespace(uses_draft=True),
                           tier_context=SimpleNamespace(request_bucket=4))
    payload = encode_decode(step, [3, 1])
    replayed = []
    engine = SimpleNamespace(runner=SimpleNamespace(device=torch.device("cpu")), storage=None,
                             policy=SimpleNamespace(uses_draft=True), config=SimpleNamespace(draft_width=5),
                             geometry=Geometry.bucket_multiples(5, (1, 2, 4)), decode_on_device=replayed.append)
    assert replay_decode(engine, None, payload) == 2
    (got,) = replayed
    assert (got.kv_span, got.slots.tolist(), got.tier_context.request_bucket, got.draft) == (512, [3, 1], 4, True)
    assert got.draft_depth == 3
