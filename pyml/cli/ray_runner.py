"""pyml on Ray: connecting, the batch workers and their scheduler, and one-off tasks (the sweep).

Local by default (`ray.init()` starts an instance on this machine), a cluster when `--address` or
RAY_ADDRESS names one. What reaches a worker: the job (a prompt and its options, or a sweep
point), the model's name or path (each worker loads the model itself, so every node must be
able to read the path, or resolve the hub id), and the environment variables in WORKER_ENV
(NUMBA_CACHE_DIR above all: a worker that finds the compiled kernels loads them instead of
compiling them). pyml itself must be installed on every node (docs/scaling.md).

This module is imported only when --ray is given: `import ray` costs ~1.0 s on this machine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections import deque

from pyml.cli.batch_jobs import Job, job_error, run_job, run_jobs_batched
from pyml.cli.request_profile import recording
from pyml.core import perf
from pyml.core.errors import PymlError
from pyml.nlp.api import load_model
from pyml.report.capture import model_info
from pyml.report.records import normalize

try:
    import ray
    from ray.exceptions import RayActorError, RayTaskError
except ImportError:  # the `ray` extra is not installed: --ray says so in one line
    ray = None

RAY_MISSING = 'Ray is not installed: pip install "pyml[ray]" (or pip install ray) to use --ray'
WORKER_ENV = ("NUMBA_CACHE_DIR", "PYML_LOG", "LOG", "PYML_ISA", "PYML_HOME", "HF_HOME", "HF_HUB_OFFLINE")
IN_FLIGHT = 2       # calls queued on each worker, so it never waits for the driver between two
UNIT_STEPS = 4      # --batch B: jobs per call to a worker, in multiples of B
MAX_ATTEMPTS = 3    # a prompt whose worker died this many times is reported, not retried again


def connect(address: str | None = None) -> bool:
    """Start or join a Ray instance; True when this call started it (the caller shuts it down)."""
    if ray is None:
        raise PymlError(RAY_MISSING)
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    _check_reachable(address)
    try:
        ray.init(address=address, include_dashboard=False, logging_level=logging.ERROR,
                 log_to_driver=False, configure_logging=True)
    except ConnectionError as e:
        raise PymlError(f"cannot reach the Ray cluster at {address}: {e}") from None
    return True


def _check_reachable(address: str | None, timeout_s: float = 5.0) -> None:
    """A HOST:PORT that nothing answers on is one line now: ray.init would retry it for minutes."""
    host, sep, port = (address or "").rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # a local instance, "auto", or a ray:// client address: Ray's own checks apply
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise PymlError(f"cannot reach the Ray cluster at {address}: {e.strerror or e} (is `ray start --head` "
                        f"running there?)") from None


def disconnect(started: bool) -> None:
    if started and ray is not None and ray.is_initialized():
        ray.shutdown()


@contextlib.contextmanager
def session(address: str | None = None):
    """Ray, connected for the block: a local instance started here is shut down at its end."""
    started = connect(address)
    try:
        yield
    finally:
        disconnect(started)


def worker_env() -> dict:
    return {k: os.environ[k] for k in WORKER_ENV if k in os.environ}


def cluster_cpus() -> int:
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def node_cpus() -> int:
    """The CPUs of the largest node: more than that, no task or worker can be given."""
    return max([int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n.get("Alive")] + [1])


def default_threads(workers: int) -> int:
    """Cores per worker: the cluster's CPUs shared out, at least one each, at most a node's."""
    return max(1, min(node_cpus(), cluster_cpus() // workers))


def cause(e: Exception) -> Exception:
    """The worker's own exception inside a RayTaskError (a PymlError keeps its one line)."""
    inner = getattr(e, "cause", None)
    return inner if isinstance(inner, Exception) else e


def wall_offset() -> float:
    """time.time() - perf.clock() in this process: shifts a worker's span starts onto the driver's clock."""
    return time.time() - perf.clock()


# --- the batch worker -------------------------------------------------------------------------------

class BatchWorker:
    """A Ray actor: loads the model once, then runs jobs; with `profile`, ships each job's perf records."""

    def __init__(self, load_options: dict, profile: bool):
        self.load_options, self.profile = load_options, profile
        self.lm = None
        self.threads: dict = {}   # thread ident -> track number, kept across jobs

    def load(self) -> dict:
        raws = []
        with recording(raws, self.profile):
            self.lm = load_model(**self.load_options)
        info = {"node": socket.gethostname(), "pid": os.getpid(), "threads": self.lm.runtime.threads,
                "load_s": self.lm.load_s, "clock": wall_offset(), "records": self._ship(raws)}
        if self.profile:
            info["model"] = model_info(self.lm)
        return info

    def run(self, job: Job) -> dict:
        raws = []
        with recording(raws, self.profile):
            out = run_job(self.lm, job)
        return {"out": out, "records": self._ship(raws), "clock": wall_offset()}

    def run_batch(self, jobs: list, batch: int) -> dict:
        """Jobs `batch` sequences a step (pyml-batch --batch on this worker): their output lines in
        the order given."""
        raws = []
        with recording(raws, self.profile):
            outs = {job.line: out for job, out in run_jobs_batched(self.lm, jobs, batch)}
        return {"outs": [outs[job.line] for job in jobs], "records": self._ship(raws), "clock": wall_offset()}

    def _ship(self, raws) -> list:
        """The records as events.jsonl lines (this worker's thread numbering)."""
        if not raws:
            return []
        recs, _ = normalize(raws, main_thread=threading.get_ident(), threads=self.threads)
        return [r.to_json() for r in recs]


