"""pyml-serve's edge: what every request passes before a route sees it, and the reading of a body.

- `Guard` (ASGI middleware): the Host allowlist of a loopback server (a web page that rebinds its
  own DNS name to 127.0.0.1 still sends its own name as Host), the API key (constant-time
  compare; every path but /health), `application/json` bodies only (a page's form or
  `text/plain` POST needs no CORS preflight: refusing other types is the CSRF guard), and the
  request count and latency of every answer, refusals included.
- `read_body`: at most `max_body` bytes (413 from Content-Length before reading any, or as soon
  as the bytes read pass it), within `timeout` seconds (408).
- `timed_h11`: uvicorn's h11 protocol with a deadline for a request's headers: a client that
  opens a connection and sends half a request is closed, not held for ever.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import time

from starlette.datastructures import Headers
from uvicorn.protocols.http.h11_impl import H11Protocol

from pyml.cli.serve_requests import RequestError
from pyml.cli.serve_worker import Metrics

OPEN_PATHS = {"/health"}  # answered without the API key: a load balancer's probe holds none
COMPLETION_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
ENDPOINTS = {**COMPLETION_PATHS, "/v1/models": "models", "/health": "health", "/metrics": "metrics",
             "/tokenize": "tokenize", "/detokenize": "detokenize", "/apply-template": "apply-template",
             "/props": "props"}


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def host_name(header: str) -> str:
    """The name in a Host header, without its port: `[::1]:8080` -> `::1`, `localhost:80` -> `localhost`."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def error_response(err: RequestError, headers: dict | None = None):
    """(status, headers, body) of an OpenAI-style error."""
    body = json.dumps(err.body()).encode()
    return err.status, {"content-type": "application/json", **(headers or {})}, body


async def send_error(send, err: RequestError, headers: dict | None = None):
    status, head, body = error_response(err, headers)
    await send({"type": "http.response.start", "status": status,
                "headers": [(k.encode(), v.encode()) for k, v in head.items()]})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware: Host, API key, content type, and the count of every request."""

    def __init__(self, app, metrics: Metrics, api_key: str | None, loopback_only: bool):
        self.app, self.metrics, self.loopback_only = app, metrics, loopback_only
        self.api_key = api_key.encode() if api_key is not None else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        arrived, status = time.perf_counter(), []

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            if (refusal := self.refusal(scope)) is not None:
                await send_error(counted_send, refusal)
            else:
                await self.app(scope, receive, counted_send)
        finally:
            endpoint = ENDPOINTS.get(scope["path"], "other")
            label = scope.get("state", {}).get("pyml_status") or (str(status[0]) if status else "499")
            self.metrics.requests.labels(endpoint, label).inc()
            if scope["path"] in COMPLETION_PATHS:
                self.metrics.latency.observe(time.perf_counter() - arrived)

    def refusal(self, scope) -> RequestError | None:
        headers = Headers(scope=scope)
        if self.loopback_only:
            host = host_name(headers.get("host", ""))
            if not is_loopback(host):
                return RequestError(f"the Host {host[:64]!r} is not this server's: a server on a loopback address "
                                    "answers only localhost, 127.0.0.1 and ::1", status=421,
                                    code="misdirected_request")
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get("authorization", "").encode("latin-1")
            if not hmac.compare_digest(given, b"Bearer " + self.api_key):
                return RequestError("invalid API key", status=401, code="invalid_api_key")
        if scope["method"] == "POST":
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                return RequestError(f"the body must be application/json, not {media[:64] or 'untyped'!r}",
                                    status=415, code="unsupported_media_type")
        return None


async def read_body(http, max_body: int, timeout: float) -> bytes:
    """The request's body: RequestError 413 past `max_body` bytes, 408 after `timeout` seconds."""
    too_big = RequestError(f"the body is larger than the {max_body:,} bytes this server reads (--max-body)",
                           status=413, code="request_too_large")
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body:
        raise too_big

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > max_body:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise RequestError(f"the body did not arrive within {timeout:g} s (--read-timeout)", status=408,
                           code="request_timeout") from None


def timed_h11(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose next request's headers take longer than
    `header_timeout` seconds to arrive (uvicorn has a keep-alive timeout, but none for headers)."""

    class TimedH11Protocol(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm_header_deadline()

        def _arm_header_deadline(self):
            armed = self.scope  # a new request's headers make a new scope
            self.loop.call_later(header_timeout, self._header_deadline, armed)

        def _header_deadline(self, armed):
            if self.scope is armed and not self.transport.is_closing():
                if self.cycle is None or self.cycle.response_complete:
                    self.transport.close()

    return TimedH11Protocol
