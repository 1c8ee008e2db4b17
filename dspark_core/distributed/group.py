"""Joining and leaving the service's process group, with deadlines instead of hangs.

Rank 0 hosts a ``TCPStore`` at ``--master_node_addr``; every rank announces
itself there and rank 0 waits, up to the init timeout, until all ``nnodes``
ranks have. Only then is the ``torch.distributed`` group created on top of
the same store, so a rank that never starts turns into an error naming it
rather than an endless wait inside ``init_process_group``.

Two groups come out of a join:

* the *model* group (short timeout) carries the collectives inside a step:
  the tensor-parallel all-reduces and rank 0's budget decision;
* the *control* group (gloo whatever the device, long timeout) carries what
  happens between steps, as small host tensors:
  rank 0's step descriptions, calibration markers, the table bytes. A worker
  waits on it while the server is idle, so its timeout is the idle limit
  (rank 0 sends a heartbeat well within it once serving).
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from attrs import define, frozen

from dspark_core.audit import get_logger
from dspark_core.errors import DSparkError

log = get_logger("distributed")


class DistributedError(DSparkError):
    """Startup of the process group failed, or the ranks disagree about the launch."""


class RankLostError(DistributedError):
    """A collective failed or timed out while serving: a rank is gone or stuck."""


def _env_seconds(name: str, default: float) -> float:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise DistributedError(f"{name}={text!r}: expected a number of seconds") from None
    if value <= 0:
        raise DistributedError(f"{name}={text!r}: must be positive")
    return value


@frozen
class Timeouts:
    """Deadlines, in seconds, of the multi-rank service.

    ``init``: every rank must have joined within this long of rank 0 starting
    to wait. ``step``: any collective inside a step (and warmup). ``idle``:
    the longest a worker waits for rank 0's next message.
    """

    init: float = 120.0
    step: float = 300.0
    idle: float = 3600.0

    @classmethod
    def from_env(cls) -> Timeouts:
        """Defaults overridden by ``DSPARK_DIST_INIT_TIMEOUT`` / ``_STEP_TIMEOUT`` / ``_IDLE_TIMEOUT``."""
        base = cls()
        return cls(_env_seconds("DSPARK_DIST_INIT_TIMEOUT", base.init), _env_seconds("DSPARK_DIST_STEP_TIMEOUT", base.step),
                   _env_seconds("DSPARK_DIST_IDLE_TIMEOUT", base.idle))

    @property
    def heartbeat(self) -> float:
        """How often an idle rank 0 pings the workers (well inside ``idle``)."""
        return min(30.0, self.idle / 4)


def parse_master_addr(text: str) -> tuple[str, int]:
    """``host:port`` (IPv6 hosts in brackets) -> (host, port)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"master_node_addr={text!r}: expected host:port, e.g. 127.0.0.1:27000")
    return host.strip("[]"), int(port)


@define
class RankGroup:
    """This rank's membership: its index, the world size and the two groups."""

    rank: int
    world_size: int
    backend: str
    timeouts: Timeouts
    store: dist.Store
    model_group: Any  # a torch.distributed ProcessGroup (None: the default group)
    control_group: Any
    closed: bool = False

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        """Destroy the process group (idempotent; never raises on a broken group)."""
        if self.closed:
            return
        self.closed = True
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as exc:  # a peer already gone: nothing left to tear down cleanly
            log.warning("process group teardown failed", error=repr(exc))


def _wait_for_ranks(store: dist.Store, world_size: int, deadline: float, addr: str, timeout: float) -> None:
    keys = [f"dspark/joined/{r}" for r in range(world_size)]
    while True:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if not missing:
            return
        if time.monotonic() >= deadline:
            names = ", ".join(str(r) for r in missing)
            raise DistributedError(
                f"rank(s) {names} of nnodes={world_size} did not join the process group at {addr} within "
                f"{timeout:g} s; start every rank with the same --nnodes and --master_node_addr and its own --node_rank"
            )
        time.sleep(0.05)


def join(nnodes: int, node_rank: int, master_node_addr: str, backend: str, timeouts: Timeouts | None = None) -> RankGroup:
    """Rendezvous at ``master_node_addr`` and create the process group; fails within ``timeouts.init``."""
    timeouts = timeouts or Timeouts.from_env()
    host, port = parse_master_addr(master_node_addr)
    init = datetime.timedelta(seconds=timeouts.init)
    deadline = time.monotonic() + timeouts.init
    try:
        store = dist.TCPStore(host, port, nnodes, is_master=node_rank == 0, timeout=init, wait_for_workers=False)
    except Exception as exc:
        if node_rank == 0:
            raise DistributedError(f"rank 0 could not listen on master_node_addr {master_node_addr}: {exc}") from None
        raise DistributedError(
            f"rank {node_rank} could not reach rank 0 at master_node_addr {master_node_addr} within {timeouts.init:g} s: {exc}"
        ) from None
    store.set(f"dspark/joined/{node_rank}", str(os.getpid()))
    if node_rank == 0:
        _wait_for_ranks(store, nnodes, deadline, master_node_addr, timeouts.init)
        store.set("dspark/all_joined", "1")
    else:
        try:
            store.wait(["dspark/all_joined"], datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.1)))
        except Exception:
            raise DistributedError(
                f"rank {node_rank}: not every rank joined at {master_node_addr} within {timeouts.init:g} s (rank 0 reports which)"
            ) from None
    try:
        dist.init_process_group(backend, store=dist.PrefixStore("dspark/pg", store), rank=node_rank, world_size=nnodes,
                                timeout=datetime.timedelta(seconds=timeouts.step))
        control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeouts.idle))
    except Exception as exc:
        raise DistributedError(f"rank {node_rank}: creating the {backend} process group failed: {exc}") from None
    log.info("joined process group", rank=node_rank, nnodes=nnodes, backend=backend, master=master_node_addr)
    return RankGroup(node_rank, nnodes, backend, timeouts, store, dist.group.WORLD, control)


_COMM_MARKERS = ("gloo", "nccl", "hccl", "connection", "timed out", "timeout", "peer", "socket", "closed")


def is_comm_failure(exc: BaseException) -> bool:
    """True for errors of the communication layer (not for bugs in the step's own code)."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _COMM_MARKERS)


@contextmanager
def collective(what: str, rank: int) -> Iterator[None]:
    """Turn a failed or timed-out collective into :class:`RankLostError` naming what was running;
    any other error passes through unchanged."""
    try:
        yield
    except RankLostError:
        raise
    except Exception as exc:
        if not is_comm_failure(exc):
            raise
        message = f"rank {rank}: {what} failed, a peer rank is gone or stuck ({exc}); stopping the service"
        log.error("rank lost", rank=rank, during=what, error=str(exc))
        raise RankLostError(message) from exc
