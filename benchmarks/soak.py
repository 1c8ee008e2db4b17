"""Bounded soak test of the HTTP server: many concurrent clients, mixed good and bad requests.

The server runs in a child process (tiny random model with a byte tokenizer,
served through ``serve_http`` exactly as ``dspark-core serve`` does); the
parent drives N requests from C concurrent clients: plain and streamed
completions and chats, invalid bodies, and streams the client abandons midway.
At the end it checks that every request got exactly one well-formed answer
(none lost, none duplicated), that equal prompts got equal greedy outputs,
that the server's own counters agree with what the clients saw and that the
queue is empty again, and reports the server's RSS at start and end.

    python benchmarks/soak.py --requests 500 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx

PROMPTS = ["Once upon a time", "The capital of France is", "def fib(n):", "1, 2, 3,", "héllo wörld", "Q: why?"]
BAD = [  # (body, expected status)
    ({"prompt": "x", "temperature": 0.8}, 400),
    ({"prompt": "x"}, 400),
    ({"prompt": "x", "temperature": 0, "best_of": 3}, 400),
    ({"prompt": "x", "temperature": 0, "max_tokens": "many"}, 400),
    ({"prompt": "", "temperature": 0}, 400),
    ({"prompt": "z" * 400, "temperature": 0}, 400),
    ({"prompt": "x", "temperature": 0, "max_tokens": 10_000}, 400),
    (b"{broken", 400),
]


def serve(port: int, max_pending: int) -> None:
    import torch

    torch.set_num_threads(1)
    from dspark_core.server import AsyncEngineService, build_app, serve_http
    from dspark_core.server.testing import tiny_engine

    engine = tiny_engine(seed=1, policy="fixed", options={"k": 3}, buckets=(1, 2, 4, 8, 16), max_model_len=256)
    service = AsyncEngineService(engine, max_pending=max_pending)
    app = build_app(service, model_name="tiny")
    service.mark_ready()
    serve_http(app, "127.0.0.1", port, log_level="warning")


def rss_mb(pid: int) -> dict[str, float]:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return fields


def scrape(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "le" not in s.labels:
                out[s.name + "".join(f"|{v}" for _, v in sorted(s.labels.items()))] = s.value
    return out


async def one(client: httpx.AsyncClient, i: int, rng: random.Random, tally: collections.Counter, outputs: dict,
              ids: collections.Counter, problems: list, retries: int = 100) -> None:
    kind = rng.choices(["plain", "chat", "stream", "chat-stream", "bad", "abandon"], [30, 15, 20, 10, 20, 5])[0]
    prompt = rng.choice(PROMPTS)
    max_tokens = rng.choice([8, 16, 32])
    chat = kind.startswith("chat")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    payload: dict | bytes = {"temperature": 0, "max_tokens": max_tokens, "return_token_ids": True,
                             **({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})}
    if kind == "bad":
        payload, want = rng.choice(BAD)
        r = await client.post(path, **({"content": payload} if isinstance(payload, bytes) else {"json": payload}))
        tally[f"bad->{r.status_code}"] += 1
        if r.status_code not in (want, 429) or "error" not in r.json():
            problems.append(f"#{i} bad request answered {r.status_code}: {r.text[:200]}")
        return
    if kind in ("plain", "chat"):
        r = await client.post(path, json=payload)
        while r.status_code == 429 and retries > 0:  # overloaded: back off as Retry-After asks, then retry
            tally["429 (retried)"] += 1
            retries -= 1
            await asyncio.sleep(rng.uniform(0.01, 0.05))
            r = await client.post(path, json=payload)
        if r.status_code == 200:
            body = r.json()
            ids[body["id"]] += 1
            outputs[(chat, prompt, max_tokens)].add(tuple(body["dspark"]["token_ids"]))
        elif r.status_code != 429:
            problems.append(f"#{i} {kind} answered {r.status_code}: {r.text[:200]}")
        tally[f"{kind}->{r.status_code}"] += 1
        return
    for _ in range(retries + 1):
        result = await stream_once(client, path, payload, kind, tally)
        if result != 429:
            break
        tally["429 (retried)"] += 1
        await asyncio.sleep(rng.uniform(0.01, 0.05))
    if result == 429:
        tally[f"{kind}->429"] += 1
    elif result is not None:
        status, done, rid, tokens = result
        if status != 200:
            problems.append(f"#{i} {kind} answered {status}")
        elif not done:
            problems.append(f"#{i} {kind} stream ended without [DONE]")
        else:
            ids[rid] += 1
            outputs[(chat, prompt, max_tokens)].add(tuple(tokens))
            tally[f"{kind}->200"] += 1


async def stream_once(client, path, payload, kind, tally):
    """429, None for an abandoned stream, or (status, saw [DONE], response id, token ids)."""
    async with client.stream("POST", path, json={**payload, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            return 429 if r.status_code == 429 else (r.status_code, False, None, [])
        tokens, done, rid, n = [], False, None, 0
        async for line in r.aiter_lines():
            if not line:
                continue
            n += 1
            if kind == "abandon" and n == 2:
                tally["abandon->closed"] += 1
                return None  # leaving the block closes the connection mid-stream
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            rid = chunk["id"]
            tokens += chunk.get("dspark", {}).get("token_ids", [])
    return 200, done, rid, tokens


async def drive(url: str, requests: int, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed)
    tally: collections.Counter = collections.Counter()
    outputs: dict = collections.defaultdict(set)
    ids: collections.Counter = collections.Counter()
    problems: list[str] = []
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)

    async def client_loop(client):
        while not queue.empty():
            i = queue.get_nowait()
            try:
                await one(client, i, random.Random(rng.random() + i), tally, outputs, ids, problems)
            except Exception as exc:  # a transport error is a lost request
                problems.append(f"#{i} transport error {exc!r}")
                tally["lost"] += 1

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        start = time.monotonic()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        elapsed = time.monotonic() - start
    return {"tally": tally, "outputs": outputs, "ids": ids, "problems": problems, "elapsed": elapsed}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-pending", type=int, default=24, help="server admission bound (below concurrency: some 429s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # child mode: port
    args = p.parse_args()
    if args.serve is not None:
        serve(args.serve, args.max_pending)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    child = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--max-pending", str(args.max_pending)])
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if child.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the soak server did not become ready")
            time.sleep(0.2)
        rss_start = rss_mb(child.pid)
        result = asyncio.run(drive(url, args.requests, args.concurrency, args.seed))
        time.sleep(0.5)  # let cancellations of abandoned streams land
        rss_end = rss_mb(child.pid)
        metrics = scrape(httpx.get(url + "/metrics").text)
    finally:
        child.send_signal(signal.SIGTERM)
        code = child.wait(60)
    tally, ids = result["tally"], result["ids"]
    ok = sum(v for k, v in tally.items() if k.endswith("->200"))
    server_ok = sum(v for k, v in metrics.items() if k.startswith("dspark_requests_total|") and k.endswith("|200"))
    abandoned = tally["abandon->closed"]
    server_closed = sum(v for k, v in metrics.items() if k.startswith("dspark_requests_total|") and k.endswith("|499"))
    checks = {
        "every request answered once": sum(v for k, v in tally.items() if "->" in k) == args.requests
        and tally["lost"] == 0,
        "no duplicated response ids": all(n == 1 for n in ids.values()) and len(ids) == ok,
        "equal prompts gave equal outputs": all(len(v) == 1 for v in result["outputs"].values()),
        # an abandoned stream may still finish (200) before the server notices the client left (499)
        "server 200 + 499 counts == client completions + abandons": server_ok + server_closed == ok + abandoned
        and server_closed <= abandoned,
        "queue empty at end": metrics.get("dspark_queue_depth|admitted") == 0 and metrics.get("dspark_queue_depth|running") == 0,
        "server exited cleanly on SIGTERM": code == 0,
        "no protocol problems": not result["problems"],
    }
    report = {
        "requests": args.requests, "concurrency": args.concurrency, "max_pending": args.max_pending,
        "elapsed_s": round(result["elapsed"], 2), "outcomes": dict(sorted(tally.items())),
        "lost": tally["lost"], "duplicated": sum(n - 1 for n in ids.values() if n > 1),
        "server_counts": {"200": server_ok, "499 (client closed)": server_closed},
        "output_tokens": metrics.get("dspark_output_tokens_total"),
        "server_rss_mb": {"start": round(rss_start["VmRSS"], 1), "end": round(rss_end["VmRSS"], 1),
                          "peak": round(rss_end["VmHWM"], 1)},
        "checks": checks, "problems": result["problems"][:10],
    }
    print(json.dumps(report, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
