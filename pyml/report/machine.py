"""What a measurement ran on: the machine, the versions, the git commit, the command line.

run.json (pyml.profile) and pyml-bench's tables record these beside their figures.
"""

from __future__ import annotations

import os
import platform
import subprocess
import threading
import time
from pathlib import Path

import numba
import numpy
from threadpoolctl import threadpool_info

from pyml.core import isa
from pyml.core.version import __version__


def read_text(path) -> str:
    """A /proc (or other small) file's text; "" where it cannot be read (not Linux)."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def usable_cores() -> int:
    """The cores this process may run on (its affinity), else every core."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def memory() -> dict:
    """/proc/meminfo's MemTotal and MemAvailable in bytes (a key is absent where it cannot be read)."""
    mem = {}
    for line in read_text("/proc/meminfo").splitlines():
        k, _, v = line.partition(":")
        if k in ("MemTotal", "MemAvailable"):
            mem[k] = int(v.split()[0]) * 1024
    return mem


def machine_info() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in read_text("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor() or platform.machine())
    mem = memory()
    affinity = usable_cores()
    blas = []
    try:
        blas = [{k: d.get(k) for k in ("internal_api", "version", "num_threads", "threading_layer")}
                for d in threadpool_info()]
    except Exception:  # optional, and its probing must never break a profile
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": affinity,
            "memory_bytes": mem.get("MemTotal"), "memory_available_bytes": mem.get("MemAvailable"),
            "platform": platform.platform(), "python": platform.python_version(),
            "numpy": numpy.__version__, "numba": numba.__version__, "pyml": __version__, "blas": blas,
            "numba_threads": numba.get_num_threads(), "isa": isa.ISA,
            "isa_supported": list(isa.supported(isa.HOST_FEATURES))}


@numba.njit(parallel=True, fastmath=True, cache=True)
def _sum(a):  # a [chunks, 16384]: each chunk summed in float32 vector lanes (fastmath lets LLVM reorder)
    total = 0.0
    for i in numba.prange(a.shape[0]):
        row = a[i]
        s = numpy.float32(0.0)
        for j in range(row.shape[0]):
            s += row[j]
        total += s
    return total


def read_bandwidth(gib: float = 1.0, reps: int = 5) -> float:
    """Bytes/s reading a large float32 array with Numba's current thread count (best of reps): the
    ceiling a decode step that reads its weights once is measured against. The sum is vectorised:
    a scalar float64 reduction is add-latency bound, not memory bound."""
    a = numpy.ones(int(gib * (1 << 30)) // 4, numpy.float32).reshape(-1, 16384)
    _sum(a)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        _sum(a)
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best


def measure_read_bandwidth(gib: float = 0.25) -> dict:
    """run.json's "read_bandwidth": what this machine reads at the run's thread count, measured as a
    profile ends (a decode step's weights against it: the report's matmul section)."""
    return {"gb_s": read_bandwidth(gib, reps=3) / 1e9, "threads": numba.get_num_threads(),
            "bytes": int(gib * (1 << 30))}


def git_info() -> dict | None:
    """The commit of the pyml checkout this code runs from (None outside a git checkout)."""
    here = Path(__file__).resolve().parent
    if not any((d / ".git").exists() for d in [here, *here.parents]):
        return None
    try:
        commit = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode:
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def run_info(argv) -> dict:
    # what changes the figures: thread counts, and how the kernels' threads wait at a barrier (OpenMP's
    # wait policy: the test suite sleeps them; spinning is faster alone, slower beside other work)
    env = {k: os.environ[k] for k in ("LOG", "NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                                      "GOMP_SPINCOUNT", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                      "NUMBA_CACHE_DIR") if k in os.environ}
    return {"command": argv, "cwd": os.getcwd(), "env": env, "machine": machine_info(), "git": git_info(),
            "main_thread": threading.main_thread().ident}
