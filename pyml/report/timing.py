"""What timing costs: empty spans measured on this machine, for run.json and the reports.

A report states the instrumentation's own cost beside the times it shows; this measures it
with spans shaped like the real call sites, recorded by a collector like the profile's.
"""

from __future__ import annotations

import io
import logging
import os
import statistics
import time

from pyml.core import clock, perf

FLUSH_EVERY = 20000


class RecordSink:
    """A perf collector: append each record; ask for a flush when a top-level span ends with a
    full buffer (so serialising never lands inside a measured span)."""

    def __init__(self, on_full=None):
        self.buf, self.on_full = [], on_full

    def __call__(self, record):
        self.buf.append(record)
        if record["parent"] is None and self.on_full is not None and len(self.buf) >= FLUSH_EVERY:
            self.on_full(record["thread"])


def measure_timing_overhead(n: int = 400, repeats: int = 5, with_lines: bool = False) -> dict:
    """What timing costs, measured with empty spans on this machine (µs unless named _ns).

    span_floor_us: what an empty span reports as its own duration.
    span_overhead_us: what one empty child span adds to its parent's duration (the
      cost of recording a span, collector included, as seen from the parent).
    clock_us: one perf_counter read. off_call_ns: a call site when its level is off.
    compiled_clock_ns: one time-stamp counter read inside compiled code (core/clock.py).
    made_us: making a span's record after the fact (perf's drain, outside the timed code).
    line_us (with_lines): the extra cost of formatting its `[perf]` text line, also after the fact.
    """
    name = "pyml.profile.calibration"
    logger = logging.getLogger(name)
    saved = (logger.level, logger.propagate, list(logger.handlers))
    pl = perf.get(name)
    out = {}
    try:
        logger.setLevel(logging.CRITICAL + 10)
        logger.propagate = False
        if not perf._collectors:
            perf.refresh()
            t0 = perf.clock()
            for _ in range(n * 10):
                with pl.trace("calibrate::off"):
                    pass
            out["off_call_ns"] = (perf.clock() - t0) / (n * 10) * 1e9
        out.update(_measure_spans(pl, n, repeats))
        clk = perf.clock
        t0 = clk()
        for _ in range(n * 10):
            clk()
        out["clock_us"] = (clk() - t0) / (n * 10) * 1e6
        out["compiled_clock_ns"] = clock.read_cost_ns()
        if with_lines:
            handler = logging.StreamHandler(io.StringIO())
            logger.addHandler(handler)
            logger.setLevel(perf.TRACE)
            perf.refresh()
            with_text = _measure_spans(pl, n, repeats)
            out["line_us"] = max(0.0, with_text["made_us"] - out["made_us"])
    finally:
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
        logger.handlers[:] = saved[2]
        perf.refresh()
    out["method"] = (f"median of {repeats} runs of {n} empty spans nested in one parent, "
                     f"recorded by a collector like the profile's")
    return out


def _measure_spans(pl, n, repeats) -> dict:
    sink = RecordSink()
    perf.add_collector(sink, level=perf.TRACE)
    try:
        floors, per_child, made = [], [], []
        for _ in range(repeats):
            perf.flush()
            sink.buf.clear()
            with pl.trace("calibrate::parent"):
                for _ in range(n):
                    # shaped like a real call site: details formatted from arguments, attributes
                    with pl.trace("calibrate::child", "{}->{} {}", (1, 768), (768, 3072), "F32",
                                  module="model.layers.0.mlp.up_proj", op="linear", dtype="F32"):
                        pass
            t0 = perf.clock()
            perf.flush()  # the records (and lines) are made here, after the spans
            made.append((perf.clock() - t0) / (n + 1))
            parent = sink.buf[-1]["dur_ms"]
            children = [r["dur_ms"] for r in sink.buf[:-1]]
            floors.append(statistics.median(children))
            per_child.append(parent / n)
    finally:
        perf.remove_collector(sink)
    return {"span_floor_us": statistics.median(floors) * 1e3,
            "span_overhead_us": statistics.median(per_child) * 1e3, "made_us": statistics.median(made) * 1e6}


def measure_decode_overhead(lm, steps: int = 6, rounds: int = 5) -> dict:
    """What recording added to this model's decode steps, measured after the run: blocks of
    `steps` decode steps over the same cache positions (the same work), with recording off and
    on as the run had it (a collector like the profile's; the `[perf]` text too when the log
    level was trace, written to os.devnull: the cost of making lines, not of a terminal),
    in `rounds` pairs, the order alternating. pct is the median of the rounds' paired ratios
    (on/off); off_ms and on_ms the medians of the blocks' ms per step; made_ms what making the
    records (and lines) cost per step after the steps (perf's drain) - the steps' own times do
    not hold it, the run's wall time does.
    Each block starts with one untimed step: the previous block's drain (or the prefill) leaves
    the caches cold for a step whatever the mode, and with "off" always first that step went to
    "off" (three runs of a SmolLM2 profile read -6.1%, -5.0% and -1.3%; pyml-bench --log-cost's
    paired blocks +0.2%).
    No record of these steps reaches the profile: call it after removing the profile's collector.
    """
    model = lm.model
    cache = lm.new_cache(steps + 4)
    with_lines = logging.getLogger("pyml").isEnabledFor(perf.TRACE)
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.startswith("pyml")]
    levels = [(lg, lg.level) for lg in loggers + [logging.getLogger("pyml")]]
    handlers = [h for h in logging.getLogger("pyml").handlers if hasattr(h, "setStream")]
    sink_file = open(os.devnull, "w")
    saved_streams = [h.setStream(sink_file) for h in handlers]
    got = {"off": [], "on": []}
    made = []
    try:
        with perf.context(phase="calibration"):
            model.forward([1, 2, 3], cache)
            for r in range(rounds):
                for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    sink = RecordSink()
                    if mode == "off":
                        logging.getLogger("pyml").setLevel(logging.CRITICAL + 10)
                        for lg in loggers:
                            lg.setLevel(logging.NOTSET)
                        perf.refresh()
                    else:
                        for lg, level in levels:
                            lg.setLevel(level)
                        perf.add_collector(sink, level=perf.TRACE)
                    try:
                        cache.length = 3
                        model.forward([5], cache)  # untimed: the caches warm again
                        cache.length = 3
                        t0 = time.perf_counter()
                        for _ in range(steps):
                            model.forward([5], cache)
                        t1 = time.perf_counter()
                        perf.flush()
                        got[mode].append((t1 - t0) / steps * 1e3)
                        if mode == "on":
                            made.append((time.perf_counter() - t1) / steps * 1e3)
                    finally:
                        if mode == "on":
                            perf.remove_collector(sink)
    finally:
        for lg, level in levels:
            lg.setLevel(level)
        perf.refresh()
        for h, stream in zip(handlers, saved_streams):
            h.setStream(stream)
        sink_file.close()
    off, on = statistics.median(got["off"]), statistics.median(got["on"])
    ratios = [b / a for a, b in zip(got["off"], got["on"]) if a]
    return {"off_ms": off, "on_ms": on, "pct": (statistics.median(ratios) - 1) * 100 if ratios else None,
            "made_ms": statistics.median(made), "pairs": ratios,
            "steps": steps * rounds, "lines": with_lines,
            "method": (f"{rounds} pairs of {steps} decode steps at the same positions with recording off and on "
                       f"({'records and [perf] lines' if with_lines else 'records'}), the order alternating, "
                       f"each after one untimed step, after the run; median of the pairs' ratios")}
