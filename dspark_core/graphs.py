"""Graph backends: one prepared executable per binding key, all made before ready.

A binding key fixes everything a captured graph depends on: the part of the
step it runs (``propose``: the draft's block for a request bucket; ``verify``:
the target forward for a bucket and tier), draft width K, request bucket,
target rows, dtype and device. Warmup prepares every key the
calibration or serving may use; after :meth:`GraphBackend.seal` (the engine
is ready) an unknown key is an error, never a capture, so serving cannot
recapture. Backends differ only in what "prepare" and "run" mean:

* ``static`` (CPU): preallocated input buffers per key, warmed once, run eagerly;
* ``cudagraph``: ``torch.cuda.CUDAGraph`` captured per key, replayed;
* ``aclgraph``: torch_npu's NPU graph captured per key, replayed.

Where the graph API offers shared memory pools (``cudagraph``), the captures
of a key family share one (:func:`pool_family`): a graph keeps its outputs,
but the memory its capture freed (its temporaries) may then be handed to the
temporaries or outputs of the family's later captures. So a key's outputs are
valid only until the next replay of *any* key of its family; the engine reads
or copies them before that (a step replays at most one key per family).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from attrs import define, frozen

from dspark_core.errors import DSparkError

GraphFn = Callable[..., tuple[torch.Tensor, ...]]


_STATIC_SHAPES = contextvars.ContextVar("dspark_static_shapes", default=False)
_KV_SPAN = contextvars.ContextVar("dspark_kv_span", default=0)


@contextmanager
def static_shapes(kv_span: int = 0) -> Iterator[None]:
    """Ask targets and the draft for their static-shape forward inside this block (this thread only).

    A device graph records kernels with fixed shapes and cannot read values back
    to the host while recording. Targets normally size their attention from the
    batch (host reads); in static mode they use shapes fixed by the binding key
    (every row of the tier, the full cache length), with identical results. The
    DSpark draft does the same for its context read (the whole per-slot context
    cache, masked by position).

    ``kv_span`` > 0 reads only the first ``kv_span`` positions of each slot
    instead of the whole cache: a key captured for a span serves steps whose
    every position is below it (see :class:`BindingKey`).
    """
    token, span = _STATIC_SHAPES.set(True), _KV_SPAN.set(kv_span)
    try:
        yield
    finally:
        _KV_SPAN.reset(span)
        _STATIC_SHAPES.reset(token)


def static_shapes_active() -> bool:
    """True inside :func:`static_shapes`."""
    return _STATIC_SHAPES.get()


def static_kv_length(cache_length: int) -> int:
    """Key positions a static-shape forward reads per slot: the span of :func:`static_shapes`, or the
    whole ``cache_length`` without one."""
    span = _KV_SPAN.get()
    if span > cache_length:
        raise GraphError(f"KV span {span} is longer than the cache ({cache_length} positions)")
    return span or cache_length


class GraphError(DSparkError):
    """A step asked for a binding key that was not prepared at warmup."""


@frozen
class BindingKey:
    """Everything a prepared graph is specialised for."""

    draft_width: int
    request_bucket: int
    target_rows: int  # 0 for a proposal (it has one block per bucket slot, not tier rows)
    dtype: str
    device: str
    # "verify" (target forward), "verify+context" (the bucket's own tier, also writing the draft's
    # context: drafted steps) or "propose" (draft block)
    stage: str = "verify"
    # key positions read per slot (0: the whole cache). On a captured backend attention over the
    # cache length costs the same for a 100-token request as for a 2 000-token one, so the keys
    # that read the KV cache are prepared for a few spans and a step takes the shortest that holds
    # every position it may touch
    kv_span: int = 0
    # tokens a proposal key drafts where fewer than K (--draft_depths); 0: all K
    draft_depth: int = 0

    def describe(self) -> str:
        rows = f" rows={self.target_rows}" if self.stage.startswith("verify") else ""
        span = f" kv={self.kv_span}" if self.kv_span else ""
        depth = f" depth={self.draft_depth}" if self.draft_depth else ""
        return f"{self.stage} K={self.draft_width} bucket={self.request_bucket}{rows}{span}{depth} {self.dtype}@{self.device}"


def pool_family(key: BindingKey) -> str:
    """The memory pool a captured backend records ``key`` into: ``verify`` for the verify keys,
    ``propose`` for the keys that run before them (proposal and copy keys).

    A decode step replays at most one key of each family, proposal first, and every output of a key
    is read, cloned or copied into the next key's static inputs before the step ends. Keys of one
    family never run in the same step, so their temporaries can share memory; the two families get
    separate pools so that a verify replay never overwrites a proposal's outputs (a stage plugin's
    verify may still read them after it, and so may a schedule that launches the next proposal
    before the previous verify's results are read).
    """
    return "verify" if key.stage.startswith("verify") else "propose"


@define
class GraphCounters:
    """Work done by a backend; after ready only ``replays`` may grow."""

    captures: int = 0
    warmups: int = 0
    replays: int = 0


@define
class _Prepared:
    inputs: dict[str, torch.Tensor]
    outputs: tuple[torch.Tensor, ...] | None
    graph: Any  # the device graph object (CUDAGraph, NPUGraph); None for eager backends


class GraphBackend:
    """Base class: static input buffers per key; subclasses decide capture and replay."""

    name = "base"
    # True: prepared keys are device graphs replayed without Python, so the step around them
    # runs in static-shape mode too (no host reads between the replays)
    records = False

    def __init__(self, device: str) -> None:
        self.device = device
        self.counters = GraphCounters()
        self.sealed = False
        self._prepared: dict[BindingKey, _Prepared] = {}
        self._fns: dict[BindingKey, GraphFn] = {}

    @property
    def keys(self) -> tuple[BindingKey, ...]:
        return tuple(self._prepared)

    def prepare(self, key: BindingKey, fn: GraphFn, example: Mapping[str, torch.Tensor]) -> None:
        """Allocate static inputs for ``key`` and capture or warm ``fn`` on them."""
        if self.sealed:
            raise GraphError(f"graph backend is sealed (engine ready): refusing to prepare {key.describe()}")
        if key in self._prepared:
            return
        inputs = {name: tensor.clone() for name, tensor in example.items()}
        self._fns[key] = fn
        self._prepared[key] = self._capture(key, fn, inputs)

    def run(self, key: BindingKey, inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Copy ``inputs`` into the key's static buffers and execute."""
        prepared = self._prepared.get(key)
        if prepared is None:
            raise GraphError(f"binding key {key.describe()} was not prepared at warmup")
        for name, tensor in inputs.items():
            prepared.inputs[name].copy_(tensor)
        self.counters.replays += 1
        return self._replay(key, prepared)

    def seal(self) -> None:
        """Forbid further preparation (called once the engine is ready)."""
        self.sealed = True

    # -- subclass API -------------------------------------------------------------
    def _capture(self, key: BindingKey, fn: GraphFn, inputs: dict[str, torch.Tensor]) -> _Prepared:
        raise NotImplementedError

    def _replay(self, key: BindingKey, prepared: _Prepared) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError


