"""A small load test for pyml-serve: N concurrent streaming clients, requests/s, tokens/s, the
p50 / p99 of the time to first text and of the whole reply's latency, and the prompt tokens a
request prefilled (its `timings`' prompt_n);
or, with --give-up, a burst of clients that leave after S seconds and how soon the server is idle.
With --rounds N the levels take turns N times (the machine is shared and noisy), and two lines
follow the table: each level's median tokens/s and range, and each round's ratio of every level to
the first (e.g. 16 clients against 1).

    python -m pyml.cli.serve_load --port 8080 --clients 1,4,16 --requests 16 --max-tokens 32
    python -m pyml.cli.serve_load --port 8080 --clients 1,16 --cache-prompt
    python -m pyml.cli.serve_load --port 8080 --clients 1,16 --requests 32 --max-tokens 64 --rounds 5
    python -m pyml.cli.serve_load --port 8080 --clients 300 --give-up 2 --max-tokens 900

Talks only to 127.0.0.1; every client sends a bounded number of requests, each with a timeout.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import statistics
import sys
import time

from pyml.cli.main import Parser, run_command
from pyml.core.errors import PymlError

HOST = "127.0.0.1"


def one_request(port: int, i: int, max_tokens: int, timeout: float,
                cache_prompt: bool = False) -> tuple[int, float, float, int]:
    """(tokens generated, seconds to first text, seconds in all, prompt tokens prefilled) of one
    streamed chat request. The prompts share the chat template's start; with `cache_prompt` (the
    server's default, as llama-server's) a slot that held an earlier prompt prefills only what
    differs, without it every request prefills its whole prompt."""
    body = {"messages": [{"role": "user", "content": f"Tell me fact number {i} about rivers."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "cache_prompt": cache_prompt}
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        first, tokens, prefilled = None, 0, 0
        for line in resp:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event["choices"] and event["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - t0
            if "timings" in event:
                tokens, prefilled = event["timings"]["predicted_n"], event["timings"]["prompt_n"]
        return tokens, first or 0.0, time.perf_counter() - t0, prefilled
    finally:
        conn.close()


def p50_p99(values: list) -> tuple[float, float]:
    """The median and the 99th percentile (statistics.quantiles' inclusive method: interpolated
    between the two nearest values; one value is both)."""
    if len(values) == 1:
        return values[0], values[0]
    return statistics.median(values), statistics.quantiles(values, n=100, method="inclusive")[98]


def run_level(port: int, clients: int, requests: int, max_tokens: int, timeout: float,
              cache_prompt: bool = False) -> dict:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda i: one_request(port, i, max_tokens, timeout, cache_prompt), range(requests)))
    wall = time.perf_counter() - t0
    tokens = sum(r[0] for r in results)
    (ttft_p50, ttft_p99), (latency_p50, latency_p99) = (p50_p99([r[k] for r in results]) for k in (1, 2))
    return {"clients": clients, "requests": requests, "seconds": wall, "requests_per_s": requests / wall,
            "tokens_per_s": tokens / wall, "ttft_p50_s": ttft_p50, "ttft_p99_s": ttft_p99,
            "latency_p50_s": latency_p50, "latency_p99_s": latency_p99,
            "prefilled_per_request": sum(r[3] for r in results) / len(results)}


def health(port: int) -> dict:
    conn = http.client.HTTPConnection(HOST, port, timeout=5)
    try:
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def impatient_request(port: int, i: int, max_tokens: int, give_up: float, cache_prompt: bool = False) -> int:
    """The HTTP status of a streamed request whose client leaves after `give_up` seconds (0: none came)."""
    try:
        one_request(port, i, max_tokens, give_up, cache_prompt)
        return 200
    except RuntimeError as e:  # "HTTP 503: ..."
        return int(str(e).split()[1].rstrip(":"))
    except OSError:  # gave up (a timeout) or was refused
        return 0


def run_abandon(port: int, clients: int, max_tokens: int, give_up: float, within: float = 60,
                cache_prompt: bool = False) -> dict:
    """`clients` at once, each leaving after `give_up` s; then the seconds until /health is idle."""
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        statuses = list(pool.map(lambda i: impatient_request(port, i, max_tokens, give_up, cache_prompt),
                                 range(clients)))
    t0 = time.perf_counter()
    while (h := health(port)).get("busy") or h["queue"]:
        if time.perf_counter() - t0 > within:
            break
        time.sleep(0.05)
    return {"statuses": {s: statuses.count(s) for s in sorted(set(statuses))},
            "idle_after_s": time.perf_counter() - t0, "health": h}


def run(args) -> int:
    levels = _levels(args.clients)
    try:
        health(args.port)
    except OSError as e:
        raise PymlError(f"no pyml-serve answers on {HOST}:{args.port} ({e}); start one with pyml-serve --port "
                        f"{args.port}") from None
    if args.give_up is not None:
        r = run_abandon(args.port, levels[0], args.max_tokens, args.give_up, cache_prompt=args.cache_prompt)
        print(f"statuses {r['statuses']} (0: the client left before the reply ended); "
              f"idle {r['idle_after_s']:.2f} s after "
              f"the last client left; /health {r['health']}")
        return 0
    if args.rounds < 1:
        raise PymlError(f"--rounds must be at least 1, not {args.rounds}")
    print(TABLE_HEAD)
    rounds = []
    for _ in range(args.rounds):
        rounds.append([run_level(args.port, clients, args.requests, args.max_tokens, args.timeout, args.cache_prompt)
                       for clients in levels])
        for r in rounds[-1]:
            print(table_row(r), flush=True)
    if args.rounds > 1:
        print("\n".join(summary(rounds)))
    return 0


def summary(rounds: list) -> list:
    """Two lines on rounds of run_level results (each round: one per level, in the same order): each
    level's median tokens/s and range over the rounds, and each round's tokens/s of every later
    level against the first level's, with their median."""
    levels = [r["clients"] for r in rounds[0]]
    rates = [[rnd[i]["tokens_per_s"] for rnd in rounds] for i in range(len(levels))]
    lines = [f"tokens/s over {len(rounds)} rounds, median (range): " + "; ".join(
        f"{n} client{'s' * (n > 1)} {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"
        for n, v in zip(levels, rates))]
    for n, v in zip(levels[1:], rates[1:]):
        ratios = [b / a for a, b in zip(rates[0], v)]
        lines.append(f"{n} clients against {levels[0]}, each round: {' '.join(f'{x:.2f}x' for x in ratios)} "
                     f"(median {statistics.median(ratios):.2f}x)")
    return lines


