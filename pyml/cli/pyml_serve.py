"""pyml-serve: an OpenAI-compatible HTTP server for one model (see docs/serving.md).

    pyml-serve [-m MODEL] [--host 127.0.0.1] [--port 8080] [--ctx-size N] [--api-key KEY]
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import uvicorn

from pyml.cli.main import Parser, run_command, say
from pyml.cli.options import add_model_options, model_options
from pyml.cli.serve_app import Server
from pyml.core import perf
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
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 requests")
    p.add_argument("--alias", default=None, help="the model id clients name (default: the model's name)")
    p.add_argument("--log", metavar="LEVEL", default=None, help="log level (or env PYML_LOG / LOG)")
    p.add_argument("--version", action="version", version=f"pyml {__version__}")
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


def run(args) -> int:
    perf.configure(args.log)
    if args.ctx_size < 2:
        say(f"pyml-serve: error: --ctx-size must be >= 2, got {args.ctx_size}")
        return 2
    sock = listening_socket(args.host, args.port)
    port = sock.getsockname()[1]  # --port 0: the one the OS gave
    lm = load_model(**model_options(args))
    ctx = min(args.ctx_size, lm.model.max_positions)
    server = Server(lm, args.alias or model_id(args), ctx, args.api_key)
    config = uvicorn.Config(server.app(), host=args.host, port=port, log_level="warning",
                            timeout_graceful_shutdown=5)
    host = f"[{args.host}]" if ":" in args.host else args.host
    say(f"pyml-serve: {server.model_id} ({lm.source}), context {ctx}, on http://{host}:{port} "
        f"(load {lm.load_s * 1e3:.0f} ms, threads {lm.runtime.threads})")
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def main(argv=None) -> int:
    return run_command("pyml-serve", run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
