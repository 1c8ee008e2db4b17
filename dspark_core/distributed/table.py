"""One cost table for the whole service: calibrate together, fit once, install everywhere.

The startup stages across ranks:

1. every rank warms its graphs (the warmup runs tensor-parallel collectives,
   so all ranks take part in the same order);
2. calibration: rank 0 drives its probe points exactly as on one rank while
   the workers replay every step and time the same windows on their own
   clocks; the window seconds are then combined with an all-reduce MAX, so
   the slowest rank's time is what the table learns;
3. rank 0 fits (or takes the saved table), then broadcasts the table's JSON
   bytes; every rank parses and installs them;
4. every rank hashes the JSON of the table it installed (SHA-256); the hashes
   are gathered and any rank that differs from rank 0 fails startup.

Before any of this, :func:`check_same_launch` compares every rank's package
version and message format with rank 0's, then the launch fingerprint
(checkpoints, parallelism, execution, geometry).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

import dspark_core
from dspark_core.audit import get_logger
from dspark_core.calibration.install import StartupRuntime, _audit, fit_stage, install_stage
from dspark_core.calibration.plan import CalibrationPlan
from dspark_core.calibration.probe import Run, run_probes
from dspark_core.costs.base import CostSample
from dspark_core.costs.fingerprint import Fingerprint, compare
from dspark_core.distributed.control import (CALIBRATED, MESSAGE_FORMAT, POINT_BEGIN, POINT_END, Channel, IntervalRecorder,
                                             follow)
from dspark_core.distributed.group import DistributedError, RankGroup, collective
from dspark_core.table import CostTable, dumps_table, loads_table, save_table

log = get_logger("distributed")


def table_sha256(table: CostTable | None) -> str:
    """SHA-256 of the table's canonical JSON (what :func:`dumps_table` writes); ``none`` without a table."""
    return "none" if table is None else hashlib.sha256(dumps_table(table).encode("utf-8")).hexdigest()


def gather_objects(group: RankGroup, value: Any, what: str) -> list[Any]:
    """``value`` of every rank, in rank order (on the control group)."""
    out: list[Any] = [None] * group.world_size
    with collective(f"exchanging {what}", group.rank):
        dist.all_gather_object(out, value, group=group.control_group)
    return out


def software_of_this_rank() -> dict[str, str | int]:
    """What a rank's messages depend on: the dspark-core version and the control message format."""
    return {"dspark-core": dspark_core.__version__, "message format": MESSAGE_FORMAT}


def check_same_launch(group: RankGroup, fingerprint: Fingerprint) -> None:
    """Every rank must run the same software and launch as rank 0; a differing rank is named with
    its fields. The software goes first, as plain strings and numbers: another version's
    fingerprint might not even unpickle."""
    software = gather_objects(group, software_of_this_rank(), "software versions")
    problems = [f"rank {rank} runs {name} {theirs[name]!r}, rank 0 {software[0][name]!r}"
                for rank, theirs in enumerate(software[1:], start=1) for name in software[0]
                if theirs.get(name) != software[0][name]]
    if problems:
        raise DistributedError("ranks run different dspark-core software; install the same version on every node:\n  "
                               + "\n  ".join(problems))
    prints = gather_objects(group, fingerprint, "launch fingerprints")
    problems = []
    for rank, other in enumerate(prints[1:], start=1):
        for m in compare(prints[0], other):
            problems.append(f"rank {rank} launch fingerprint differs from rank 0: {m.field}: rank 0 {m.saved!r}, rank {rank} {m.launch!r}")
    if problems:
        raise DistributedError("ranks disagree about the launch; start every rank with the same flags and checkpoints:\n  "
                               + "\n  ".join(problems))


def _interval_seconds(group: RankGroup, seconds: list[float], count: int) -> list[float]:
    """All-reduce MAX of every timed interval's seconds (a step costs what its slowest rank took);
    a worker pads or cuts its list to rank 0's ``count``."""
    if len(seconds) != count:
        log.warning("calibration intervals differ from rank 0's", rank=group.rank, intervals=len(seconds), rank0_intervals=count)
    data = torch.tensor((list(seconds) + [0.0] * count)[:count], dtype=torch.float64)
    with collective("combining calibration intervals", group.rank):
        dist.all_reduce(data, op=dist.ReduceOp.MAX, group=group.control_group)
    return data.tolist()


