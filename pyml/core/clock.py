"""Timing inside compiled code: the CPU's time-stamp counter, and the event buffer kernels write.

A compiled call that runs several ops (a fused decode step) cannot open Python spans around
them. Instead it takes a runtime `trace` flag and an EventBuffer's `events` array; when the flag
is true, each op reads the counter before and after itself and appends (op id, layer, start,
end) to the array. With the flag false no counter is read and nothing is written: the branch is
a compare on an argument. The events become the same spans a Python call site would have
opened (`op_items` and perf.nest: same names, details, attributes, nesting), so records,
`[perf]` lines and reports cannot tell the difference: at once (`EventBuffer.emit`), or, as the
fused decode step does, later, when the perf buffer is drained (`EventBuffer.reserve` keeps a
call's rows in place until then; perf.defer).

The counter is LLVM's `readcyclecounter` (x86's rdtsc): a few ns and no system call, read in
nopython code and cached with the kernel (a C function pointer such as clock_gettime's would
put a process address into the cache). On a CPU with an invariant TSC (`constant_tsc` and
`nonstop_tsc` in /proc/cpuinfo) it counts at a fixed rate; that rate and the offset to
perf_counter are measured against perf_counter (Calibration), over a baseline that grows with
the run, so tick times land on the clock every Python span uses.
"""

from __future__ import annotations

import bisect
import time

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from pyml.core import perf


@intrinsic
def _read_cycle_counter(typingctx):
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])
    return types.int64(), codegen


@numba.njit(inline="always")
def ticks():
    """The time-stamp counter (int64 ticks), from compiled code."""
    return _read_cycle_counter()


@numba.njit(cache=True)
def read_ticks():
    """The counter read from Python (through one kernel call)."""
    return ticks()


@numba.njit(cache=True)
def _ticks_per_read(n):  # the cost of one read, in ticks: n reads timed by the counter itself
    t0 = ticks()
    for _ in range(n):
        ticks()  # not removed: the intrinsic has side effects as far as LLVM knows
    return (ticks() - t0) / n


# --- the event buffer a kernel writes ------------------------------------------------------
# events: int64 [capacity + 1, 4]; row 0 holds the count in column 0, row 1 + i the i-th event:
# (op id, layer, start ticks, end ticks), in the order the ops end.

@numba.njit(inline="always")
def start(trace):
    """The counter at an op's start when tracing, else 0 (no read)."""
    return ticks() if trace else 0


@numba.njit(inline="always")
def done(events, trace, op, layer, t0):
    """Append op's event (started at t0) when tracing; returns the end time (0 when not)."""
    if not trace:
        return 0
    t1 = ticks()
    n = events[0, 0]
    if n + 1 < events.shape[0]:  # a full buffer drops events: emit() says how many
        events[n + 1, 0] = op
        events[n + 1, 1] = layer
        events[n + 1, 2] = t0
        events[n + 1, 3] = t1
    events[0, 0] = n + 1
    return t1


