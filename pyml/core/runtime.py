"""Runtime configuration: thread count and warm-up.

Numba's thread pool and the BLAS under NumPy each start their threads lazily on
first use, and every jitted kernel compiles (or loads from its on-disk cache) on
its first call. Left alone, all of that lands inside the first measured prefill
or decode step; `warmup_thread_pool()` moves it before the clock starts.
"""

from __future__ import annotations

import ctypes
import os
import threading
from contextlib import nullcontext
from dataclasses import dataclass, field

import numba
import numpy as np
from threadpoolctl import threadpool_limits

from pyml.core import isa, numba_runtime, ops, perf, progress
from pyml.core.errors import PymlError

_perf = perf.get("pyml.core.runtime")
numba_runtime.install()  # before any kernel loads: Numba's runtime module from a file (numba_runtime.py)


_LAUNCH_LOCK = threading.Lock()
_warned: list = []  # the PYML_ISA warning is said once per process
_warned_threads: set = set()  # thread counts past the pool's size already said
_layer = None  # Numba's threading layer, once a parallel kernel has chosen it


def kernel_lock():
    """What to hold around a forward pass: a process-wide lock when Numba's thread pool cannot
    take parallel launches from two threads at once (its fallback 'workqueue' layer aborts the
    process), else a no-op. 'omp' and 'tbb' are thread-safe: generations on several threads
    then run concurrently; under 'workqueue' they take turns, one forward pass at a time."""
    global _layer
    if _layer is None:
        try:
            _layer = numba.threading_layer()
        except ValueError:  # no parallel kernel has run yet: the lock is the safe answer
            return _LAUNCH_LOCK
    return _LAUNCH_LOCK if _layer == "workqueue" else nullcontext()


def return_free_heap() -> int:
    """Give the C heap's free pages back to the system (glibc's malloc_trim); bytes of RSS returned.

    Building a tokenizer from a GGUF's metadata makes and drops millions of small objects (Gemma
    3: 262,144 token strings, 513,511 merge pairs, in Python and in `tokenizers`' Rust): freed,
    they stayed in the process's heap, 84 MB of its RSS for the life of the process."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to ask
        return 0
    before = _rss()
    libc.malloc_trim(0)
    return max(0, before - _rss())


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass
class RuntimeConfig:
    threads: int = field(default_factory=cpu_count)
    warmup: bool = True
    blas_threads: int | None = None  # set by apply(), lowered by set_blas_threads()

    def __post_init__(self):
        if self.threads < 1:
            raise PymlError(f"--threads must be at least 1, got {self.threads}")
        # Numba's pool has NUMBA_NUM_THREADS threads (the machine's CPUs unless set) for the process's life
        self.asked = self.threads
        self.threads = min(self.threads, numba.config.NUMBA_NUM_THREADS)

    def apply(self) -> "RuntimeConfig":
        """Set the thread count for Numba kernels and for NumPy's BLAS (and say once if PYML_ISA
        asked for an instruction set this CPU cannot run)."""
        if isa.ISA_WARNING and not _warned:
            _warned.append(True)
            _perf.logger.warning("%s", isa.ISA_WARNING)
        if self.asked > self.threads and self.asked not in _warned_threads:
            _warned_threads.add(self.asked)
            _perf.logger.warning("--threads %d: this process can run at most %d kernel threads "
                                 "(NUMBA_NUM_THREADS); using %d", self.asked, self.threads, self.threads)
        numba.set_num_threads(self.threads)
        self.set_blas_threads(self.threads)
        return self

    def set_blas_threads(self, n: int) -> None:
        """BLAS threads, separately from Numba's: a loaded model keeps BLAS to the calling thread
        (docs/performance.md, "No BLAS in a forward pass")."""
        self.blas_threads = n
        threadpool_limits(n)

    def warmup_thread_pool(self, steps=()):
        """Start the thread pools and run jitted kernels once on tiny inputs.

        `steps` are callables from the layers above (pyml.quant's kernels, a model's own warm-up
        forward pass): they warm what they call. Without steps, every core op is warmed; with them,
        none beyond what the steps use (each kernel loaded from Numba's cache costs resident
        memory, 0.1-2 MB, and time: a model never calls LayerNorm's or the other activations').
        On a first run, when the kernels compile rather than load from Numba's disk cache (about
        a minute), a progress bar says so.
        """
        with _perf.debug("runtime::warmup", "threads={} isa={}", self.threads, isa.ISA), \
                progress.bar(total=1 + len(steps), desc="pyml: warm-up (compiles kernels on a first run)",
                             unit="step", delay=2.0) as bar:
            if not steps:
                ops.warmup()
            a = np.ones((64, 64), np.float32)
            a @ a  # starts the BLAS threads
            bar.update()
            for step in steps:
                step()
                bar.update()


def in_passing_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) run on a thread that ends when it returns; its result, or its exception.

    For work before a long-lived thread takes over the kernels (pyml-serve loads the model, then
    its model thread runs it): GNU OpenMP keeps a team of threads for every thread that has
    launched a parallel kernel, and once its teams hold more threads than there are cores it
    stops spinning between launches, so every launch waits for a wake-up. A model loaded (and
    warmed) on the main thread left the main thread's team alive beside the model thread's: a
    batched step, ~200 launches, took 38 ms where it takes 11. A team ends with its thread."""
    box = {}

    def run():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as e:  # re-raised on the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name="pyml-load", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