def calibrate_rank0(engine, plan: CalibrationPlan, channel: Channel, *, progress: bool = False) -> list[CostSample]:
    """Rank 0's probes (:func:`run_probes`), each recorded run announced so the workers can time it;
    every timed interval combined by MAX before windows are cut."""
    settings = plan.settings
    warmup = max(settings.warmup_steps, 1)  # as the probe counts it

    @contextmanager
    def announce(run: Run) -> Iterator[None]:
        channel.send(POINT_BEGIN, [run.request_bucket, warmup, settings.window_steps * settings.windows_per_point])
        yield
        channel.send(POINT_END)

    def combine(seconds: list[float]) -> list[float]:
        channel.send(CALIBRATED, [len(seconds)])
        combined = _interval_seconds(channel.group, seconds, len(seconds))
        slower = sum(1 for s, c in zip(seconds, combined) if c > s)
        log.info("calibration intervals combined across ranks", intervals=len(seconds), slower_elsewhere=slower)
        return combined

    return run_probes(engine, plan, progress=progress, announce=announce, combine=combine)


def calibrate_worker(engine, channel: Channel) -> None:
    recorder = IntervalRecorder()
    _, payload = follow(engine, channel, frozenset({CALIBRATED}), recorder)
    _interval_seconds(channel.group, recorder.intervals, payload[0])
    engine.reset_counters()


def share_table(group: RankGroup, table: CostTable | None, lookup) -> CostTable | None:
    """Rank 0's table, sent as its JSON bytes; every rank returns the parsed table."""
    text = b"" if table is None or group.rank != 0 else dumps_table(table).encode("utf-8")
    with collective("sending the cost table", group.rank):
        size = torch.tensor([len(text)], dtype=torch.int64)
        dist.broadcast(size, 0, group=group.control_group)
        if not size.item():
            return None
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8) if group.rank == 0 else torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, 0, group=group.control_group)
    return table if group.rank == 0 else loads_table(bytes(data.tolist()).decode("utf-8"), lookup, "rank 0's cost table")


def verify_installed(group: RankGroup, installed: CostTable | None) -> str:
    """All ranks must hold byte-identical tables; returns the common SHA-256."""
    hashes = gather_objects(group, table_sha256(installed), "installed table hashes")
    bad = [f"rank {r} installed cost table sha256 {h}, rank 0 has {hashes[0]}" for r, h in enumerate(hashes) if h != hashes[0]]
    if bad:
        raise DistributedError("the installed cost table differs between ranks:\n  " + "\n  ".join(bad))
    return hashes[0]


def bring_up_ranks(engine, launch, group: RankGroup, channel: Channel, *, progress: bool = False) -> tuple[CostTable | None, str]:
    """The multi-rank :func:`dspark_core.calibration.install.bring_up`: same stages, every rank.

    Returns the installed table (None off the adaptive path) and its SHA-256.
    The engine is ready on return.
    """
    config, hooks = launch.config, launch.hooks
    if not config.disable_graph_warmup:
        with collective("graph warmup", group.rank):
            engine.warmup()
    table = None
    if config.adaptive:
        runtime = StartupRuntime(engine, launch, progress)
        if launch.saved_table is not None:
            table, source = launch.saved_table, "saved table"
        elif group.is_rank0:
            samples = calibrate_rank0(engine, launch.plan, channel, progress=progress)
            table, source = fit_stage(hooks, runtime, launch.plan, samples), launch.plan.source
        else:
            calibrate_worker(engine, channel)
            source = launch.plan.source
        table = share_table(group, table, hooks.cost_model)
        assert table is not None, "rank 0 always has a table here (saved or fitted)"
        install_stage(hooks, runtime, table)
        if group.is_rank0:
            if config.adaptive_dspark_cost_table_output and launch.saved_table is None:
                save_table(table, config.adaptive_dspark_cost_table_output)
            _audit(launch, engine, table, source)
    digest = verify_installed(group, engine.table)
    engine.mark_ready()
    log.info("rank ready", rank=group.rank, nnodes=group.world_size, table_sha256=digest, work=engine.work_counters())
    return engine.table, digest
