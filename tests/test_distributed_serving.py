"""Two real ranks on this machine (gloo over loopback): exactness, one table, failures.

Each test spawns rank processes running :func:`rank_main`; rank 0 generates
and reports its tokens, the worker replays rank 0's steps. The reference is
single-rank target-only greedy decoding of the same checkpoint.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import time
from pathlib import Path

import pytest
import torch

from checkpoint_support import write_tiny_pair
from dspark_core.config import parse_serve_args
from dspark_core.distributed.group import DistributedError, Timeouts
from dspark_core.distributed.launch import serve_distributed, start_rank
from dspark_core.models.loading import load_target
from dspark_core.models.reference import greedy_generate

PROMPTS = [[5, 6, 7, 8], [10, 20, 30, 40, 50, 60, 70], [3], [200, 100, 50, 25, 12]]
MAX_TOKENS = 20
CAL = {"request_buckets": [1, 2, 4], "contexts": [{"prefill_tokens": 8, "min_kv_length": 1, "max_kv_length": 100}],
       "warmup_steps": 1, "window_steps": 2, "windows_per_point": 1}
TIMEOUTS = Timeouts(init=30.0, step=60.0, idle=60.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, argv: list[str], results, mode: str) -> None:
    """One rank: start, bring up, then generate (rank 0) or follow (rank 1). Reports to ``results``."""
    torch.set_num_threads(1)
    from dspark_core.engine.request import SamplingParams

    try:
        if mode == "http":
            results.put((rank, "exit code", serve_distributed(parse_serve_args([*argv, f"--node_rank={rank}"]),
                                                             lambda handle: serve_over_http(handle, results),
                                                             timeouts=TIMEOUTS)))
            return
        if mode == "other-software" and rank == 1:
            import dspark_core
            from dspark_core.distributed import table

            dspark_core.__version__ = "0.0.1-elsewhere"  # as a node with another install would report
            table.MESSAGE_FORMAT = 0
        handle = start_rank(parse_serve_args([*argv, f"--node_rank={rank}"]), timeouts=TIMEOUTS)
        handle.bring_up()
        if rank == 1:
            if mode == "lose-worker":
                os._exit(3)  # vanish without a word, as a crashed host would
            results.put((rank, handle.table_sha256, handle.run_worker()))
            return
        if mode == "lose-rank0":
            os._exit(3)
        if mode == "lose-worker":
            started = time.monotonic()
            try:
                handle.engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
                results.put((rank, "no error", None))
            except Exception as exc:
                results.put((rank, type(exc).__name__, (str(exc), time.monotonic() - started, handle.lost.is_set())))
            handle.close()
            return
        if mode == "copy-steps":
            # only rank 0 decides, so only its policy and prices are pinned: every step draft-off, and
            # rows cheap against a draft-off step, so confident copies pay whatever calibration measured
            from engine_support import NeverDrafts, draft_off_table

            handle.engine.set_policy(NeverDrafts(copy_steps=True))
            handle.engine.install_table(draft_off_table(5, (1, 2, 4), off_seconds=0.02, per_row=0.0005))
        outputs = handle.engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        stats = [(sum(o.verify_widths), o.steps, o.copy_steps) for o in outputs]
        handle.close()
        results.put((rank, handle.table_sha256, ([list(o.token_ids) for o in outputs], stats)))
    except Exception as exc:
        results.put((rank, "error", f"{type(exc).__name__}: {exc}"))


def serve_over_http(handle, results) -> int:
    """What ``dspark-core serve`` does on rank 0: HTTP service, bring-up as its startup work."""
    import httpx

    from dspark_core.server import AsyncEngineService, BackgroundServer, build_app

    service = AsyncEngineService(handle.engine)
    with BackgroundServer(build_app(service, model_name="tiny")) as server:
        assert httpx.get(server.url + "/ready").status_code == 503
        service.prepare(lambda engine: handle.bring_up()).result(timeout=120)
        tokens = []
        for prompt in PROMPTS:
            reply = httpx.post(server.url + "/v1/completions", timeout=60,
                               json={"prompt": prompt, "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                                     "return_token_ids": True})
            tokens.append(reply.json()["dspark"]["token_ids"] if reply.status_code == 200 else reply.text)
    results.put((0, "http tokens", tokens))
    return 0


def run_ranks(argv: list[str], ranks=(0, 1), mode: str = "serve", timeout: float = 120.0) -> dict[int, tuple]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, argv, results, mode)) for r in ranks]
    for p in procs:
        p.start()
    try:
        got = {}
        expected = len(ranks) + (1 if mode == "http" else 0) - (1 if mode.startswith("lose-") else 0)
        for _ in range(expected):
            rank, *rest = results.get(timeout=timeout)
            got[(rank, rest[0]) if mode == "http" else rank] = tuple(rest)
        return got
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    target, draft = write_tiny_pair(root)
    cal = root / "cal.json"
    cal.write_text(json.dumps(CAL))
    return target, draft, cal


@pytest.fixture(scope="module")
def reference(checkpoints):
    target = load_target(checkpoints[0])
    return [greedy_generate(target, p, MAX_TOKENS, eos_token_ids=()) for p in PROMPTS]


def flags(target: Path, draft: Path, *extra: str) -> list[str]:
    return [f"--model={target}", f"--draft_model={draft}", "--num_speculative_tokens=5", "--max_seqs_per_batch=4",
            "--max_model_len=128", "--nnodes=2", f"--master_node_addr=127.0.0.1:{free_port()}", *extra]


def test_adaptive_two_ranks_match_single_rank_greedy_and_share_one_table(tmp_path, checkpoints, reference):
    target, draft, cal = checkpoints
    out = tmp_path / "costs.json"
    got = run_ranks(flags(target, draft, f"--adaptive_dspark_calibration={cal}", f"--adaptive_dspark_cost_table_output={out}"))
    assert got[0][0] != "error" and got[1][0] != "error", got
    sha0, (tokens, stats) = got[0]
    sha1, worker_code = got[1]
    assert tokens == reference
    assert sum(v for v, _, _ in stats) > 0  # drafts were verified: the speculative path ran
    assert sha0 == sha1 and len(sha0) == 64  # the same immutable table on both ranks
    assert worker_code == 0  # the worker stopped cleanly when rank 0 closed
    saved = json.loads(out.read_text())  # written once, by rank 0, with the launch's parallelism
    assert saved["fingerprint"]["parallelism"] == {"nnodes": 2, "tp": 2, "dp": 1, "cp": 1}

    # a later compatible 2-rank launch reuses the file: rank 0's bytes are installed everywhere
    again = run_ranks(flags(target, draft, f"--adaptive_dspark_cost_table={out}"))
    assert again[0][0] == again[1][0] == sha0, again
    assert again[0][1][0] == reference


def test_fixed_width_two_ranks_match_single_rank_greedy(checkpoints, reference):
    target, draft, _ = checkpoints
    got = run_ranks(flags(target, draft, "--enable_adaptive_speculative_decode=false", "--enable_schedule_overlap=false"))
    assert got[0][0] != "error" and got[1][0] != "error", got
    assert got[0][1][0] == reference
    assert got[0][0] == got[1][0] == "none"  # no cost table off the adaptive path
    assert got[1][1] == 0


def test_copy_proposals_on_two_ranks_match_single_rank_greedy(checkpoints, reference):
    """Both ranks look copies up in their own token history (identical, since both replay every
    prefill and commit), so their proposals agree and the output stays exact."""
    target, draft, _ = checkpoints
    got = run_ranks(flags(target, draft, "--enable_adaptive_speculative_decode=false", "--copy_proposals=on"))
    assert got[0][0] != "error" and got[1][0] != "error", got
    tokens, stats = got[0][1]
    assert tokens == reference and got[1][1] == 0
    # the random draft alone is practically never accepted; copies of the repeating output are
    assert sum(steps for _, steps, _ in stats) < len(PROMPTS) * (MAX_TOKENS - 1)


def test_adaptive_copy_steps_on_two_ranks_match_single_rank_greedy(checkpoints, reference):
    """Rank 0 decides a copy step's tier and lengths and broadcasts them like a drafted step's; the
    worker runs the copy key from the step's announcement and verifies the same rows."""
    target, draft, cal = checkpoints
    got = run_ranks(flags(target, draft, f"--adaptive_dspark_calibration={cal}", "--copy_proposals=on"), mode="copy-steps")
    assert got[0][0] != "error" and got[1][0] != "error", got
    tokens, stats = got[0][1]
    assert tokens == reference and got[1][1] == 0
    assert sum(copy_steps for _, _, copy_steps in stats) > 0  # copy steps ran, on both ranks in lockstep


