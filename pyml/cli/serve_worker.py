"""pyml-serve's model side: the one thread that runs the model, the bounded queue in front of it,
and the metrics both sides count.

One worker thread owns the model and runs one generation at a time, taking jobs from a FIFO
queue (fair: first come, first served) of at most `max_queue` waiting jobs; a full queue refuses
the next (the HTTP side answers 503 + Retry-After). A job whose client leaves, or whose time runs
out, is cancelled: taken out of the queue at once if it waits, or ended by the generation's
`cancelled()` check before its next decode step if it runs. Shutting down closes the queue,
answers every waiting job 503 and cancels the running one.

Numba's thread count is per thread: the worker sets `threads` in its own thread before it runs
anything, and reports the count Numba then says it uses (`threads_in_use`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
from dataclasses import dataclass, field

import numba
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pyml.cli.main import one_line
from pyml.cli.request_profile import batched_profile, profile_summary, recording
from pyml.cli.serve_requests import Request, RequestError
from pyml.core import perf
from pyml.core.errors import PymlError
from pyml.nlp.api import LanguageModel, TextOut
from pyml.nlp.batch_generator import BatchGenerator
from pyml.nlp.generator import GenerationResult, StopStrings
from pyml.nlp.sampling import SamplingConfig

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_perf = perf.get("pyml.cli.serve")
SHUTTING_DOWN = "the server is shutting down"


def shutting_down() -> RequestError:
    return RequestError(SHUTTING_DOWN, status=503, kind="server_error", code="shutting_down")


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("pyml_requests", "requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("pyml_prompt_tokens", "prompt tokens processed (prefilled)", registry=r)
        self.cached_tokens = Counter("pyml_cached_prompt_tokens", "prompt tokens reused from the KV cache",
                                     registry=r)
        self.generated_tokens = Counter("pyml_generated_tokens", "tokens generated", registry=r)
        self.cancelled = Counter("pyml_cancelled", "generations ended early", ["reason"], registry=r)
        self.queue = Gauge("pyml_queue_length", "requests waiting for the model", registry=r)
        self.busy = Gauge("pyml_busy", "1 while a generation runs", registry=r)
        self.running = Gauge("pyml_running_sequences", "sequences generating now (at most --parallel)",
                             registry=r)
        self.decode_tok_s = Gauge("pyml_decode_tokens_per_second", "decode speed of the last request",
                                  registry=r)
        self.latency = Histogram("pyml_request_seconds", "completion request latency, arrival to the last "
                                 "byte sent, whatever the answer", buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("pyml_queue_wait_seconds", "time waiting for the model",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("pyml_time_to_first_token_seconds", "arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        # speculative decoding (pyml-serve --lookup-ngram / --draft-model): llama-server's counters
        self.drafted = Counter("pyml_draft_tokens", "tokens drafted by speculative decoding", registry=r)
        self.accepted = Counter("pyml_draft_tokens_accepted", "drafted tokens the model kept", registry=r)


@dataclass
class Job:
    """One request's work: the worker pushes (kind, value) events onto `events`, read by the
    request's task on the event loop. `cancelled` is set by the event loop (client gone, time out)
    or by shutdown, and read by the worker before each decode step."""
    request: Request
    ids: list
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: str | None = None  # None, or why: "client", "timeout", "shutdown"
    profile: dict | None = None

    def put(self, kind: str, value=None):
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


def send_logprobs(job: Job, index: int, result: GenerationResult, sent: int) -> int:
    """Hand the request choice `index`'s log-probabilities made since `sent`; how many are sent now.
    Sent before the text their tokens made, so a stream's chunk carries its own tokens'."""
    if result.logprobs is not None and len(result.logprobs) > sent:
        job.put("logprobs", (index, result.logprobs[sent:]))
        return len(result.logprobs)
    return sent


class QueueFull(Exception):
    pass


class JobQueue:
    """FIFO of waiting jobs, at most `limit` beyond what the worker's free slots take at its next
    step (a burst those slots take is not refused for passing through here first); a cancelled job
    leaves it at once. `slots_of(job)`: the slots a job takes (a request's n)."""

    def __init__(self, limit: int, slots_of=lambda job: 1):
        self.limit, self.slots_of = limit, slots_of
        self.free_slots = 0  # set by the worker; a job taken uses its slots up at once (_take)
        self._jobs: collections.deque = collections.deque()
        self._ready = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        return len(self._jobs)

    def _waiting(self, more=()) -> int:
        """How many of the queued jobs, then `more`, the free slots will not take (the worker takes
        jobs while a slot is free: a job of n choices beside one free slot is taken)."""
        room, waiting = self.free_slots, 0
        for job in itertools.chain(self._jobs, more):
            if room > 0:
                room -= self.slots_of(job)
            else:
                waiting += 1
        return waiting

    def put(self, *jobs: Job) -> None:
        """Queue `jobs` (a request's prompts: all of them or none), in order."""
        with self._ready:
            if self._closed:
                raise QueueFull(SHUTTING_DOWN)
            if self._waiting(jobs) > self.limit:
                more = f" (and this request's {len(jobs)} prompts would take {len(jobs)})" if len(jobs) > 1 else ""
                raise QueueFull(f"{self._waiting()} requests are waiting for the model{more}, the most this "
                                f"server queues (--max-queue {self.limit})")
            self._jobs.extend(jobs)
            self._ready.notify()

    def get_nowait(self) -> Job | None:
        """The next job if one waits, else None (a running batch does not wait for one)."""
        with self._ready:
            return self._take() if self._jobs else None

    def get(self) -> Job | None:
        """The next job, waiting for one; None once the queue is closed."""
        with self._ready:
            while not self._jobs and not self._closed:
                self._ready.wait()
            return self._take() if self._jobs else None

    def _take(self) -> Job:
        job = self._jobs.popleft()
        self.free_slots = max(0, self.free_slots - self.slots_of(job))  # with the pop: put never counts a slot twice
        return job

    def set_free_slots(self, n: int) -> None:
        with self._ready:
            self.free_slots = max(0, n)

    def remove(self, job: Job) -> bool:
        """Take `job` out of the queue; whether it was waiting there."""
        with self._ready:
            try:
                self._jobs.remove(job)
                return True
            except ValueError:  # already taken by the worker, or never queued
                return False

    def close(self) -> list[Job]:
        """Refuse new jobs; the jobs that were waiting, now out of the queue."""
        with self._ready:
            self._closed = True
            drained = list(self._jobs)
            self._jobs.clear()
            self._ready.notify_all()
            return drained


class Worker:
    """The one thread that runs the model, one job at a time, in arrival order."""

    def __init__(self, lm: LanguageModel, ctx_size: int, metrics: Metrics, threads: int, max_queue: int,
                 speculative=None):
        self.lm, self.metrics, self.threads = lm, metrics, threads
        self.speculative = speculative  # a SpeculativeConfig server-wide, or None
        self.cache = lm.new_prompt_cache(ctx_size)
        self.jobs = JobQueue(max_queue, lambda job: job.request.n)
        self.current: Job | None = None
        self.threads_in_use: int | None = None
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="pyml-serve-model", daemon=True)

    @property
    def running(self) -> int:
        """The sequences generating now: /health's `running` (this worker's one at a time)."""
        return int(self.current is not None)

    def start(self) -> None:
        """Start the thread (once) and wait until it has set its thread count and warmed up (on a
        first run the kernels compile: a minute, with a progress bar)."""
        if not self.thread.is_alive() and not self._started.is_set():
            self.thread.start()
        self._started.wait()

    def stop(self, timeout: float = 3.0) -> None:
        """Answer the waiting jobs 503, cancel the running one, and let the thread end."""
        for job in self.jobs.close():
            self.metrics.cancelled.labels("shutdown").inc()
            job.put("error", shutting_down())
        if (job := self.current) is not None:
            job.cancelled = job.cancelled or "shutdown"
        self.metrics.queue.set(0)
        if self.thread.is_alive():
            self.thread.join(timeout=timeout)

    def submit(self, *jobs: Job) -> None:
        """Queue `jobs` (all or none); QueueFull if the queue has no room for them or is closed."""
        self.jobs.put(*jobs)
        self.metrics.queue.set(len(self.jobs))

    def cancel(self, job: Job, reason: str) -> None:
        """Stop `job`: out of the queue if it waits, at the next decode step if it runs."""
        if job.cancelled is None:
            job.cancelled = reason
        if self.jobs.remove(job):  # it never ran: counted here, a running job where it ends (_finish)
            self.metrics.cancelled.labels(job.cancelled).inc()
        self.metrics.queue.set(len(self.jobs))

    def _skipped(self, job: Job) -> bool:
        """Whether a job just taken from the queue was cancelled while the worker took it (counted)."""
        if job.cancelled:
            self.metrics.cancelled.labels(job.cancelled).inc()
        return bool(job.cancelled)

    def _loop(self):
        numba.set_num_threads(self.threads)  # per thread: the main thread's setting does not reach here
        self.threads_in_use = numba.get_num_threads()
        try:  # the prefill's kernels now, not inside the first request (on a first run they compile)
            self.lm.warm_up(prefill=True)
        except Exception as e:  # the first request warms them again, and answers what goes wrong
            _perf.logger.warning("pyml-serve: warming the prefill kernels failed: %s", one_line(e))
        self._started.set()
        while True:
            self.jobs.set_free_slots(1)  # idle: the next job is taken at once
            if (job := self.jobs.get()) is None:
                break
            self.metrics.queue.set(len(self.jobs))
            if self._skipped(job):
                continue
            self.current = job
            self.metrics.busy.set(1)
            self.metrics.running.set(1)
            try:
                self._run(job)
            except PymlError as e:  # bad input the model side found: the request's fault, one line
                job.put("error", RequestError(one_line(e)))
            except Exception as e:  # the server keeps answering; the client learns what happened
                job.put("error", RequestError(f"internal error: {type(e).__name__}: {e}", status=500,
                                              kind="server_error"))
            finally:
                self.current = None
                self.metrics.busy.set(0)
                self.metrics.running.set(0)

    def _run(self, job: Job):
        req = job.request
        if not req.cache_prompt:
            self.cache.reset()
        result = GenerationResult(job.ids)
        records = []
        # a request speculation cannot serve (a grammar, logprobs: Generator.stream refuses them with it)
        # runs plainly: the server's speculation is its own speed, never a request's error
        plain = req.constraint is not None or req.logprobs is not None
        speculative = {} if self.speculative is None or plain else {"speculative": self.speculative}
        with recording(records, req.profile):
            stream = self.lm.stream(job.ids, req.max_tokens, stop=req.stop, cache=self.cache, result=result,
                                    cancelled=lambda: job.cancelled is not None, constraint=req.constraint,
                                    logprobs=req.logprobs, echo=req.echo and req.logprobs is not None,
                                    **req.sampling, **speculative)
            job.put("started")
            sent, first = 0, True  # the result's logprobs sent so far
            for event in stream:
                if job.cancelled:
                    stream.close()  # frees the model now: the next job starts before the next step
                    result.stop_reason = "cancelled"
                    break
                if first and req.echo:  # the prefill is done: the prompt (and its logprobs) first
                    job.put("prompt", (0, result.prompt_logprobs))
                first = False
                sent = send_logprobs(job, 0, result, sent)
                if event.text:
                    job.put("text", (0, event.text))
        if req.profile:
            job.profile = profile_summary(records)
        self._finish(job, [result])

    def _finish(self, job: Job, results: list) -> None:
        """Count a job's figures and hand the request its choices' results (or, at shutdown, a 503)."""
        m, result = self.metrics, results[0]
        m.prompt_tokens.inc(result.prefilled_tokens)
        m.cached_tokens.inc(result.cached_tokens)
        m.generated_tokens.inc(sum(len(r.tokens) for r in results))
        m.drafted.inc(sum(r.drafted for r in results))
        m.accepted.inc(sum(r.accepted for r in results))
        if result.decode_s:
            m.decode_tok_s.set(result.decode_tok_s)
        if job.cancelled:
            m.cancelled.labels(job.cancelled).inc()
        if job.cancelled == "shutdown":
            job.put("error", shutting_down())
        else:
            job.put("done", results)


