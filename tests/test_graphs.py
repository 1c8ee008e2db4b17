"""Graph backends: every binding key is prepared at warmup, nothing is prepared after ready."""

from __future__ import annotations

import pytest
import torch

from dspark_core.device import DeviceSpec
from dspark_core.engine.engine import Engine, EngineConfig
from dspark_core.engine.request import SamplingParams
from dspark_core.errors import ConfigError
from dspark_core.geometry import Geometry, legal_tiers
from dspark_core.graphs import BindingKey, CapturedGraphBackend, GraphApi, GraphError, cuda_graph_api
from dspark_core.plugins import default_hooks
from engine_support import greedy_references, random_prompts, synthetic_table, tiny_pair

CPU = DeviceSpec("cpu", "cpu", "float32", "static", "gloo")


@pytest.fixture(scope="module")
def models():
    return tiny_pair(seed=11)


def static_engine(models, *, buckets=(1, 2, 4), width=5, policy="adaptive", overlap=True, geometry=None):
    backend = default_hooks().graph_backend("static", CPU)
    config = EngineConfig(draft_width=width, policy=policy, request_buckets=buckets, max_model_len=160,
                          schedule_overlap=overlap)
    engine = Engine(*models, config, graphs=backend, geometry=geometry)
    engine.warmup()
    return engine, backend


def test_warmup_prepares_every_bucket_and_tier(models):
    engine, backend = static_engine(models)
    expected = {(b, g) for b in (1, 2, 4) for g in legal_tiers(b, 5)}
    assert {(k.request_bucket, k.target_rows) for k in backend.keys if k.stage == "verify"} == expected
    # one proposal key per bucket: the draft's block runs through the backend too
    assert {(k.request_bucket, k.target_rows) for k in backend.keys if k.stage == "propose"} == {(1, 0), (2, 0), (4, 0)}
    # the bucket's own tier also has a key that writes the draft's context (for drafted steps)
    assert {(k.request_bucket, k.target_rows) for k in backend.keys if k.stage == "verify+context"} == {
        (1, 1), (2, 2), (4, 4)}
    assert {k.stage for k in backend.keys} == {"verify", "verify+context", "propose"}
    assert all(k.draft_width == 5 and k.dtype == "float64" and k.device == "cpu" for k in backend.keys)
    assert engine.work_counters()["warmups"] == len(expected) + 3 + 3
    # warmup wrote only into the scratch slot: live slots' caches are still zero
    assert float(engine.runner.target_cache.keys[:, : engine.runner.num_slots].abs().sum()) == 0.0
    engine.close()


def test_serving_many_shapes_after_ready_prepares_nothing(models):
    target = models[0]
    # a table covering only short KV: later steps fall outside and use the full-width path
    table = synthetic_table(5, (1, 2, 4), max_kv=40)
    engine, backend = static_engine(models)
    engine.install_table(table)
    engine.mark_ready()
    before = engine.work_counters()
    prompts = random_prompts(9, seed=2)
    for batch in (1, 3, 4, 2):  # different live counts -> different buckets and tiers
        outputs = engine.generate(prompts[:batch], SamplingParams(max_tokens=12, ignore_eos=True))
        assert [list(o.token_ids) for o in outputs] == greedy_references(target, prompts[:batch], 12)
    assert engine.work_counters() == before
    assert 0 < engine.counters.fallback_steps < engine.counters.steps  # both paths were served
    # one verify replay per step, one proposal replay per drafted step
    drafted = engine.counters.steps - engine.counters.draft_off_steps
    assert backend.counters.replays == engine.counters.steps + drafted > 0
    engine.close()


def test_restricted_geometry_uses_only_captured_tiers(models):
    geometry = Geometry(5, (1, 2), {1: (1, 3, 6), 2: (2, 7, 12)})
    engine, backend = static_engine(models, buckets=(1, 2), policy="fixed", geometry=geometry)
    engine.mark_ready()
    prompts = random_prompts(2, seed=4)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [list(o.token_ids) for o in outputs] == greedy_references(models[0], prompts, 10)
    # the six verify keys, a proposal key per bucket and the own tier's context-writing key per bucket
    assert len(backend.keys) == 6 + 2 + 2
    engine.close()