def test_rank_0_serves_http_and_both_ranks_exit_cleanly(checkpoints, reference):
    target, draft, _ = checkpoints
    got = run_ranks(flags(target, draft, "--enable_adaptive_speculative_decode=false"), mode="http")
    assert got[(0, "http tokens")][1] == reference, got
    assert got[(0, "exit code")][1] == 0 and got[(1, "exit code")][1] == 0, got


def test_missing_rank_fails_within_the_init_timeout(checkpoints, monkeypatch):
    target, draft, _ = checkpoints
    config = parse_serve_args([*flags(target, draft, "--enable_adaptive_speculative_decode=false"), "--node_rank=0"])
    started = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank\(s\) 1 of nnodes=2 did not join .* within 2 s"):
        start_rank(config, timeouts=Timeouts(init=2.0, step=5.0, idle=5.0))
    assert time.monotonic() - started < 10


def test_a_rank_with_a_different_launch_is_named(checkpoints):
    target, draft, _ = checkpoints
    base = flags(target, draft, "--enable_adaptive_speculative_decode=false")
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    argvs = [base, [*base, "--max_seqs_per_batch=2"]]  # rank 1 was started with another flag
    procs = [ctx.Process(target=rank_main, args=(r, argvs[r], results, "serve")) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict((r, rest) for r, *rest in (results.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(30)
    for rank in (0, 1):
        assert got[rank][0] == "error"
        assert "rank 1 launch fingerprint differs from rank 0" in got[rank][1]


def test_a_rank_with_other_software_is_named_before_its_launch_is_read(checkpoints):
    import dspark_core

    target, draft, _ = checkpoints
    got = run_ranks(flags(target, draft, "--enable_adaptive_speculative_decode=false"), mode="other-software")
    for rank in (0, 1):
        kind, message = got[rank]
        assert kind == "error", got
        assert "ranks run different dspark-core software" in message
        assert f"rank 1 runs dspark-core '0.0.1-elsewhere', rank 0 {dspark_core.__version__!r}" in message
        assert "rank 1 runs message format 0, rank 0 1" in message
        assert "launch fingerprint" not in message


def test_a_lost_worker_stops_rank_0_with_a_message(checkpoints):
    target, draft, _ = checkpoints
    got = run_ranks(flags(target, draft, "--enable_adaptive_speculative_decode=false"), mode="lose-worker")
    kind, (message, seconds, lost) = got[0]
    assert kind == "RankLostError", got
    assert "a peer rank is gone or stuck" in message and lost
    assert seconds < 30


def test_a_worker_whose_rank_0_is_lost_exits_non_zero(checkpoints):
    target, draft, _ = checkpoints
    got = run_ranks(flags(target, draft, "--enable_adaptive_speculative_decode=false"), mode="lose-rank0")
    assert got[1][1] == 1, got  # run_worker's exit status