def _levels(text: str) -> list:
    try:
        levels = [int(c) for c in text.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise PymlError(f"--clients takes comma-separated counts of at least 1, not {text!r}")
    return levels


TABLE_HEAD = ("| clients | requests | requests/s | tokens/s | TTFT p50 s | TTFT p99 s | latency p50 s | latency p99 s "
              "| prefilled/request |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def table_row(r: dict) -> str:
    """run_level's figures as a row of TABLE_HEAD's table."""
    return (f"| {r['clients']} | {r['requests']} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.1f} | "
            f"{r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['latency_p50_s']:.2f} | {r['latency_p99_s']:.2f} | "
            f"{r['prefilled_per_request']:.1f} |")


def main(argv=None) -> int:
    p = Parser(prog="serve_load", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--clients", default="1,4,16", help="comma-separated concurrency levels")
    p.add_argument("--requests", type=int, default=16, help="requests per level")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=300, help="seconds per request")
    p.add_argument("--cache-prompt", action="store_true",
                   help="let the server reuse a slot's cached prompt start (its default); without it every "
                        "request sends cache_prompt false and prefills its whole prompt")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the levels in turn this many times; then each level's median and each round's ratios")
    p.add_argument("--give-up", type=float, default=None, metavar="S",
                   help="one burst of --clients clients that leave after S seconds; say how soon the server is idle")
    return run_command("serve_load", run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