def test_sealed_backend_refuses_unknown_keys(models):
    engine, backend = static_engine(models, buckets=(1,))
    engine.mark_ready()
    key = BindingKey(5, 2, 4, "float64", "cpu")
    with pytest.raises(GraphError, match="was not prepared at warmup"):
        backend.run(key, {})
    with pytest.raises(GraphError, match="sealed"):
        backend.prepare(key, lambda **_: (torch.zeros(1),), {})
    engine.close()


class RecordingGraph:
    """Stands in for torch.cuda.CUDAGraph on CPU: replays the captured function."""

    current = None

    def __init__(self):
        self.fn = None

    def replay(self):
        self.fn()


class RecordingApi:
    """A CPU stand-in for the device runtime so the capture bookkeeping runs here; with ``pools`` it
    also hands out memory-pool tokens, as ``torch.cuda.graph_pool_handle`` does."""

    def __init__(self, pools: bool = False):
        self.captured = []
        self.pools = []  # the pool argument of each capture (None: none given, a private pool)
        self.handles = [] if pools else None  # every token pool_handle made

    def api(self) -> GraphApi:
        outer = self

        class Ctx:
            def __init__(self, graph=None):
                self.graph = graph

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        class Stream:
            def wait_stream(self, other):
                pass

        def graph_ctx(graph, pool=None):
            outer.captured.append(graph)
            outer.pools.append(pool)
            return Ctx(graph)

        def pool_handle():
            outer.handles.append(object())
            return outer.handles[-1]

        return GraphApi(RecordingGraph, graph_ctx, Stream, lambda s: Ctx(), lambda: Stream(),
                        pool_handle if self.handles is not None else None)

    def backend(self) -> CapturedGraphBackend:
        """A captured backend on this API (a new one per call, as each engine builds its own)."""
        recording = self

        class Backend(CapturedGraphBackend):
            def _graph_api(self):
                return recording.api()

        return Backend("cpu")


def test_captured_backend_captures_once_per_key_and_replays_static_buffers():
    recording = RecordingApi()

    backend = recording.backend()
    key = BindingKey(5, 1, 3, "float32", "cpu")
    out = torch.zeros(3)

    def fn(x):
        out.copy_(x * 2)
        return (out,)

    backend.prepare(key, fn, {"x": torch.ones(3)})
    backend.prepare(key, fn, {"x": torch.ones(3)})  # second prepare of the same key is a no-op
    assert backend.counters.captures == 1 and len(recording.captured) == 1
    graph = recording.captured[0]
    static_x = backend._prepared[key].inputs["x"]
    graph.fn = lambda: fn(static_x)
    (result,) = backend.run(key, {"x": torch.tensor([1.0, 2.0, 3.0])})
    assert result.tolist() == [2.0, 4.0, 6.0]
    assert backend.counters.replays == 1


def test_captured_backend_records_each_key_family_into_one_shared_pool():
    """Proposal and copy keys share one memory pool, verify keys another, each made at the family's
    first capture: a step replays at most one key per family, so their temporaries may share memory,
    and a verify replay never overwrites the proposal it verifies. Every backend makes its own pools."""
    recording = RecordingApi(pools=True)

    def fn(x):
        return (x * 2,)

    order = []  # the keys in warmup's order: a bucket's proposal keys, then its verify keys
    for bucket in (1, 2):
        order += [BindingKey(5, bucket, 0, "float32", "cpu", stage=stage, kv_span=span)
                  for stage in ("propose", "propose+copy", "copy") for span in (0, 64)]
        order += [BindingKey(5, bucket, rows, "float32", "cpu", stage=stage, kv_span=span)
                  for rows, stage in ((bucket, "verify"), (bucket, "verify+context"), (bucket + 4, "verify"))
                  for span in (0, 64)]
    backend = recording.backend()
    for key in order:
        backend.prepare(key, fn, {"x": torch.ones(2)})
    assert backend.counters.captures == len(order) and len(recording.handles) == 2
    proposals, verifies = recording.handles
    for key, pool in zip(order, recording.pools, strict=True):
        assert pool is (verifies if key.stage.startswith("verify") else proposals), key.describe()
    # an engine built later captures into pools of its own
    recording.backend().prepare(order[0], fn, {"x": torch.ones(2)})
    assert len(recording.handles) == 3 and recording.pools[-1] is recording.handles[2]


