"""pyml-serve's HTTP side: an OpenAI-compatible Starlette app in front of one model.

Concurrency: one worker thread owns the model and runs one generation at a time, taking
requests from a FIFO queue (fair: first come, first served). Each request hands the worker
a Job; the worker pushes text events onto the job's asyncio queue. A client that goes away
marks its job cancelled, and the worker stops that generation before its next decode step.
All requests share one PromptCache, so a conversation's next turn (same prefix) prefills
only its new tokens (llama-server's cache_prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pyml.cli.request_profile import profile_summary, recording
from pyml.cli.serve_requests import Request, RequestError, parse
from pyml.core.errors import PymlError
from pyml.nlp.api import LanguageModel
from pyml.nlp.generator import GenerationResult

FINISH = {"eos": "stop", "stop": "stop", "max_tokens": "length", "context": "length", "cancelled": "stop"}
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclass
class Job:
    request: Request
    ids: list
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    profile: dict | None = None

    def put(self, kind: str, value=None):
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("pyml_requests", "requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("pyml_prompt_tokens", "prompt tokens processed (prefilled)", registry=r)
        self.cached_tokens = Counter("pyml_cached_prompt_tokens", "prompt tokens reused from the KV cache",
                                     registry=r)
        self.generated_tokens = Counter("pyml_generated_tokens", "tokens generated", registry=r)
        self.queue = Gauge("pyml_queue_length", "requests waiting for the model", registry=r)
        self.busy = Gauge("pyml_busy", "1 while a generation runs", registry=r)
        self.decode_tok_s = Gauge("pyml_decode_tokens_per_second", "decode speed of the last request",
                                  registry=r)
        self.latency = Histogram("pyml_request_seconds", "request latency, arrival to last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("pyml_queue_wait_seconds", "time waiting for the model",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("pyml_time_to_first_token_seconds", "arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)


class Worker:
    """The one thread that runs the model, one job at a time, in arrival order."""

    def __init__(self, lm: LanguageModel, ctx_size: int, metrics: Metrics):
        self.lm, self.metrics = lm, metrics
        self.cache = lm.new_prompt_cache(ctx_size)
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="pyml-serve-model", daemon=True)

    def start(self):
        self.thread.start()

    def stop(self):
        self.jobs.put(None)
        self.thread.join(timeout=10)

    def submit(self, job: Job):
        self.jobs.put(job)
        self.metrics.queue.set(self.jobs.qsize())

    def _loop(self):
        while (job := self.jobs.get()) is not None:
            self.metrics.queue.set(self.jobs.qsize())
            if job.cancelled:
                continue
            self.metrics.busy.set(1)
            try:
                self._run(job)
            except PymlError as e:
                job.put("error", RequestError(str(e)))
            except Exception as e:  # the server keeps answering; the client learns what happened
                job.put("error", RequestError(f"internal error: {type(e).__name__}: {e}", status=500,
                                              kind="server_error"))
            finally:
                self.metrics.busy.set(0)

    def _run(self, job: Job):
        req = job.request
        if not req.cache_prompt:
            self.cache.reset()
        result = GenerationResult(job.ids)
        records = []
        with recording(records, req.profile):
            stream = self.lm.stream(job.ids, req.max_tokens or self.cache.max_len - len(job.ids),
                                    stop=req.stop, cache=self.cache, result=result, **req.sampling)
            job.put("started")
            for event in stream:
                if job.cancelled:
                    stream.close()  # frees the model now: the next job starts before the next step
                    result.stop_reason = "cancelled"
                    break
                if event.text:
                    job.put("text", event.text)
        if req.profile:
            job.profile = profile_summary(records)
        m = self.metrics
        m.prompt_tokens.inc(result.prefilled_tokens)
        m.cached_tokens.inc(result.cached_tokens)
        m.generated_tokens.inc(len(result.tokens))
        if result.decode_s:
            m.decode_tok_s.set(result.decode_tok_s)
        job.put("done", result)


def usage(result: GenerationResult) -> dict:
    n_prompt, n_gen = len(result.prompt_tokens), len(result.tokens)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


class Server:
    def __init__(self, lm: LanguageModel, model_id: str, ctx_size: int, api_key: str | None = None):
        self.lm, self.model_id, self.ctx_size, self.api_key = lm, model_id, ctx_size, api_key
        self.metrics = Metrics()
        self.worker = Worker(lm, ctx_size, self.metrics)
        self.created = int(time.time())

    def app(self) -> Starlette:
        routes = [Route("/health", self.health), Route("/metrics", self.prometheus),
                  Route("/v1/models", self.models),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"])]
        return Starlette(routes=routes, exception_handlers={HTTPException: self._http_error,
                                                             Exception: self._internal_error},
                         lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.worker.start()
        try:
            yield
        finally:
            self.worker.stop()

    # --- small endpoints ---
    async def health(self, request):
        return JSONResponse({"status": "ok", "queue": self.worker.jobs.qsize()})

    async def prometheus(self, request):
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request):
        if (denied := self._denied(request)) is not None:
            return denied
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "pyml",
             "meta": {"context_size": self.ctx_size, "source": self.lm.source}}]})

    # --- completions ---
    async def chat_completions(self, request):
        return await self._complete(request, chat=True, endpoint="chat")

    async def completions(self, request):
        return await self._complete(request, chat=False, endpoint="completions")

    async def _complete(self, http: HTTPRequest, chat: bool, endpoint: str):
        arrived = time.perf_counter()
        if (denied := self._denied(http)) is not None:
            return self._counted(denied, endpoint)
        try:
            try:
                body = json.loads(await http.body())
            except (ValueError, UnicodeDecodeError) as e:
                raise RequestError(f"the body is not valid JSON: {e}") from None
            req = parse(body, chat, self.model_id, self._chat_prompt)
            ids = self.lm.encode(req.prompt)
            self._check_length(ids, req)
        except RequestError as e:
            return self._counted(JSONResponse(e.body(), status_code=e.status), endpoint)
        job = Job(req, ids, asyncio.get_running_loop())
        self.worker.submit(job)
        answer = _Answer(self, job, chat, arrived, endpoint)
        if req.stream:
            return StreamingResponse(answer.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await answer.whole()

    def _chat_prompt(self, messages):
        try:
            return self.lm.chat_prompt(messages)
        except PymlError as e:  # the template refused the conversation (e.g. roles out of order)
            raise RequestError(str(e), "messages") from None

    def _check_length(self, ids, req: Request):
        if len(ids) > self.ctx_size:
            raise RequestError(f"the prompt is {len(ids)} tokens, longer than the context size of "
                               f"{self.ctx_size}", code="context_length_exceeded")
        if req.max_tokens is not None and len(ids) + req.max_tokens > self.ctx_size:
            raise RequestError(f"max_tokens {req.max_tokens} + the prompt's {len(ids)} tokens exceed the "
                               f"context size of {self.ctx_size}", "max_tokens", code="context_length_exceeded")
        if len(ids) >= self.ctx_size:
            raise RequestError(f"the prompt is {len(ids)} tokens and fills the context size of "
                               f"{self.ctx_size}: no room to generate", code="context_length_exceeded")

    def _denied(self, request) -> JSONResponse | None:
        if self.api_key is None or request.headers.get("authorization") == f"Bearer {self.api_key}":
            return None
        return JSONResponse(RequestError("invalid API key", status=401, code="invalid_api_key").body(),
                            status_code=401)

    def _counted(self, response: Response, endpoint: str) -> Response:
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    async def _http_error(self, request, exc: HTTPException):
        err = RequestError(exc.detail or "not found", status=exc.status_code)
        return JSONResponse(err.body(), status_code=exc.status_code)

    async def _internal_error(self, request, exc: Exception):
        err = RequestError(f"internal error: {type(exc).__name__}", status=500, kind="server_error")
        return JSONResponse(err.body(), status_code=500)


class _Answer:
    """One request's reply, whole or streamed, built from its job's events."""

    def __init__(self, server: Server, job: Job, chat: bool, arrived: float, endpoint: str):
        self.server, self.job, self.chat, self.arrived, self.endpoint = server, job, chat, arrived, endpoint
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.first_token = None

    async def events(self):
        """(kind, value) from the worker until "done"; a cancelled wait cancels the job."""
        m = self.server.metrics
        try:
            while True:
                kind, value = await self.job.events.get()
                if kind == "started":
                    m.queue_wait.observe(time.perf_counter() - self.arrived)
                    continue
                if kind == "text" and self.first_token is None:
                    self.first_token = time.perf_counter()
                    m.ttft.observe(self.first_token - self.arrived)
                yield kind, value
                if kind in ("done", "error"):
                    if kind == "done":
                        m.latency.observe(time.perf_counter() - self.arrived)
                    return
        finally:
            self.job.cancelled = True  # a no-op after "done"; else the client left: free the model

    def _final(self, result: GenerationResult) -> dict:
        out = {"usage": usage(result), "timings": result.timings()}
        if self.job.profile is not None:
            out["pyml"] = {"profile": self.job.profile}
        return out

    def _choice(self, text: str | None, finish: str | None, delta: bool) -> dict:
        if self.chat:
            content = {"delta": {} if text is None else {"content": text}} if delta else \
                {"message": {"role": "assistant", "content": text}}
            return {"index": 0, **content, "finish_reason": finish, "logprobs": None}
        return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}

    def _envelope(self, choices, delta: bool) -> dict:
        kind = ("chat.completion.chunk" if delta else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.server.model_id,
                "system_fingerprint": "pyml", "choices": choices}

    async def whole(self) -> Response:
        pieces = []
        async for kind, value in self.events():
            if kind == "text":
                pieces.append(value)
            elif kind == "error":
                return self.server._counted(JSONResponse(value.body(), status_code=value.status), self.endpoint)
            elif kind == "done":
                body = self._envelope([self._choice("".join(pieces), FINISH.get(value.stop_reason, "stop"),
                                                    delta=False)], delta=False)
                body.update(self._final(value))
                return self.server._counted(JSONResponse(body), self.endpoint)

    async def sse(self):
        status = "200"
        try:
            if self.chat:
                yield _sse(self._envelope([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "finish_reason": None, "logprobs": None}], delta=True))
            async for kind, value in self.events():
                if kind == "text":
                    yield _sse(self._envelope([self._choice(value, None, delta=True)], delta=True))
                elif kind == "error":  # headers are sent: the error travels as an event, as OpenAI's does
                    status = str(value.status)
                    yield _sse(value.body())
                elif kind == "done":
                    last = self._envelope([self._choice(None, FINISH.get(value.stop_reason, "stop"), delta=True)],
                                          delta=True)
                    last.update(self._final(value))
                    if not self.job.request.include_usage:
                        last["usage"] = None  # OpenAI sends usage in the stream only when asked
                        last["timings"] = value.timings()
                    yield _sse(last)
            yield "data: [DONE]\n\n"
        finally:
            self.server.metrics.requests.labels(self.endpoint, status).inc()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