class Calibration:
    """Ticks -> perf_counter seconds, from (ticks, perf_counter) pairs noted as the run goes.

    A compiled call's events are converted when the perf buffer is drained, after the step or
    at the generation's end, seconds after they were written. So pairs are noted while they are
    written: when timing starts, then whenever a timed call ends more than PAIR_EVERY ticks after
    the last pair (`due`, checked on the ticks the call returned: no extra read; a pair costs
    ~1 µs), and at each conversion. The rate is the slope from the first pair to the last (a
    baseline that grows with the run, at least 20 ms: the first conversion of a process waits out
    the rest); a tick value is converted from the pair nearest to it, so its error is that pair's
    read jitter (~0.1 µs) plus the two clocks' drift over at most PAIR_EVERY ticks.
    """

    PAIR_EVERY = 20_000_000  # ticks: 5-20 ms at 1-4 GHz
    BASELINE_S = 0.02

    def __init__(self):
        self.pairs: list = []  # (ticks, seconds), in time order; appended whole (atomic)
        self.due = 0           # note a pair when a timed call ends past this tick
        self.rate = None
        self._ks: list = []  # the pairs' ticks, for bisect

    @staticmethod
    def pair():
        """A (ticks, perf_counter) pair read as close together as Python can: the tightest of three
        tries, so that a read the scheduler cut in two (its ticks ms apart on a busy machine) is not
        the one a run's times are converted by."""
        best = None
        for _ in range(3):
            k_a = read_ticks()
            t = time.perf_counter()
            k_b = read_ticks()
            if best is None or k_b - k_a < best[0]:
                best = (k_b - k_a, (k_a + k_b) // 2, t)
        return best[1], best[2]

    def note(self):
        """Note a pair now (from the timed path, when `due` has passed)."""
        k, t = self.pair()
        self.pairs.append((k, t))
        self.due = k + self.PAIR_EVERY

    def update(self):
        """Before converting: a pair of now (unless one is under 50 ms old), a baseline of at
        least BASELINE_S, the rate."""
        pairs = self.pairs
        if not pairs:
            self.note()
        now = time.perf_counter()
        wait = self.BASELINE_S - (now - pairs[0][1])
        if wait > 0:
            time.sleep(wait)
        if len(pairs) < 2 or now - pairs[-1][1] > 0.05:
            self.note()
        if len(pairs) > 512:  # the first (the baseline) and the newest: drained events are past
            pairs[1:-256] = []
        (k0, t0), (k1, t1) = pairs[0], pairs[-1]
        self.rate = (k1 - k0) / (t1 - t0)
        return self

    def reference(self, k: int) -> tuple:
        """(ticks, seconds, seconds per tick) to convert ticks near `k` with: k's nearest pair."""
        ks = self._ks
        if len(ks) != len(self.pairs) or ks[-1] != self.pairs[-1][0]:
            ks = self._ks = [p[0] for p in self.pairs]
        i = bisect.bisect_left(ks, k)
        if i == len(ks) or (i > 0 and k - ks[i - 1] < ks[i] - k):
            i -= 1
        k_ref, t_ref = self.pairs[i]
        return k_ref, t_ref, 1.0 / self.rate

    def seconds(self, tick_values) -> np.ndarray:
        k = np.asarray(tick_values, np.int64)
        k_ref, t_ref, per_tick = self.reference(int(k.flat[0]) if k.size else 0)
        return t_ref + (k - k_ref) * per_tick


_CALIBRATION = Calibration()


def calibration() -> Calibration:
    """The process's calibration, brought up to date: convert with it after the events are written."""
    return _CALIBRATION.update()


def clock_pairs() -> Calibration:
    """The process's calibration, for the timed path to note pairs (`if end > cal.due: cal.note()`)."""
    return _CALIBRATION


def read_cost_ns(n: int = 100_000) -> float:
    """What one counter read costs inside a kernel, in ns (for run.json's timing section)."""
    _ticks_per_read(16)
    cal = _CALIBRATION.update()
    return _ticks_per_read(n) / cal.rate * 1e9


class AtPos:
    """An Op argument known only per call: `fn(position)` (POS: the position itself; a decode
    attention's span length, which a sliding window caps)."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn


POS = AtPos(int)


class Op:
    """How one op id of a compiled call is reported: the span a Python call site would open
    (the same logger, name, details format and arguments, attributes).

    args may hold AtPos values, replaced by their value at the call's position (`pos=` in rope,
    kv_cache, attention; the attention's span)."""

    __slots__ = ("perf", "level", "name", "fmt", "args", "attrs", "pos_at")

    def __init__(self, logger: str, name: str, fmt: str = "", *args, level: int = perf.TRACE, **attrs):
        self.perf, self.level, self.name, self.fmt = perf.get(logger), level, name, fmt
        self.args, self.attrs = args, attrs
        self.pos_at = tuple(i for i, a in enumerate(args) if isinstance(a, AtPos))

    def enabled(self) -> bool:
        return self.perf.trace_on if self.level <= perf.TRACE else self.perf.debug_on


class EventBuffer:
    """The preallocated events of one compiled call site (a model's decode step)."""

    def __init__(self, capacity: int = 4096):
        self.events = np.zeros((capacity + 1, 4), np.int64)

    def reserve(self, n: int) -> tuple:
        """(events array, first row) for a call that writes `n` events, which stay there until
        deferred records have read them: when the array is full, a fresh one takes its place
        (the old one lives as long as the entries that point into it)."""
        events = self.events
        used = int(events[0, 0])
        if used + n >= events.shape[0]:
            events = self.events = np.zeros_like(events)
            used = 0
        return events, used + 1

    def emit(self, tables, pos: int = 0, count: int | None = None, cal: Calibration | None = None):
        """Turn the events written since the last emit (the first `count` of them; the rest stay
        for the next emit) into spans under the current Python span, now. tables[layer][op id] is
        the Op an event stands for (a layer's table names its modules: `model.layers.3.mlp.down_proj`)."""
        events = self.events
        n = int(events[0, 0])
        if n == 0:
            return
        if count is not None and count < n:
            taken = events[1:count + 1].copy()
            rest = min(n, events.shape[0] - 1)
            events[1:rest - count + 1] = events[count + 1:rest + 1]
            events[0, 0] = n - count
            perf.add_ended(op_items(tables, pos, taken, cal or calibration()))
            return
        kept = min(n, events.shape[0] - 1)
        events[0, 0] = 0
        perf.add_ended(op_items(tables, pos, events[1:kept + 1], cal or calibration()))
        if n > kept:
            perf.get("pyml.core.clock").logger.warning(
                "%d compiled-code events did not fit the trace buffer (%d) and were dropped", n - kept, kept)


def op_items(tables, pos, rows, cal, near: int | None = None) -> list:
    """perf.nest's items for event rows (op id, layer, start, end) of the enabled ops: an array,
    or its tolist(). The rows of one call are µs apart: one reference pair converts them all, the
    one nearest `near` (default: the first row's start). A caller that converts a call's rows in
    several pieces passes one `near` to all: two pairs' offsets differ by the calibration's error,
    which can move one op's span inside its neighbour's."""
    rows = rows.tolist() if isinstance(rows, np.ndarray) else rows
    if not rows:
        return []
    k_ref, t_ref, per_tick = cal.reference(rows[0][2] if near is None else near)
    items = []
    for op_id, layer, k0, k1 in rows:
        op = tables[layer][op_id]
        if not op.enabled():
            continue
        args = op.args
        if op.pos_at:
            args = tuple(a.fn(pos) if j in op.pos_at else a for j, a in enumerate(args))
        items.append((op.perf, op.level, op.name, op.fmt, args, op.attrs,
                      t_ref + (k0 - k_ref) * per_tick, t_ref + (k1 - k_ref) * per_tick))
    return items