class WorkerPool:
    """`workers` BatchWorker actors, fed longest prompts first, IN_FLIGHT at a time each.

    A worker that dies (its process killed, its node lost) is dropped and the jobs it held go back
    to the front of the queue for the others; a job that has seen MAX_ATTEMPTS workers die under
    it becomes an error line.
    """

    def __init__(self, workers: int, threads: int, load_options: dict, profile: bool = False, batch: int = 1):
        if workers < 1:
            raise PymlError(f"--workers must be at least 1, got {workers}")
        cpus = min(float(threads), cluster_cpus() / workers, node_cpus())
        actor = ray.remote(BatchWorker).options(num_cpus=cpus, max_restarts=0,
                                                runtime_env={"env_vars": worker_env()})
        self.actors = [actor.remote(dict(load_options, threads=threads), profile) for _ in range(workers)]
        self.done = [0] * workers   # jobs finished per worker
        self.infos: list[dict] = []
        # --batch B: a call takes UNIT_STEPS x B jobs, so that slots freed by short replies refill from
        # the same call and the batch stays full until the call's last few
        self.batch, self.unit = batch, 1 if batch == 1 else UNIT_STEPS * batch

    def start(self) -> list[dict]:
        """Load the model on every worker; their descriptions (node, pid, threads, load time)."""
        try:
            self.infos = ray.get([a.load.remote() for a in self.actors])
        except RayTaskError as e:
            raise cause(e) from None
        except RayActorError as e:
            raise PymlError(f"a Ray worker died while loading the model: {e}") from None
        return self.infos

    def run(self, jobs: list[Job]):
        """Yield (worker index, job, reply) as jobs complete; reply["out"] is the job's output line."""
        queue = deque(sorted(jobs, key=lambda j: -j.size))
        alive = list(range(len(self.actors)))
        held = {w: 0 for w in alive}
        in_flight: dict = {}
        attempts: dict[int, int] = {}

        def feed():  # the next unit to the worker holding the fewest, so a short batch is shared too
            while queue and alive:
                w = min(alive, key=held.get)
                if held[w] >= IN_FLIGHT:
                    return
                unit = [queue.popleft() for _ in range(min(self.unit, len(queue)))]
                actor = self.actors[w]
                ref = actor.run.remote(unit[0]) if self.batch == 1 else actor.run_batch.remote(unit, self.batch)
                in_flight[ref] = (w, unit)
                held[w] += 1

        feed()
        while in_flight:
            (ref,), _ = ray.wait(list(in_flight), num_returns=1)
            w, unit = in_flight.pop(ref)
            held[w] -= 1
            try:
                reply = ray.get(ref)
                replies = ([reply] if self.batch == 1 else
                           [dict(reply, out=out) if i == 0 else {"out": out} for i, out in enumerate(reply["outs"])])
            except RayActorError as e:
                if w in alive:
                    alive.remove(w)
                replies, again = [], []
                for job in unit:
                    attempts[job.line] = attempts.get(job.line, 0) + 1
                    if attempts[job.line] < MAX_ATTEMPTS or not alive:
                        again.append(job)  # with no worker left, it is counted among those not run
                    else:
                        replies.append({"out": job_error(job, f"the Ray worker died running this prompt "
                                                              f"({attempts[job.line]} times): {_first_line(e)}", 500)})
                queue.extendleft(reversed(again))
                unit = [job for job in unit if job not in again]
            except RayTaskError as e:  # run_job turns every failure into a line: this is Ray's own
                replies = [{"out": job_error(job, f"Ray: {_first_line(cause(e))}", 500)} for job in unit]
            for job, reply in zip(unit, replies):
                self.done[w] += 1
                self._received(w, reply)
                yield w, job, reply
            feed()
        if queue:
            raise PymlError(f"every Ray worker died; {len(queue)} prompts were not run (rerun with the same "
                            f"--out to finish them)")

    def _received(self, worker: int, reply: dict) -> None:
        """Called as each reply arrives, before it is yielded."""

    def close(self) -> None:
        for a in self.actors:
            ray.kill(a)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.split("\n", 1)[0] if text else type(e).__name__


# --- one-off tasks ---------------------------------------------------------------------------------

def run_tasks(fn, args_list: list, threads: int):
    """Yield (index, result) as `fn(*args)` completes for each args in args_list, one Ray task each."""
    task = ray.remote(fn).options(num_cpus=min(threads, node_cpus()), max_retries=1,
                                  runtime_env={"env_vars": worker_env()})
    refs = {task.remote(*args): i for i, args in enumerate(args_list)}
    while refs:
        (ref,), _ = ray.wait(list(refs), num_returns=1)
        i = refs.pop(ref)
        try:
            yield i, ray.get(ref)
        except RayTaskError as e:
            raise cause(e) from None
