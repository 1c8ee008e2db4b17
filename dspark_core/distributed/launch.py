"""Starting one rank of a multi-rank service, and running it to the end.

``dspark-core serve`` with ``--nnodes > 1`` calls :func:`serve_distributed`
(or, for finer control, :func:`start_rank` and the :class:`RankHandle`
methods). Every rank gets the same flags plus its own ``--node_rank``:

* rank 0 joins the group, loads its shard, brings the engine up together
  with the workers, then runs the HTTP server and scheduler;
* every other rank does the same bring-up and then replays rank 0's steps
  until rank 0 says stop (exit 0) or is lost (exit 1).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

import attrs
import torch
from attrs import define, field

from dspark_core.audit import get_logger
from dspark_core.config import ServeConfig
from dspark_core.distributed.control import STOP, AnnouncingQueue, Channel, Heartbeat, follow
from dspark_core.distributed.group import DistributedError, RankGroup, RankLostError, Timeouts, join
from dspark_core.distributed.table import bring_up_ranks, check_same_launch
from dspark_core.engine.engine import Engine
from dspark_core.errors import ConfigError
from dspark_core.startup import Launch, build_engine, fingerprint_launch, resolve_launch
from dspark_core.table import CostTable

log = get_logger("distributed")


@define
class RankHandle:
    """One started rank: its launch, engine (target sharded across ranks) and group."""

    launch: Launch
    engine: Engine
    group: RankGroup
    channel: Channel
    lost: threading.Event = field(factory=threading.Event)
    lost_error: RankLostError | None = None
    table_sha256: str | None = None
    _heartbeat: Heartbeat | None = None
    _closed: bool = False

    @property
    def is_rank0(self) -> bool:
        return self.group.is_rank0

    @property
    def rank(self) -> int:
        return self.group.rank

    def _on_lost(self, exc: RankLostError) -> None:
        if not self.lost.is_set():
            self.lost_error = exc
            self.lost.set()

    def bring_up(self, progress: bool = False) -> CostTable | None:
        """Warmup, calibration (or saved table), fit on rank 0, install and verify everywhere; ready on return.

        Every rank must call it. On rank 0 it is the server's startup work
        (``AsyncEngineService.prepare``); it starts the idle heartbeat.
        """
        try:
            table, self.table_sha256 = bring_up_ranks(self.engine, self.launch, self.group, self.channel, progress=progress)
        except RankLostError as exc:
            self._on_lost(exc)
            raise
        if self.is_rank0:
            self._heartbeat = Heartbeat(self.channel, self.group.timeouts.heartbeat, self._on_lost).start()
        return table

    def run_worker(self) -> int:
        """Workers: replay rank 0's steps until told to stop; 0 on a clean stop, 1 when rank 0 is lost."""
        if self.is_rank0:
            raise DistributedError("run_worker is for ranks other than 0; rank 0 serves HTTP")
        try:
            follow(self.engine, self.channel, frozenset({STOP}))
        except RankLostError as exc:
            log.error("stopping: rank 0 or a peer is lost", rank=self.rank, error=str(exc))
            self._on_lost(exc)
            return 1
        finally:
            self.close()
        log.info("worker stopped by rank 0", rank=self.rank)
        return 0

    def close(self) -> None:
        """Rank 0: tell the workers to stop (unless a rank is lost), then leave the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._heartbeat is not None:
            self._heartbeat.stop()
        try:
            self.engine.close()
        except Exception as exc:  # a lost rank already failed the last job
            log.warning("engine close failed", rank=self.rank, error=repr(exc))
        if self.is_rank0 and not self.lost.is_set():
            try:
                self.channel.send(STOP)
            except RankLostError as exc:
                self._on_lost(exc)
        self.group.close()


def _place_on_local_device(launch: Launch, rank: int) -> None:
    """Accelerators: rank r uses device r mod (devices on this host) when the plugin names no index."""
    spec = launch.device
    if spec.torch_device == "cpu" or ":" in spec.torch_device:
        return
    module = getattr(torch, spec.torch_device, None)
    count = module.device_count() if module is not None and hasattr(module, "device_count") else 0
    if module is not None and count > 1:
        index = rank % count
        module.set_device(index)
        launch.device = attrs.evolve(spec, torch_device=f"{spec.torch_device}:{index}")


def shard_target(family: object, target: object, rank: int, world_size: int, group=None) -> None:
    """Cut ``target`` in place down to rank ``rank``'s tensor-parallel shard, through its model family.

    The family plugin that loaded the target knows its layout
    (``family.shard_target(target, rank, world_size, group)``); a family
    without that method serves on one rank only.
    """
    if world_size == 1:
        return
    shard = getattr(family, "shard_target", None)
    if shard is None:
        name = getattr(family, "name", type(family).__name__)
        raise ConfigError(f"tensor parallelism over {world_size} ranks: the {name!r} model family cannot shard "
                          f"its target ({type(target).__name__}); run it with --nnodes=1")
    shard(target, rank, world_size, group)


def start_rank(config: ServeConfig, *, timeouts: Timeouts | None = None, dtype: str | None = None) -> RankHandle:
    """Join the process group and build this rank's engine (sharded target); not yet warmed up.

    Only rank 0 writes the output table, so its output path is checked on
    rank 0 alone. ``dtype`` overrides the resolved compute dtype (tests use
    float64). Raises :class:`DistributedError` when a rank does not join in
    time or the ranks' launches differ.
    """
    if config.nnodes < 2:
        raise DistributedError("start_rank is for nnodes >= 2; a single rank builds its engine directly")
    if config.dp_size != 1 or config.cp_size != 1:
        raise DistributedError(f"dp_size={config.dp_size}, cp_size={config.cp_size}: multi-rank serving splits the target "
                               "by tensor parallelism only; use --dp_size=1 --cp_size=1")
    if config.node_rank != 0:
        config = attrs.evolve(config, adaptive_dspark_cost_table_output=None)
    launch = resolve_launch(config)
    if dtype is not None:
        launch.dtype = dtype
    _place_on_local_device(launch, config.node_rank)
    group = join(config.nnodes, config.node_rank, config.master_node_addr, launch.device.distributed_backend, timeouts)
    try:
        engine = build_engine(launch)
        runner = engine.runner
        shard_target(launch.model_family, runner.target, group.rank, group.world_size, group.model_group)
        runner.target_cache = runner.target.new_cache(runner.num_slots + 1, runner.max_len)  # this rank's heads only
        if launch.fingerprint is None:
            launch.fingerprint = fingerprint_launch(launch)
        check_same_launch(group, launch.fingerprint)
        channel = Channel(group)
        handle = RankHandle(launch, engine, group, channel)
        if group.is_rank0:
            engine.replace_queue(AnnouncingQueue(engine.config.schedule_overlap, channel, handle._on_lost))
    except BaseException:
        group.close()
        raise
    log.info("rank started", rank=group.rank, nnodes=group.world_size, backend=group.backend,
             kv_heads=getattr(runner.target, "local", runner.target.config).num_kv_heads)
    return handle


def serve_distributed(config: ServeConfig, serve_rank0: Callable[[RankHandle], int], *,
                      timeouts: Timeouts | None = None) -> int:
    """Run this rank of a multi-rank service to the end; returns the process exit code.

    Rank 0: ``serve_rank0(handle)`` builds the HTTP service around
    ``handle.engine``, runs ``handle.bring_up`` as its startup work and serves
    until SIGTERM/SIGINT; if a rank is lost meanwhile this process sends itself
    SIGTERM so the server stops, and the exit code is 1. Other ranks: bring-up,
    then replay rank 0's steps (0 on rank 0's stop, 1 when rank 0 is lost).
    """
    handle = start_rank(config, timeouts=timeouts)
    if not handle.is_rank0:
        try:
            handle.bring_up()
        except BaseException:
            handle.close()
            raise
        return handle.run_worker()
    watchdog = threading.Thread(target=_stop_on_loss, args=(handle,), name="dspark-rank-watchdog", daemon=True)
    watchdog.start()
    try:
        code = serve_rank0(handle)
    finally:
        handle.close()
    if handle.lost.is_set():
        log.error("service stopped: a rank was lost", error=str(handle.lost_error))
        return 1
    return code


def _stop_on_loss(handle: RankHandle) -> None:
    handle.lost.wait()
    if not handle._closed:
        log.error("a rank was lost; stopping the HTTP server", error=str(handle.lost_error))
        os.kill(os.getpid(), signal.SIGTERM)