def test_graph_apis_without_pool_handles_keep_a_private_pool_per_capture():
    recording = RecordingApi()

    backend = recording.backend()
    for stage in ("propose", "verify"):
        backend.prepare(BindingKey(5, 1, 1, "float32", "cpu", stage=stage), lambda x: (x + 1,), {"x": torch.ones(1)})
    assert recording.pools == [None, None]  # no pool argument at all
    # the CUDA backend shares pools through torch's own tokens
    assert cuda_graph_api().pool_handle is torch.cuda.graph_pool_handle


@pytest.mark.parametrize("name,device,match", [
    ("cudagraph", CPU, "cudagraph needs device=cuda"),
    ("aclgraph", CPU, "aclgraph needs device=npu"),
])
def test_device_graph_backends_refuse_the_wrong_device(name, device, match):
    with pytest.raises(ConfigError, match=match):
        default_hooks().graph_backend(name, device)


def test_llama_static_shape_forward_equals_eager():
    """What a captured graph runs (no host reads, shapes fixed by the key) gives the eager result."""
    from dspark_core.graphs import static_shapes
    from dspark_core.models.base import ForwardBatch, make_forward_batch
    from dspark_core.models.random_models import random_target, tiny_target_config

    target = random_target(tiny_target_config(max_position=64), seed=5, dtype=torch.float64)
    eager_cache, static_cache = target.new_cache(4, 64), target.new_cache(4, 64)
    prefill = make_forward_batch([[1, 2, 3, 4, 5], [7, 8]], [0, 0], [0, 2])
    target.forward(prefill, eager_cache)
    target.forward(prefill, static_cache)
    # a verify batch as the runner builds it: 3 rows on slot 0, 1 on slot 2, an empty request
    # (slot 1) and 2 padding rows on the scratch slot 3
    as_long = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    batch = ForwardBatch(as_long([9, 10, 11, 12, 0, 0]), as_long([5, 6, 7, 2, 0, 1]), as_long([0, 2, 1, 3]),
                         as_long([0, 3, 4, 4, 6]))
    eager = target.forward(batch, eager_cache, hidden_layers=(1, 3))
    with static_shapes():
        static = target.forward(batch, static_cache, hidden_layers=(1, 3))
    assert torch.allclose(eager.logits, static.logits, atol=1e-9)
    assert torch.allclose(eager.hidden, static.hidden, atol=1e-9)


def test_a_drafted_step_at_the_own_tier_writes_the_draft_context_inside_its_key(models):
    """fixed k=0 drafts every step and verifies nothing drafted: the bucket's own tier. Those rows go
    into the draft's context inside the ``verify+context`` key (nothing left queued for the next
    proposal to write outside a key), and the output is still target-only greedy."""
    engine, backend = static_engine(models, buckets=(1, 2), overlap=False)
    engine.mark_ready()
    ran, inner = [], backend.run
    backend.run = lambda key, inputs: (ran.append(key), inner(key, inputs))[1]
    queued_after_verify = []
    verify_commit = engine.runner.verify_commit

    def watched(*args, **kwargs):
        result = verify_commit(*args, **kwargs)
        queued_after_verify.append(engine.runner.draft_context.rows)
        return result

    engine.runner.verify_commit = watched
    prompts = random_prompts(2, seed=6)
    with engine.use_policy(default_hooks().budget_policy("fixed", {"k": 0})):
        outputs = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [list(o.token_ids) for o in outputs] == greedy_references(models[0], prompts, 8)
    verify_keys = [k for k in ran if k.stage != "propose"]
    assert verify_keys and all(k.stage == "verify+context" and k.target_rows == k.request_bucket for k in verify_keys)
    assert queued_after_verify and set(queued_after_verify) == {0}
    engine.close()
