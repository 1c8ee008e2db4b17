"""``dspark-core serve`` end to end: a real process, real socket, ready only after calibration."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from checkpoint_support import write_tiny_pair

CAL = {"request_buckets": [1, 2], "contexts": [{"prefill_tokens": 8, "min_kv_length": 1, "max_kv_length": 100}],
       "warmup_steps": 1, "window_steps": 2, "windows_per_point": 1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(tmp_path):
    target, draft = write_tiny_pair(tmp_path)
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(CAL))
    out = tmp_path / "costs.json"
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dspark_core.cli", "serve", f"--model={target}", f"--draft_model={draft}",
         "--num_speculative_tokens=5", "--max_seqs_per_batch=2", "--max_model_len=128", f"--port={port}",
         f"--adaptive_dspark_calibration={cal}", f"--adaptive_dspark_cost_table_output={out}",
         "--served_model_name=tiny"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    ready = []
    while time.time() < deadline:
        try:
            ready.append(httpx.get(url + "/ready", timeout=2).status_code)
            if ready[-1] == 200:
                break
        except httpx.TransportError:
            if proc.poll() is not None:
                pytest.fail(f"serve exited early: {proc.stderr.read()[-2000:]}")
        time.sleep(0.2)
    yield url, out, ready, proc
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


def test_serve_calibrates_saves_and_answers(served):
    url, out, ready, proc = served
    assert ready and ready[-1] == 200
    assert out.is_file() and json.loads(out.read_text())["draft_width"] == 5
    body = {"model": "tiny", "prompt": "the", "max_tokens": 6, "temperature": 0}
    response = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
    bad = httpx.post(url + "/v1/completions", json={**body, "temperature": 0.7}, timeout=30)
    assert bad.status_code == 400 and "temperature" in bad.text


def test_serve_refuses_a_bad_launch_before_any_work(tmp_path):
    existing = tmp_path / "exists.json"
    existing.write_text("{}")
    result = subprocess.run(
        [sys.executable, "-m", "dspark_core.cli", "serve", "--model=/nonexistent", "--draft_model=/nonexistent",
         f"--adaptive_dspark_cost_table_output={existing}"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "already exists" in result.stderr


def test_a_port_in_use_is_refused_before_the_model_loads(tmp_path):
    target, draft = write_tiny_pair(tmp_path)
    with socket.create_server(("127.0.0.1", 0)) as taken:  # another server already listens there
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "dspark_core.cli", "serve", f"--model={target}", f"--draft_model={draft}",
             "--num_speculative_tokens=5", "--max_seqs_per_batch=2", "--max_model_len=128", f"--port={port}"],
            capture_output=True, text=True, timeout=60)
    # it used to load, warm up and calibrate, log "engine ready" and "serving", then exit 3 with no error line
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"--host=127.0.0.1 --port={port}: cannot listen there: Address already in use" in result.stderr
    assert "engine ready" not in result.stderr and "serving" not in result.stderr


@pytest.mark.parametrize("host", ["nosuchhost.invalid", "192.0.2.1"])  # no such name; TEST-NET, not ours
def test_an_address_that_cannot_be_listened_on_is_named(host):
    from dspark_core.errors import ConfigError
    from dspark_core.server.http import bind_http_socket

    with pytest.raises(ConfigError) as info:
        bind_http_socket(host, 8000)
    message = str(info.value)
    # the resolver's or the kernel's own words, not an errno number or the address a second time
    assert message.startswith(f"--host={host} --port=8000: cannot listen there: ")
    assert "Unknown error" not in message and "while attempting" not in message
    with bind_http_socket("127.0.0.1", 0) as sock:  # --port=0: the system picks a free port
        port = sock.getsockname()[1]
        assert port > 0
        # bound, not listening: while the model loads a client is refused, not left hanging in a backlog
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_sigterm_during_calibration_stops_at_once(tmp_path):
    target, draft = write_tiny_pair(tmp_path, max_position=4096)
    cal = tmp_path / "cal.json"  # ~12 000 steps: about a minute on a 2-core CPU
    cal.write_text(json.dumps({**CAL, "contexts": [{"prefill_tokens": 8, "min_kv_length": 1, "max_kv_length": 4000}],
                               "window_steps": 200, "windows_per_point": 3}))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dspark_core.cli", "serve", f"--model={target}", f"--draft_model={draft}",
         "--num_speculative_tokens=5", "--max_seqs_per_batch=2", "--max_model_len=4096", f"--port={port}",
         f"--adaptive_dspark_calibration={cal}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:  # /health answers once the model is loaded; startup work follows
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            time.sleep(0.1)
        time.sleep(1.0)  # into warmup or calibration
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        waited = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    # it used to finish calibrating first (minutes with the real model), then log "engine ready" and "serving"
    assert proc.returncode == 0, err[-2000:]
    assert waited < 15, f"took {waited:.1f} s to stop"
    assert "startup stopped before ready: the server is shutting down" in err
    assert "engine ready" not in err and '"serving"' not in err and "startup setup failed" not in err


def test_two_rank_serve_command(tmp_path):
    """Both ranks run `dspark-core serve` with the same flags plus their own node_rank."""
    target, draft = write_tiny_pair(tmp_path)
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(CAL))
    port, master = free_port(), free_port()
    common = [sys.executable, "-m", "dspark_core.cli", "serve", f"--model={target}", f"--draft_model={draft}",
              "--num_speculative_tokens=5", "--max_seqs_per_batch=2", "--max_model_len=128", "--nnodes=2",
              f"--master_node_addr=127.0.0.1:{master}", f"--adaptive_dspark_calibration={cal}",
              "--served_model_name=tiny"]
    ranks = [subprocess.Popen(common + [f"--node_rank={r}", f"--port={port + r if r else port}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        url = f"http://127.0.0.1:{port}"
        deadline, status = time.time() + 120, None
        while time.time() < deadline and status != 200:
            try:
                status = httpx.get(url + "/ready", timeout=2).status_code
            except httpx.TransportError:
                if any(p.poll() is not None for p in ranks):
                    pytest.fail("a rank exited early: " + " | ".join(p.stderr.read()[-1500:] for p in ranks))
                time.sleep(0.3)
        assert status == 200
        body = {"model": "tiny", "prompt": "the", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
        response = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert len(response.json()["dspark"]["token_ids"]) >= 1
    finally:
        ranks[0].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in ranks]
    logs = [p.stderr.read() for p in ranks]
    assert codes == [0, 0], [log[-1500:] for log in logs]
    # stderr is a pipe, so the log is one JSON object per line: no progress bar redraws run into it;
    # rank 0 says once what it calibrates, as a single rank does; the worker does not
    records = [json.loads(line) for line in logs[0].splitlines() if line.strip()]
    calibrating = [r for r in records if r["event"] == "calibrating"]
    assert len(calibrating) == 1 and calibrating[0]["runs"] > 0 and calibrating[0]["request_buckets"] == [1, 2]
    assert "calibrating" not in logs[1]
    # the worker timed exactly the windows rank 0 announced (the unannounced warm pass is not timed)
    combined = [r for r in records if r["event"] == "calibration intervals combined across ranks"]
    assert len(combined) == 1 and combined[0]["intervals"] > 0
    assert "calibration intervals differ" not in logs[1]


def test_metrics_count_serving_steps_not_calibration(served):
    from prometheus_client.parser import text_string_to_metric_families

    url, _, _, _ = served

    def steps() -> float:
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
        return sum(s.value for s in families["dspark_verify_width"].samples if s.name.endswith("_count"))

    assert steps() == 0  # calibration ran many decode steps, none of them is serving traffic
    body = {"model": "tiny", "prompt": "the", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
    assert steps() >= 3
