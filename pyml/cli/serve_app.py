"""pyml-serve's HTTP side: an OpenAI-compatible Starlette app in front of one model.

The event loop only does I/O: a request's body is read within --max-body and --read-timeout
(serve_guard.py), then parsed, its chat template rendered and its prompt tokenized on a small
thread pool (a 2 MB prompt must not stall /health), then queued for the model's one worker
thread (serve_worker.py). Every request is bounded: a full queue answers 503 + Retry-After; a
request that runs over --timeout is cancelled and answered 504; a client that leaves (stream or
not) cancels its job, which frees the model before its next decode step. All requests share one
PromptCache, so a conversation's next turn (same prefix) prefills only its new tokens
(llama-server's cache_prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass

import anyio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pyml.cli.main import one_line
from pyml.cli.openai_objects import FINISH, choice, envelope, new_id, usage
from pyml.cli.serve_guard import Guard, read_body
from pyml.cli.serve_logprobs import Replies
from pyml.cli.serve_requests import TOKEN_FIELDS, Request, RequestError, check_context, parse, parse_token_request
from pyml.cli.serve_structured import (HeldCalls, Structured, call_id, parse_structured, reply_calls,
                                       template_messages, tool_call_objects, tool_prompt)
from pyml.cli.serve_worker import BatchWorker, Job, Metrics, QueueFull, Worker
from pyml.core.errors import PymlError
from pyml.core.runtime import cpu_count
from pyml.core.version import __version__
from pyml.nlp.api import LanguageModel
from pyml.nlp.chat import CHATML_TEMPLATE
from pyml.nlp.constrained import Constraint
from pyml.nlp.generator import GenerationResult, check_prompt
from pyml.nlp.sampling import SamplingConfig

@dataclass(frozen=True)
class Limits:
    """What bounds each request and the server as a whole (pyml-serve's flags; docs/serving.md)."""
    threads: int = 1                 # -t: Numba threads of the model's worker thread
    max_queue: int = 0               # --max-queue: requests waiting for the model (0: 16 per core)
    max_connections: int = 0         # --max-connections: open connections (0: max_queue + 64)
    max_body: int = 8 * 2**20        # --max-body: bytes of a request body
    timeout: float = 600.0           # --timeout: seconds from arrival to the last token
    read_timeout: float = 30.0       # --read-timeout: seconds for a request's headers, and for its body
    max_tokens: int = 1024           # --max-tokens: a reply's tokens when the request names none
    parallel: int = 4                # --parallel: generations run at once, one batched step at a time
                                     # (llama-server -np's default: concurrent clients share a step's weight reads)

    @property
    def queue(self) -> int:
        return self.max_queue or 16 * cpu_count()

    @property
    def connections(self) -> int:
        return self.max_connections or self.queue + 64


def longest_token_chars(lm: LanguageModel) -> int:
    """At least the characters one token of `lm`'s vocabulary stands for (its most bytes: a
    character is one byte or more): a prompt longer than ctx_size times this cannot fit, and is
    refused without being tokenized."""
    tok = lm.tokenizer
    if tok is None:
        return 1
    return max(1, max(len(tok.token_bytes(i)) for i in range(tok.vocab_size)))


class Server:
    def __init__(self, lm: LanguageModel, model_id: str, ctx_size: int, api_key: str | None = None,
                 limits: Limits = Limits(), loopback_only: bool = True, speculative=None):
        """speculative: a SpeculativeConfig every request's generation drafts with (a draft model at
        --parallel 1 only: it drafts for one sequence at a time)."""
        self.lm, self.model_id, self.ctx_size, self.limits = lm, model_id, ctx_size, limits
        self.api_key, self.loopback_only = api_key, loopback_only
        self.metrics = Metrics()
        if speculative is not None and speculative.draft_model is not None and limits.parallel != 1:
            raise PymlError(f"--draft-model with --parallel {limits.parallel} is not implemented: a draft model "
                            "drafts for one sequence at a time (--parallel 1); --lookup-ngram drafts for a batch")
        self.worker = (Worker(lm, ctx_size, self.metrics, limits.threads, limits.queue, speculative)
                       if limits.parallel == 1 else
                       BatchWorker(lm, ctx_size, self.metrics, limits.threads, limits.queue, limits.parallel,
                                   speculative))
        self.max_prompt_chars = ctx_size * longest_token_chars(lm)
        self.created = int(time.time())
        # parsing, templates and tokenizing: off the event loop, a few at a time
        self._prepare_slots = anyio.CapacityLimiter(max(2, cpu_count()))

    def app(self):
        routes = [Route("/health", self.health), Route("/metrics", self.prometheus),
                  Route("/v1/models", self.models), Route("/props", self.props),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  *[Route(path, self.token_endpoint, methods=["POST"]) for path in TOKEN_FIELDS]]
        app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_error,
                                                            Exception: self._internal_error},
                        lifespan=self._lifespan)
        return Guard(app, self.metrics, self.api_key, self.loopback_only)

    def start(self) -> None:
        """Start the model's worker thread (before the banner, which says its thread count)."""
        self.worker.start()

    def stop(self, wait: float = 3.0) -> None:
        """Shutting down: waiting requests are answered 503, the running one is cancelled; wait up
        to `wait` seconds for the worker thread to end."""
        self.worker.stop(wait)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.start()
        try:
            yield
        finally:
            self.stop()

    # --- small endpoints ---
    async def health(self, request):
        w = self.worker
        return JSONResponse({"status": "ok", "queue": len(w.jobs), "busy": int(w.current is not None),
                             "running": w.running, "threads": w.threads_in_use, "max_queue": self.limits.queue,
                             "parallel": self.limits.parallel})

    async def prometheus(self, request):
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request):
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "pyml",
             "meta": {"context_size": self.ctx_size, "source": self.lm.source}}]})

    async def props(self, request):
        """llama-server's /props, the part pyml has: the context, the slots, a request's defaults and
        the chat template in effect (clients that render prompts themselves read it here)."""
        tok = self.lm.tokenizer
        defaults = parse({"prompt": "x"}, False, self.model_id, None)[0].sampling
        return JSONResponse({
            "model_alias": self.model_id, "total_slots": self.limits.parallel,
            "default_generation_settings": {"n_ctx": self.ctx_size,
                                            "params": {"n_predict": self.limits.max_tokens, **defaults}},
            "chat_template": None if tok is None else self.lm.chat_template or tok.chat_template or CHATML_TEMPLATE,
            "bos_token": None if tok is None else tok.bos_token, "eos_token": None if tok is None else tok.eos_token,
            "build_info": f"pyml {__version__}"})

    # --- completions ---
    async def chat_completions(self, request):
        return await self._complete(request, chat=True)

    async def completions(self, request):
        return await self._complete(request, chat=False)

    async def token_endpoint(self, http: HTTPRequest):
        """llama-server's /tokenize, /detokenize and /apply-template: the tokenizer's or the chat
        template's work alone, no model step; on the pool (a long text must not stall the event loop),
        within --timeout."""
        arrived = time.perf_counter()
        try:
            raw = await read_body(http, self.limits.max_body, self.limits.read_timeout)
            answer = await self._off_loop(self._token_answer, arrived, raw, http.url.path)
        except RequestError as e:
            return _refusal(e)
        return JSONResponse(answer)

    def _token_answer(self, raw: bytes, path: str) -> dict:
        asked = parse_token_request(_json_body(raw), path, self.model_id)
        if path == "/apply-template":
            return {"prompt": self._chat_prompt(asked["messages"], Structured())}
        if self.lm.tokenizer is None:
            raise RequestError(f"{path}: this model has no tokenizer")
        if path == "/detokenize":
            vocab = self.lm.tokenizer.vocab_size
            if (bad := next((t for t in asked["tokens"] if not 0 <= t < vocab), None)) is not None:
                raise RequestError(f"token id {bad} is outside the vocabulary of {vocab} tokens", "tokens")
            return {"content": self.lm.decode(asked["tokens"])}
        self._check_chars(len(asked["content"]), "text")
        try:
            ids = self.lm.encode(asked["content"], asked["add_special"])
        except PymlError as e:
            raise RequestError(one_line(e), "content") from None
        if not asked["with_pieces"]:
            return {"tokens": ids}
        pieces = [self.lm.tokenizer.token_bytes(i) for i in ids]  # as llama-server: text, or its bytes if not UTF-8
        return {"tokens": [{"id": i, "piece": _piece(b)} for i, b in zip(ids, pieces)]}

    async def _complete(self, http: HTTPRequest, chat: bool):
        arrived = time.perf_counter()
        try:
            raw = await read_body(http, self.limits.max_body, self.limits.read_timeout)
            prepared = await self._off_loop(self._prepare, arrived, raw, chat)
            loop = asyncio.get_running_loop()
            jobs = [Job(req, ids, loop) for req, ids in prepared]
            try:
                self.worker.submit(*jobs)
            except QueueFull as e:
                raise RequestError(str(e), status=503, kind="server_error", code="queue_full") from None
        except RequestError as e:
            return _refusal(e)
        answers = [_Answer(self, job, chat, arrived, http) for job in jobs]
        answer = answers[0] if len(answers) == 1 else _Answers(answers)
        if jobs[0].request.stream:
            return StreamingResponse(answer.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await answer.whole()

    async def _off_loop(self, work, arrived: float, *args):
        """`work(*args)` on the pool, within what is left of --timeout since `arrived` (504 after:
        the thread is left to finish alone)."""
        try:
            with anyio.fail_after(max(0.0, arrived + self.limits.timeout - time.perf_counter())):
                return await anyio.to_thread.run_sync(work, *args, limiter=self._prepare_slots,
                                                      abandon_on_cancel=True)
        except TimeoutError:
            raise RequestError(f"the request ran over this server's --timeout of {self.limits.timeout:g} s "
                               "before it was ready", status=504, kind="server_error", code="timeout") from None

    def _prepare(self, raw: bytes, chat: bool) -> list[tuple[Request, list]]:
        """The checked requests (one per prompt) and their prompts' token ids (a worker thread of the
        pool: may be slow)."""
        body = _json_body(raw)
        structured = parse_structured(body, chat) if isinstance(body, dict) else Structured()
        try:
            reqs = parse(body, chat, self.model_id, lambda messages: self._chat_prompt(messages, structured))
        except PymlError as e:  # a template's refusal: the request's fault
            raise RequestError(one_line(e)) from None
        if len(reqs) > self.limits.queue:  # each prompt waits for the model as a request of its own
            raise RequestError(f"'prompt' is a list of {len(reqs)} prompts; this server takes at most "
                               f"{self.limits.queue} a request (--max-queue)", "prompt")
        if reqs[0].n > self.limits.parallel:
            raise RequestError(f"'n'={reqs[0].n} completions run together and need --parallel {reqs[0].n} or more: "
                               f"this server runs {self.limits.parallel} at once", "n", code="unsupported_parameter")
        prepared = []
        for i, req in enumerate(reqs):
            try:
                prepared.append(self._prepare_one(req, structured, reqs[i - 1].constraint if i else None))
            except RequestError as e:
                if len(reqs) == 1:
                    raise
                raise RequestError(f"prompt[{i}]: {e.message}", e.param or "prompt", e.status, e.kind, e.code) from None
        return prepared

    def _prepare_one(self, req: Request, structured: Structured, compiled: Constraint | None) -> tuple[Request, list]:
        """One prompt's request, tokenized and checked against the context; `compiled` is the
        request's grammar if an earlier prompt of it compiled that."""
        try:
            self._check_chars(len(req.prompt))
            ids = self.lm.encode(req.prompt) if req.prompt_ids is None else check_prompt(self.lm.model, req.prompt_ids, 0)
            SamplingConfig(**req.sampling).check_vocab(self.lm.config.vocab_size)  # logit_bias's ids
            if req.echo and req.prompt_ids is not None:
                req.prompt = self.lm.decode(ids)
        except PymlError as e:  # the tokenizer's refusal: the request's fault
            raise RequestError(one_line(e)) from None
        req.structured = structured
        if compiled is not None:  # a matcher of its own, from the grammar's start
            req.constraint = compiled.fresh()
        elif structured.grammar is not None:
            try:
                req.constraint = Constraint(self.lm.tokenizer, structured.grammar, f"'{structured.param}'")
            except PymlError as e:
                raise RequestError(one_line(e), structured.param) from None
        check_context(len(ids), req.max_tokens, self.ctx_size)
        if req.max_tokens is None:
            req.max_tokens = min(self.limits.max_tokens, self.ctx_size - len(ids))
        return req, ids

    def _chat_prompt(self, messages, structured: Structured):
        self._check_chars(sum(len(m["content"]) for m in messages))  # before rendering
        tools = structured.tools if structured.calls_tools else None
        try:
            messages = template_messages(messages)
            prompt = self.lm.chat_prompt(messages, tools)
            if tools and prompt == self.lm.chat_prompt(messages):  # a template that does not render tools
                prompt = self.lm.chat_prompt(tool_prompt(messages, tools))
            return prompt
        except PymlError as e:  # the template refused the conversation (e.g. roles out of order)
            raise RequestError(one_line(e), "messages") from None

    def _check_chars(self, n_chars: int, what: str = "prompt"):
        if n_chars > self.max_prompt_chars:
            raise RequestError(f"the {what} is {n_chars:,} characters: more than the context size of "
                               f"{self.ctx_size} tokens can hold (at most {self.max_prompt_chars:,})",
                               code="context_length_exceeded")

    async def _http_error(self, request, exc: HTTPException):
        err = RequestError(exc.detail or "not found", status=exc.status_code)
        return JSONResponse(err.body(), status_code=exc.status_code)

    async def _internal_error(self, request, exc: Exception):
        err = RequestError(f"internal error: {type(exc).__name__}", status=500, kind="server_error")
        return JSONResponse(err.body(), status_code=500)


def _json_body(raw: bytes):
    try:
        return json.loads(raw)
    except RecursionError:
        raise RequestError("the body's JSON nests too deep") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None


def _refusal(e: RequestError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else None
    if e.status in (408, 413):  # the rest of the body is not worth reading: close, do not drain it
        headers = {"Connection": "close"}
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _piece(token: bytes) -> str | list[int]:
    """A token's piece as llama-server's /tokenize gives it: its text, or its bytes when they are
    not UTF-8 on their own (part of a character)."""
    try:
        return token.decode("utf-8")
    except UnicodeDecodeError:
        return list(token)


class _Answer:
    """One request's reply, whole or streamed, built from its job's events."""

    def __init__(self, server: Server, job: Job, chat: bool, arrived: float, http: HTTPRequest):
        self.server, self.job, self.chat, self.arrived, self.http = server, job, chat, arrived, http
        self.deadline = arrived + server.limits.timeout
        self.id = new_id(chat)
        self.created = int(time.time())
        self.first_token = None
        self.logprobs = Replies(server.lm.tokenizer, job.request, chat, job.ids)
        self.results: list | None = None  # its choices' GenerationResults, once done
        self.alone = True  # the request's one prompt: its reply carries the request's usage and timings
        self.base = 0  # its first choice's index in the request's (prompt p of several: p x n)

    async def events(self):
        """(kind, value) from the worker until "done" or "error". Running over --timeout ends in
        an "error" (504); a wait that ends otherwise (the client left) cancels the job."""
        m, finished = self.server.metrics, False
        loop = asyncio.get_running_loop()
        # one timer for the request's --timeout, an event behind the ones already queued: a wait_for
        # around every event cost the event loop a task and a timer a token, 16 a decode step at 16 clients
        timer = loop.call_at(loop.time() + max(0.0, self.deadline - time.perf_counter()),
                             self.job.events.put_nowait, ("timeout", None))
        try:
            while True:
                kind, value = await self.job.events.get()
                if kind == "timeout":
                    self.server.worker.cancel(self.job, "timeout")
                    kind, value = "error", RequestError(
                        f"the request ran over this server's --timeout of {self.server.limits.timeout:g} s",
                        status=504, kind="server_error", code="timeout")
                if kind == "gone":  # the client of a whole reply left (_watch_disconnect)
                    return
                if kind == "started":
                    m.queue_wait.observe(time.perf_counter() - self.arrived)
                    continue
                if kind == "text" and self.first_token is None:
                    self.first_token = time.perf_counter()
                    m.ttft.observe(self.first_token - self.arrived)
                if kind in ("done", "error"):
                    finished = True
                yield kind, value
                if finished:
                    return
        finally:
            timer.cancel()
            if not finished:  # the client left: free the model (or the job's place in the queue)
                self.server.worker.cancel(self.job, "client")

    def _final(self, results: list) -> dict:
        out = {"usage": usage(results), "timings": results[0].timings()}
        if self.job.profile is not None:
            out["pyml"] = {"profile": self.job.profile}
        return out

    def _choice(self, text: str | None, finish: str | None, delta: bool, index: int = 0, logprobs=None) -> dict:
        return choice(self.chat, text, finish, delta, index, logprobs)

    @property
    def _tools(self) -> Structured | None:
        """The request's tool offer when the reply may call one (chat only), else None."""
        structured = self.job.request.structured
        return structured if self.chat and structured is not None and structured.calls_tools else None

    def _ended(self, text: str, result: GenerationResult, index: int, logprobs=None) -> dict:
        """A whole reply's choice: its text, or the tool calls found in it (finish "tool_calls")."""
        if self._tools is not None:
            content, calls = reply_calls(self._tools, text, result.stop_reason == "eos")
            if calls:
                return {"index": index, "message": {"role": "assistant", "content": content or None,
                                                    "tool_calls": tool_call_objects(calls, streamed=False)},
                        "finish_reason": "tool_calls", "logprobs": logprobs}
        return self._choice(text, FINISH.get(result.stop_reason, "stop"), False, index, logprobs)

    def _held_delta(self, text: str, result: GenerationResult, index: int):
        """A streamed reply whose text was held (tool_choice auto or required): its tool calls as one
        delta, or its text; and the finish reason."""
        content, calls = reply_calls(self._tools, text, result.stop_reason == "eos")
        if calls:
            delta = {"content": content} if content else {}
            delta["tool_calls"] = tool_call_objects(calls, streamed=True)
            return {"index": index, "delta": delta, "finish_reason": None, "logprobs": None}, "tool_calls"
        return self._choice(text, None, True, index), FINISH.get(result.stop_reason, "stop")

    def _envelope(self, choices, delta: bool) -> dict:
        return envelope(self.chat, delta, self.id, self.created, self.server.model_id, choices)

    async def whole(self) -> Response:
        watcher = asyncio.create_task(_watch_disconnect(self.http, [self.job]))
        try:
            outcome = await self.collect()
        finally:
            watcher.cancel()
        if isinstance(outcome, RequestError):
            return JSONResponse(outcome.body(), status_code=outcome.status)
        if outcome is None:
            return Response(status_code=499)  # the client left: nobody reads this
        body = self._envelope(outcome, delta=False)
        body.update(self._final(self.results))
        return JSONResponse(body)

    async def collect(self):
        """The whole reply's choices (and `results` set), the error that ended it, or None if the
        client left."""
        pieces = [[] for _ in range(self.job.request.n)]
        # closed on the way out: a return mid-loop would leave events() suspended, its --timeout timer
        # (and the job it holds) alive until the generator is collected
        async with contextlib.aclosing(self.events()) as events:
            async for kind, value in events:
                if kind == "text":
                    pieces[value[0]].append(value[1])
                elif kind == "error":
                    return value
                elif kind == "done":
                    self.results = value
                    echo = self.job.request.prompt if self.job.request.echo else ""
                    return [self._ended(echo + "".join(p), r, i, self.logprobs.whole(r))
                            for i, (p, r) in enumerate(zip(pieces, value))]
        return None

    async def sse(self):
        async for chunk in self.chunks():
            yield _sse(chunk)
        yield "data: [DONE]\n\n"

    async def chunks(self):
        """The streamed reply's chunks (dicts), or an error's body (headers are sent by then). The
        last carries usage and timings unless `alone` is false (a prompt of several: _Answers)."""
        tools, n = self._tools, self.job.request.n
        named = tools is not None and tools.tool_choice == "function"  # its arguments stream as they come
        # auto: text streams until a call may begin; required: all is held (a call is told once whole)
        held = [HeldCalls(hold_all=tools.tool_choice == "required") for _ in range(n)] \
            if tools is not None and not named else None
        finish = {}  # choice -> its finish reason, where the text decides it
        if self.chat:
            def first():  # each choice's call has its own id
                return {"role": "assistant", "content": None, "tool_calls": [
                    {"index": 0, "id": call_id(), "type": "function",
                     "function": {"name": tools.tool_name, "arguments": ""}}]} if named else \
                    {"role": "assistant", "content": ""}
            yield self._envelope([{"index": i, "delta": first(), "finish_reason": None, "logprobs": None}
                                  for i in range(n)], delta=True)
        async for kind, value in self.events():
            if kind == "prompt":  # echo: the prompt is the choice's first text
                yield self._envelope([self._choice(self.job.request.prompt, None, True, value[0],
                                                   self.logprobs.prompt(*value))], delta=True)
            elif kind == "logprobs":
                self.logprobs.add(*value)
            elif kind == "text" and held is not None:
                if now := held[value[0]].push(value[1]):
                    yield self._envelope([self._choice(now, None, True, value[0], self.logprobs.take(value[0]))],
                                         delta=True)
            elif kind == "text" and named:
                delta = {"tool_calls": [{"index": 0, "function": {"arguments": value[1]}}]}
                yield self._envelope([{"index": value[0], "delta": delta, "finish_reason": None,
                                       "logprobs": self.logprobs.take(value[0])}], delta=True)
            elif kind == "text":
                yield self._envelope([self._choice(value[1], None, True, value[0], self.logprobs.take(value[0]))],
                                     delta=True)
            elif kind == "error":  # headers are sent: the error travels as an event, as OpenAI's does
                self.http.scope.setdefault("state", {})["pyml_status"] = str(value.status)  # for Guard's count
                yield value.body()
            elif kind == "done":
                for i, result in enumerate(value):
                    if held is not None:
                        rest = held[i].end()
                        if rest:
                            choice, finish[i] = self._held_delta(rest, result, i)
                            yield self._envelope([choice], delta=True)
                    elif named and result.stop_reason == "eos":
                        finish[i] = "tool_calls"
                for i in self.logprobs.waiting():  # tokens that added no text (the end token): their logprobs
                    yield self._envelope([self._choice("" if not self.chat else None, None, True, i,
                                                       self.logprobs.take(i))], delta=True)
                for i, result in enumerate(value[:-1]):  # every choice's end; the last one's carries usage
                    yield self._envelope([self._choice(None, self._finish(finish, i, result), True, i)],
                                         delta=True)
                last = self._envelope([self._choice(None, self._finish(finish, len(value) - 1, value[-1]), True,
                                                    len(value) - 1)], delta=True)
                self.results = value
                if self.alone:
                    last.update(self._final(value))
                    if not self.job.request.include_usage:
                        last["usage"] = None  # OpenAI sends usage in the stream only when asked
                yield last

    @staticmethod
    def _finish(decided: dict, index: int, result: GenerationResult) -> str:
        return decided.get(index) or FINISH.get(result.stop_reason, "stop")


class _Answers:
    """A completions request of several prompts (OpenAI's batched form): each prompt is a job of its
    own, and the reply is theirs merged. Prompt p's choice j is choice p x n + j, as OpenAI numbers
    them; usage sums the prompts', `timings` (and a profile) is a list, one per prompt. The first
    error ends the request and cancels the other prompts, as a client that leaves does."""

    def __init__(self, answers: list[_Answer]):
        self.answers, first = answers, answers[0]
        n = first.job.request.n
        for p, answer in enumerate(answers):
            answer.id, answer.created, answer.alone, answer.base = first.id, first.created, False, p * n

    def _final(self) -> dict:
        results = [a.results for a in self.answers]
        out = {"usage": usage(*results), "timings": [r[0].timings() for r in results]}
        if self.answers[0].job.request.profile:
            out["pyml"] = {"profile": [a.job.profile for a in self.answers]}
        return out

    async def whole(self) -> Response:
        watcher = asyncio.create_task(_watch_disconnect(self.answers[0].http, [a.job for a in self.answers]))
        tasks = [asyncio.create_task(a.collect()) for a in self.answers]
        try:
            for done in asyncio.as_completed(tasks):
                outcome = await done
                if isinstance(outcome, RequestError):
                    return JSONResponse(outcome.body(), status_code=outcome.status)
                if outcome is None:
                    return Response(status_code=499)  # the client left: nobody reads this
        finally:
            watcher.cancel()
            for task in tasks:  # after an error: the other prompts' jobs are cancelled (events' finally)
                task.cancel()
        choices = [_shifted(c, a.base) for a, task in zip(self.answers, tasks) for c in task.result()]
        body = self.answers[0]._envelope(choices, delta=False)
        body.update(self._final())
        return JSONResponse(body)

    async def sse(self):
        """The prompts' chunks as they come, interleaved; then one chunk without choices that carries
        the usage (OpenAI's form with include_usage) and the timings."""
        chunks: asyncio.Queue = asyncio.Queue()

        async def pump(answer: _Answer):
            async for chunk in answer.chunks():
                await chunks.put(chunk if "error" in chunk else _shifted(chunk, answer.base))
            await chunks.put(None)

        tasks = [asyncio.create_task(pump(a)) for a in self.answers]
        try:
            running = len(tasks)
            while running:
                chunk = await chunks.get()
                if chunk is None:
                    running -= 1
                    continue
                yield _sse(chunk)
                if "error" in chunk:
                    break
            else:
                last = self.answers[0]._envelope([], delta=True)
                last.update(self._final())
                if not self.answers[0].job.request.include_usage:
                    last["usage"] = None
                yield _sse(last)
        finally:
            for task in tasks:  # the client left, or a prompt failed: the other prompts are cancelled
                task.cancel()
        yield "data: [DONE]\n\n"


def _shifted(obj: dict, base: int) -> dict:
    """`obj` (a choice, or a chunk of choices) numbered from `base`."""
    if "choices" in obj:
        obj["choices"] = [_shifted(c, base) for c in obj["choices"]]
    elif base:
        obj["index"] += base
    return obj


async def _watch_disconnect(http: HTTPRequest, jobs: list[Job]):
    """Wait for the client of a whole reply to leave (the body is read: what comes next is the
    disconnect), and wake its jobs' `events` then. A stream has Starlette's own watcher."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    for job in jobs:
        job.events.put_nowait(("gone", None))


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