class BatchWorker(Worker):
    """pyml-serve --parallel N: the one model thread runs up to N generations at once, one
    BatchGenerator step (a batched forward) at a time. A waiting job joins the running batch at the
    next step when a slot is free, its prompt prefilled in chunks beside the running decodes; a job
    whose client leaves or whose time runs out is cancelled there and its slot freed."""

    def __init__(self, lm: LanguageModel, ctx_size: int, metrics: Metrics, threads: int, max_queue: int,
                 parallel: int, speculative=None):
        super().__init__(lm, ctx_size, metrics, threads, max_queue, speculative)
        self.parallel, self.ctx_size = parallel, ctx_size
        self.active: dict = {}  # Request -> (Job, TextOut, choice index)
        self.choices: dict = {}  # id(Job) -> [results], None where a choice still runs
        self.sent: dict = {}  # Request -> its result's logprobs sent so far
        self.profiles: dict = {}  # id(Job) -> (perf records, step shares) while a profiled job runs
        self.echoes: set = set()  # echo requests whose prompt has not been sent (it goes after their prefill)

    def stop(self, timeout: float = 3.0) -> None:
        for job, _, _ in list(self.active.values()):
            job.cancelled = job.cancelled or "shutdown"
        super().stop(timeout)

    def _loop(self):
        numba.set_num_threads(self.threads)
        self.threads_in_use = numba.get_num_threads()
        try:  # the prefill's kernels and the batched steps' (a first 16-row step once loaded them: 0.3 s)
            self.lm.warm_batch(self.parallel)
        except Exception as e:
            _perf.logger.warning("pyml-serve: warming the prefill's and batched steps' kernels failed: %s",
                                 one_line(e))
        gen = BatchGenerator(self.lm.model, self.parallel, self.ctx_size, speculative=self.speculative)
        self.jobs.set_free_slots(self.parallel)
        self._started.set()
        while True:
            # idle: wait for work; busy: take a job only into a free slot, so that the rest wait in the
            # bounded queue (--max-queue, its 503s), not in the generator's
            job = (self.jobs.get_nowait() if self._free() else None) if self.active else self.jobs.get()
            if job is None and not self.active:
                break  # the queue is closed
            while job is not None:
                self._admit(gen, job)
                job = self.jobs.get_nowait() if self._free() else None
            self.metrics.queue.set(len(self.jobs))
            self._note_busy()
            if not self.active:
                continue
            try:
                self._step(gen)
            except Exception as e:  # every running request learns what happened; the server goes on
                error = RequestError(one_line(e)) if isinstance(e, PymlError) else RequestError(
                    f"internal error: {type(e).__name__}: {e}", status=500, kind="server_error")
                for request, (job, _, _) in list(self.active.items()):
                    request.cancel()
                    if self.choices.pop(id(job), None) is not None:
                        job.put("error", error)
                self.active.clear()
                self.sent.clear()
                self.profiles.clear()
                self.echoes.clear()
                gen = BatchGenerator(self.lm.model, self.parallel, self.ctx_size, speculative=self.speculative)
            self._note_busy()  # before waiting for the next job: /health says idle while the model is
        self.current = None
        self.metrics.busy.set(0)
        self.metrics.running.set(0)

    def _free_slots(self) -> int:
        """The slots free: counted by the sequences admitted (a job of n choices waits in the
        generator as one group until n slots are free, so the generator's lists count it once)."""
        return self.parallel - len(self.active)

    def _free(self) -> bool:
        return self._free_slots() > 0

    @property
    def running(self) -> int:
        return len(self.active)

    def _note_busy(self) -> None:
        """/health's `busy` and `running`, pyml_busy and pyml_running_sequences: whether a generation
        runs (a job of the running batch), and how many sequences the batch holds."""
        self.current = next(iter(self.active.values()))[0] if self.active else None
        self.metrics.busy.set(int(bool(self.active)))
        self.metrics.running.set(len(self.active))
        self.jobs.set_free_slots(self._free_slots())

    def _admit(self, gen: BatchGenerator, job: Job) -> None:
        if self._skipped(job):
            return
        req = job.request
        try:
            requests = gen.submit_choices(job.ids, req.max_tokens, req.n, SamplingConfig(**req.sampling),
                                          stop_ids=self.lm.tokenizer.eos_ids if self.lm.tokenizer is not None else (),
                                          reuse=req.cache_prompt, constraint=req.constraint, logprobs=req.logprobs,
                                          echo=req.echo and req.logprobs is not None)
        except PymlError as e:
            job.put("error", RequestError(one_line(e)))
            return
        self.choices[id(job)] = [None] * len(requests)
        if req.profile:
            self.profiles[id(job)] = ([], {})  # the perf records of its steps; step -> (its rows, rows, sequences)
        for i, request in enumerate(requests):
            self.active[request] = (job, TextOut(self.lm.tokenizer, request.result, request.stop_ids,
                                                 StopStrings(req.stop)), i)
        job.put("started")
        if req.echo:  # the prompt goes first, once its prefill (which scores it) is done
            self.echoes.update(requests)
        for request in requests:
            if request.done:  # max_tokens 0
                self._end(request)

    def _step(self, gen: BatchGenerator) -> None:
        for request, (job, _, _) in self.active.items():
            if job.cancelled:
                request.cancel()
        # a profiled job's records: the steps where its sequences decode (as alone, its decode steps)
        profiled = self.active.items() if self.profiles else ()  # nothing to look at on most steps
        decoding = collections.Counter(id(job) for request, (job, _, _) in profiled
                                       if id(job) in self.profiles and request in gen.running
                                       and request.fed >= len(request.prompt))
        records = []
        with recording(records, bool(self.profiles)):  # trace-level records only while a job asks for them
            chosen = gen.step()
        for job_id, own in decoding.items():
            self.profiles[job_id][0].extend(records)
            self.profiles[job_id][1][gen.steps] = (own, *gen.last_shape)
        for request, token in chosen:
            if request not in self.active:  # a speculative step chose tokens past its stop string
                continue
            job, text_out, index = self.active[request]
            self._send_prompt(request)
            text = text_out.push(token)
            self.sent[request] = send_logprobs(job, index, request.result, self.sent.get(request, 0))
            if text:
                job.put("text", (index, text))
            if text_out.stopped:
                request.cancel()  # its slot is freed at the next step; the reason stays "stop"
                self._end(request)
        for request in [r for r in self.active if r.done]:
            self._end(request)

    def _send_prompt(self, request) -> None:
        if request in self.echoes:
            self.echoes.discard(request)
            job, _, index = self.active[request]
            job.put("prompt", (index, request.result.prompt_logprobs))

    def _end(self, request) -> None:
        """One choice has ended; the job's answer goes once all its choices have."""
        self._send_prompt(request)
        job, text_out, index = self.active.pop(request)
        self.sent.pop(request, None)
        if not text_out.stopped and not job.cancelled:
            text = text_out.end()
            if text:
                job.put("text", (index, text))
        text_out.close()
        if job.cancelled:
            request.result.stop_reason = "cancelled"
        results = self.choices[id(job)]
        results[index] = request.result
        if all(r is not None for r in results):
            del self.choices[id(job)]
            if id(job) in self.profiles:
                job.profile = batched_profile(*self.profiles.pop(id(job)))
            self._finish(job, results)