class EagerStaticBackend(GraphBackend):
    """Warm each key once on its preallocated buffers, then run eagerly (CPU)."""

    name = "static"

    def _capture(self, key: BindingKey, fn: GraphFn, inputs: dict[str, torch.Tensor]) -> _Prepared:
        fn(**inputs)
        self.counters.warmups += 1
        return _Prepared(inputs, None, None)

    def _replay(self, key: BindingKey, prepared: _Prepared) -> tuple[torch.Tensor, ...]:
        return self._fns[key](**prepared.inputs)


class CapturedGraphBackend(GraphBackend):
    """Capture with a device graph API; subclasses supply the module (torch.cuda or torch.npu)."""

    records = True

    def __init__(self, device: str) -> None:
        super().__init__(device)
        # pool_family(key) -> the memory-pool token its captures share; made at the family's first
        # capture, per backend (an engine built later gets pools of its own)
        self._pools: dict[str, Any] = {}

    def _graph_api(self):  # -> object with CUDAGraph/NPUGraph-like class, graph(), Stream, stream()
        raise NotImplementedError

    def _capture(self, key: BindingKey, fn: GraphFn, inputs: dict[str, torch.Tensor]) -> _Prepared:
        with static_shapes(key.kv_span):
            return self._record(key, fn, inputs)

    def _record(self, key: BindingKey, fn: GraphFn, inputs: dict[str, torch.Tensor]) -> _Prepared:
        api = self._graph_api()
        side = api.Stream()
        side.wait_stream(api.current_stream())
        with api.stream(side):  # warm allocator and kernels outside the capture
            for _ in range(2):
                fn(**inputs)
        api.current_stream().wait_stream(side)
        self.counters.warmups += 1
        graph = api.graph_class()
        with api.graph(graph, **self._pool_for(key, api)):
            outputs = fn(**inputs)
        self.counters.captures += 1
        return _Prepared(inputs, tuple(outputs), graph)

    def _pool_for(self, key: BindingKey, api: GraphApi) -> dict[str, Any]:
        """Keyword arguments of ``api.graph`` for ``key``: its family's shared pool, or none (a
        private pool per capture) where the API has no pool handles."""
        if api.pool_handle is None:
            return {}
        family = pool_family(key)
        if family not in self._pools:
            self._pools[family] = api.pool_handle()
        return {"pool": self._pools[family]}

    def _replay(self, key: BindingKey, prepared: _Prepared) -> tuple[torch.Tensor, ...]:
        prepared.graph.replay()
        assert prepared.outputs is not None  # recorded with the graph
        return prepared.outputs


@frozen
class GraphApi:
    """The handful of device-runtime calls graph capture needs."""

    graph_class: type
    graph: Callable
    Stream: type
    stream: Callable
    current_stream: Callable
    # a new memory-pool token for ``graph(..., pool=token)``; None: each capture keeps a private pool,
    # which holds that graph's whole working set for as long as the graph lives
    pool_handle: Callable[[], Any] | None = None


def cuda_graph_api() -> GraphApi:
    return GraphApi(torch.cuda.CUDAGraph, torch.cuda.graph, torch.cuda.Stream, torch.cuda.stream,
                    torch.cuda.current_stream, torch.cuda.graph_pool_handle)
