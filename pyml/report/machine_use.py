"""What the machine did while a run ran: run.json's "machine_use".

A profile starts a sampler thread that reads, every INTERVAL_S (and at the start and the end):

- the process's CPU time (user + system, every thread) beside the wall clock: CPU well under
  wall means the process waited for a core;
- involuntary context switches (getrusage): the kernel took a core from us for someone else;
- page faults (minor + major);
- from /proc/stat, the machine's busy time (steal included) minus ours: what other processes
  used, in cores; and steal time where the kernel reports it (a virtual machine's host);

and the cyclic GC's pauses are timed as they happen (gc.callbacks). Afterwards each sampling
interval is shared out over the top-level spans it overlaps (a load, a warm-up, a prefill, a
decode step), in proportion to the overlap: per phase, and per decode step for attributing
jitter (contention.py). Time between top-level spans (tokenizing, writing lines) is "between".

The records themselves cannot be the clock: perf delivers them in bulk, at most once a second.
A sample is one getrusage and one /proc/stat read, which gives the GIL back while it waits on
the kernel (its cost: docs/profiling.md).
Outside Linux the /proc figures are None; getrusage and the GC pauses remain.
"""

from __future__ import annotations

import bisect
import gc
import os
import resource
import threading
import time

from pyml.report.machine import read_text, usable_cores

INTERVAL_S = 0.025
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_stat() -> tuple | None:
    """(busy, total, steal) CPU seconds of the whole machine since boot; steal None when the
    kernel does not report it; None outside Linux.

    /proc/stat's first line: user nice system idle iowait irq softirq steal guest guest_nice
    (guest time is already inside user); busy is all but idle and iowait."""
    line = read_text("/proc/stat").split("\n", 1)[0].split()
    if len(line) < 5 or line[0] != "cpu":
        return None
    v = [int(x) for x in line[1:9]]
    steal = v[7] if len(v) > 7 else None
    v += [0] * (8 - len(v))
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
    return busy / _CLK_TCK, (busy + v[3] + v[4]) / _CLK_TCK, None if steal is None else steal / _CLK_TCK


def load_average() -> list | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def process_threads() -> int | None:
    for line in read_text("/proc/self/status").splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return None


def sample() -> tuple:
    """(wall, cpu, nivcsw, nvcsw, faults, busy, total, steal): seconds and counts since some origin."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    stat = proc_stat() or (None, None, None)
    return (time.perf_counter(), ru.ru_utime + ru.ru_stime, ru.ru_nivcsw, ru.ru_nvcsw,
            ru.ru_minflt + ru.ru_majflt, *stat)


_SUMS = ("wall", "cpu", "nivcsw", "nvcsw", "faults", "busy", "total", "steal")


class MachineSampler:
    """Samples the process and the machine on a thread of its own (see the module docstring)."""

    def __init__(self, interval_s: float = INTERVAL_S):
        self.interval_s = interval_s
        self.gc_pauses: list = []        # (perf_counter start, ms)
        self._gc_t0 = None
        gc.callbacks.append(self._on_gc)
        self.load_start = load_average()
        self.samples = [sample()]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pyml-machine-sampler", daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(self.interval_s):
            self.samples.append(sample())

    def _on_gc(self, event, info):
        if event == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            self.gc_pauses.append((self._gc_t0, (time.perf_counter() - self._gc_t0) * 1e3))
            self._gc_t0 = None

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self.samples.append(sample())
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def summary(self, spans: list, threads: int | None) -> dict:
        """run.json's "machine_use": `spans` are the run's top-level spans, (phase, step, start, end)
        in perf_counter seconds."""
        self.stop()
        return summarize(self.samples, self.gc_pauses, spans, threads, self.load_start, load_average(),
                         self.interval_s)


def _deltas(samples) -> list:
    out = []
    for a, b in zip(samples, samples[1:]):
        d = {k: (None if x is None or y is None else y - x) for k, x, y in zip(_SUMS, a, b)}
        d["t0"], d["t1"] = a[0], b[0]
        out.append(d)
    return out


def _share(deltas, t0, t1) -> dict:
    """The sampled quantities over [t0, t1]: each interval counted in proportion to its overlap."""
    acc = {k: 0.0 for k in _SUMS}
    missing = set()
    starts = [d["t0"] for d in deltas]
    i = max(0, bisect.bisect_right(starts, t0) - 1)
    while i < len(deltas) and deltas[i]["t0"] < t1:
        d = deltas[i]
        span = d["t1"] - d["t0"]
        f = (min(t1, d["t1"]) - max(t0, d["t0"])) / span if span > 0 else 0.0
        if f > 0:
            for k in _SUMS:
                if d[k] is None:
                    missing.add(k)
                else:
                    acc[k] += f * d[k]
        i += 1
    for k in missing:
        acc[k] = None
    return acc


def _phase_row(acc: dict, gc_ms: float) -> dict:
    wall = acc["wall"]
    has_stat = acc["busy"] is not None and acc["total"]
    others = max(0.0, acc["busy"] - acc["cpu"]) / wall if has_stat and wall else None
    return {"wall_s": round(wall, 4), "cpu_s": round(acc["cpu"], 4),
            "cpu_per_wall": round(acc["cpu"] / wall, 3) if wall else None,
            "nivcsw": round(acc["nivcsw"], 1), "nvcsw": round(acc["nvcsw"], 1), "faults": round(acc["faults"]),
            "gc_ms": round(gc_ms, 3), "others_cores": None if others is None else round(others, 3),
            "machine_busy_pct": round(100 * acc["busy"] / acc["total"], 1) if has_stat else None,
            "steal_pct": round(100 * acc["steal"] / acc["total"], 2) if has_stat and acc["steal"] is not None
            else None}


def summarize(samples, gc_pauses, spans, threads, load_start, load_end, interval_s=INTERVAL_S) -> dict:
    deltas = _deltas(samples)
    sums: dict = {}
    steps = {"step": [], "start": [], "wall_ms": [], "cpu_ms": [], "nivcsw": [], "faults": [], "gc_ms": []}
    covered = 0.0
    for phase, step, t0, t1 in sorted(spans, key=lambda s: s[2]):
        acc = _share(deltas, t0, t1)
        gc_ms = sum(ms for t, ms in gc_pauses if t0 <= t < t1)
        covered += t1 - t0
        row = sums.setdefault(phase or "other", [{k: 0.0 for k in _SUMS}, 0.0])
        for k in _SUMS:
            row[0][k] = None if acc[k] is None or row[0][k] is None else row[0][k] + acc[k]
        row[1] += gc_ms
        if phase == "decode":
            steps["step"].append(step)
            steps["start"].append(round(t0, 6))
            steps["wall_ms"].append(round((t1 - t0) * 1e3, 3))
            steps["cpu_ms"].append(round(acc["cpu"] * 1e3, 3))
            steps["nivcsw"].append(round(acc["nivcsw"], 2))
            steps["faults"].append(round(acc["faults"], 1))
            steps["gc_ms"].append(round(gc_ms, 3))
    whole = _share(deltas, samples[0][0], samples[-1][0]) if deltas else None
    return {"load_average_start": load_start, "load_average_end": load_end,
            "threads_used": threads, "usable_cores": usable_cores(), "process_threads": process_threads(),
            "sample_interval_s": interval_s, "samples": len(samples),
            "phases": {p: _phase_row(acc, gc_ms) for p, (acc, gc_ms) in sums.items()},
            "run": _phase_row(whole, sum(ms for _, ms in gc_pauses)) if whole else None,
            "decode_steps": steps}
