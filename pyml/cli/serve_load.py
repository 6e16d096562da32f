"""A small load test for pyml-serve: N concurrent streaming clients, requests/s and tokens/s.

    python -m pyml.cli.serve_load --port 8080 --clients 1,4,16 --requests 16 --max-tokens 32

Talks only to 127.0.0.1; every client sends a bounded number of requests, each with a timeout.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import statistics
import sys
import time

HOST = "127.0.0.1"


def one_request(port: int, i: int, max_tokens: int, timeout: float) -> tuple[int, float, float]:
    """(tokens generated, seconds to first text, seconds in all) of one streamed chat request."""
    body = {"messages": [{"role": "user", "content": f"Tell me fact number {i} about rivers."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "cache_prompt": False}
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        first, tokens = None, 0
        for line in resp:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event["choices"] and event["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - t0
            if "timings" in event:
                tokens = event["timings"]["predicted_n"] + 1
        return tokens, first or 0.0, time.perf_counter() - t0
    finally:
        conn.close()


def run_level(port: int, clients: int, requests: int, max_tokens: int, timeout: float) -> dict:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda i: one_request(port, i, max_tokens, timeout), range(requests)))
    wall = time.perf_counter() - t0
    tokens = sum(r[0] for r in results)
    return {"clients": clients, "requests": requests, "seconds": wall, "requests_per_s": requests / wall,
            "tokens_per_s": tokens / wall, "ttft_median_s": statistics.median(r[1] for r in results),
            "latency_median_s": statistics.median(r[2] for r in results)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="serve_load", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--clients", default="1,4,16", help="comma-separated concurrency levels")
    p.add_argument("--requests", type=int, default=16, help="requests per level")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=300, help="seconds per request")
    args = p.parse_args(argv)
    print("| clients | requests | requests/s | tokens/s | median TTFT s | median latency s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for clients in (int(c) for c in args.clients.split(",")):
        r = run_level(args.port, clients, args.requests, args.max_tokens, args.timeout)
        print(f"| {clients} | {r['requests']} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.1f} | "
              f"{r['ttft_median_s']:.2f} | {r['latency_median_s']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
