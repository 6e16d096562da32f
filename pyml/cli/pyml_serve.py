"""pyml-serve: an OpenAI-compatible HTTP server for one model (see docs/serving.md).

    pyml-serve [-m MODEL] [--host 127.0.0.1] [--port 8080] [--ctx-size N] [--api-key KEY]
               [--max-queue N] [--timeout S] [--max-body BYTES] [-n MAX_TOKENS] ...
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import sys
from pathlib import Path

import uvicorn

from pyml.cli.main import Parser, run_command, say
from pyml.cli.options import add_model_options, add_speculative_options, check_kv_memory, check_speculative, \
    model_options, speculative_options
from pyml.cli.serve_app import Limits, Server
from pyml.cli.serve_guard import is_loopback, timed_h11
from pyml.core import perf, runtime
from pyml.core.errors import PymlError
from pyml.core.version import __version__
from pyml.nlp.api import DEFAULT_MODEL, load_model

DEFAULT_CTX = 4096  # the whole window of a 8K-context model would be a 0.4-2 GB KV cache held for ever


def build_parser() -> Parser:
    p = Parser(prog="pyml-serve", description="Serve a model over an OpenAI-compatible HTTP API.")
    add_model_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 = any free port)")
    p.add_argument("-c", "--ctx-size", type=int, default=DEFAULT_CTX,
                   help=f"context size: prompt + reply tokens (default {DEFAULT_CTX}, at most the model's window)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on every path but /health (or env PYML_API_KEY)")
    d = Limits()
    p.add_argument("-n", "--max-tokens", type=int, default=d.max_tokens,
                   help=f"a reply's tokens when the request names no max_tokens (default {d.max_tokens})")
    p.add_argument("--parallel", type=int, default=None, metavar="N",
                   help="generations run at once, each step one batched pass over all of them; a request "
                        f"joins at the next step, each slot with its own prompt cache (default {d.parallel}, "
                        "as llama-server's; 1 with --draft-model, which drafts for one sequence)")
    p.add_argument("--max-queue", type=int, default=None,
                   help="requests that may wait for the model; more get 503 (default 16 per core)")
    p.add_argument("--max-connections", type=int, default=None,
                   help="open connections; more get 503 (default --max-queue + 64)")
    p.add_argument("--timeout", type=float, default=d.timeout,
                   help=f"seconds a request may take, queue wait included; then 504 (default {d.timeout:g})")
    p.add_argument("--max-body", type=int, default=d.max_body,
                   help=f"bytes of a request body; larger get 413 (default {d.max_body})")
    p.add_argument("--read-timeout", type=float, default=d.read_timeout,
                   help=f"seconds for a request's headers, and for its body (default {d.read_timeout:g})")
    p.add_argument("--alias", default=None, help="the model id clients name (default: the model's name)")
    p.add_argument("--log", metavar="LEVEL", default=None, help="log level (or env PYML_LOG / LOG)")
    p.add_argument("--version", action="version", version=f"pyml {__version__}")
    add_speculative_options(p)
    return p


def model_id(args) -> str:
    name = args.model or args.gguf or args.safetensors or DEFAULT_MODEL
    return Path(name).name if Path(name).exists() else name


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a port in use is one line at once, not
    after the load; and --port 0's port is known, to be said. (uvicorn's own bind would log and exit.)"""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise PymlError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def check_limits(args) -> Limits:
    """The request limits the flags ask for, or PymlError naming the flag out of range (the listening
    flags, --port and --host, are checked here too: before the socket and the model)."""
    positive = {"--ctx-size": (args.ctx_size, 2), "--max-tokens": (args.max_tokens, 1),
                "--max-queue": (args.max_queue, 1), "--max-connections": (args.max_connections, 1),
                "--max-body": (args.max_body, 1), "--parallel": (args.parallel, 1)}
    for flag, (value, least) in positive.items():
        if value is not None and value < least:
            raise PymlError(f"{flag} must be >= {least}, got {value}")
    if not 0 <= args.port <= 65535:
        raise PymlError(f"--port must be 0-65535, got {args.port}")
    check_speculative(args)
    if args.parallel is None:
        args.parallel = 1 if args.draft_model is not None else Limits.parallel
    if args.draft_model is not None and args.parallel != 1:
        raise PymlError(f"--draft-model with --parallel {args.parallel} is not implemented: a draft model drafts "
                        "for one sequence at a time (--parallel 1); --lookup-ngram drafts for a batch")
    for flag, value in (("--timeout", args.timeout), ("--read-timeout", args.read_timeout)):
        if not value > 0:
            raise PymlError(f"{flag} must be > 0 seconds, got {value:g}")
        if value == math.inf:
            raise PymlError(f"{flag} must be finite: every request is bounded")
    if not args.host.strip():  # the socket would bind every interface
        raise PymlError("--host is empty: give an address (127.0.0.1: this machine only; 0.0.0.0: every interface)")
    return Limits(max_queue=args.max_queue or 0, max_connections=args.max_connections or 0,
                  max_body=args.max_body, timeout=args.timeout, read_timeout=args.read_timeout,
                  max_tokens=args.max_tokens, parallel=args.parallel)


class Uvicorn(uvicorn.Server):
    """uvicorn's server, which on SIGTERM/SIGINT first ends pyml's work (waiting requests 503, the
    running one cancelled), so open streams end and the process exits within a few seconds."""

    def __init__(self, config: uvicorn.Config, server: Server):
        super().__init__(config)
        self.pyml = server

    async def shutdown(self, sockets=None):
        self.pyml.stop(wait=0)  # not on the event loop: the lifespan's end waits for the thread
        await super().shutdown(sockets)


def run(args) -> int:
    perf.configure(args.log)
    limits = check_limits(args)
    api_key = args.api_key if args.api_key is not None else os.environ.get("PYML_API_KEY")
    if api_key is not None and not api_key.strip():  # "Bearer " alone would pass: an unset variable's, most likely
        raise PymlError(("--api-key" if args.api_key is not None else "PYML_API_KEY") + " is empty: give the key, "
                        "or leave it out for a server without one")
    sock = listening_socket(args.host, args.port)
    port = sock.getsockname()[1]  # --port 0: the one the OS gave
    lm = runtime.in_passing_thread(load_model, **model_options(args))  # the model thread alone launches kernels
    limits = dataclasses.replace(limits, threads=lm.runtime.threads)
    ctx = min(args.ctx_size, lm.model.max_positions)
    check_kv_memory(lm, ctx, limits.parallel, f"--parallel {limits.parallel}", "lower --parallel or --ctx-size",
                    "pyml-serve")
    speculative = runtime.in_passing_thread(speculative_options, args, lm).get("speculative")  # a draft model too
    server = Server(lm, args.alias or model_id(args), ctx, api_key, limits, loopback_only=is_loopback(args.host),
                    speculative=speculative)
    config = uvicorn.Config(server.app(), host=args.host, port=port, log_level="warning",
                            timeout_graceful_shutdown=3, limit_concurrency=limits.connections,
                            http=timed_h11(limits.read_timeout), timeout_keep_alive=5)
    server.start()  # the worker thread sets its thread count: the banner says what it got
    host = f"[{args.host}]" if ":" in args.host else args.host
    say(f"pyml-serve: {server.model_id} ({lm.source}), context {ctx}, on http://{host}:{port} "
        f"(load {lm.load_s * 1e3:.0f} ms, threads {server.worker.threads_in_use}, queue {limits.queue}, "
        f"timeout {limits.timeout:g} s)")
    Uvicorn(config, server).run(sockets=[sock])
    return 0


def main(argv=None) -> int:
    return run_command("pyml-serve", run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
