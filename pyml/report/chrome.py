"""trace.json: the run in Chrome's trace event format, for https://ui.perfetto.dev and chrome://tracing.

One complete event (`ph: "X"`, `ts`/`dur` in µs from the first event) per span, one
process per worker (a batch run on Ray's workers; else just one), one track per thread,
with process and thread names as metadata events. Events on a track nest by time; since times are kept to the µs, each event is clamped into
its parent's interval and before its next sibling, so rounding never breaks the
nesting (a shift of at most 1 µs).
"""

from __future__ import annotations

import json

from pyml.core.errors import PymlError


def chrome_trace(run) -> dict:
    recs = run.records
    t0 = min(r.start for r in recs)
    events = []
    for worker in sorted({r.worker for r in recs}):
        pid = worker + 1
        name = f"pyml: {run.label}" if worker == 0 else f"pyml worker {worker}: {run.label}"
        events.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": name}})
        events.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": pid}})
        for tid in sorted({r.thread for r in recs if r.worker == worker}):
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                           "args": {"name": "main" if tid == 0 else f"thread {tid}"}})
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                           "args": {"sort_index": tid}})
    spans, next_start, spans_out = {}, {}, []
    # Reversed end order visits a parent before its children and a later sibling before an
    # earlier one: each event is clamped into its parent and to end before its next sibling.
    for r in reversed(recs):
        ts = (r.start - t0) * 1e6
        end = ts + r.dur_ms * 1e3
        key = id(r.parent_rec) if r.parent_rec is not None else ("track", r.worker, r.thread)
        lo, hi = spans[id(r.parent_rec)] if r.parent_rec is not None else (0.0, float("inf"))
        hi = min(hi, next_start.get(key, float("inf")))
        ts = min(max(ts, lo), hi)
        end = min(max(end, ts), hi)
        next_start[key] = ts
        spans[id(r)] = (ts, end)
        args = {k: v for k, v in (("module", r.module), ("details", r.details), ("phase", r.phase),
                                  ("step", r.step), ("layer", r.layer), ("dtype", r.dtype)) if v not in (None, "")}
        if r.parts:
            args["parts_ms"] = r.parts
        spans_out.append({"ph": "X", "pid": r.worker + 1, "tid": r.thread, "name": r.name, "cat": r.op or "span",
                          "ts": round(ts, 3), "dur": round(end - ts, 3), "args": args})
    spans_out.sort(key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"]))
    events += spans_out
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": run.source, "model": (run.info.get("model") or {}).get("source")}}


def write_chrome_trace(run, path) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(run), f, separators=(",", ":"))


def validate_chrome_trace(obj) -> int:
    """Check the structure Perfetto and chrome://tracing need; returns the number of X events.

    Raises PymlError naming the first bad event: missing fields, negative times, or
    complete events on one track that overlap without nesting.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("traceEvents"), list):
        raise PymlError("trace: expected an object with a traceEvents list")
    by_track = {}
    for i, e in enumerate(obj["traceEvents"]):
        ph = e.get("ph")
        if ph not in ("X", "M", "B", "E", "i", "I", "C"):
            raise PymlError(f"trace event {i}: unknown phase {ph!r}")
        for k in ("name", "pid", "tid"):
            if k not in e:
                raise PymlError(f"trace event {i}: no {k!r}")
        if ph == "X":
            if not isinstance(e.get("ts"), (int, float)) or not isinstance(e.get("dur"), (int, float)):
                raise PymlError(f"trace event {i} ({e['name']}): ts and dur must be numbers")
            if e["dur"] < 0 or e["ts"] < 0:
                raise PymlError(f"trace event {i} ({e['name']}): negative ts or dur")
            by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], -e["dur"], i, e))
    n = 0
    for evs in by_track.values():
        evs.sort()
        stack = []
        for ts, neg, i, e in evs:
            end = ts - neg
            while stack and stack[-1][0] <= ts:
                stack.pop()
            if stack and end > stack[-1][0] + 1e-3:
                raise PymlError(f"trace event {i} ({e['name']}): overlaps {stack[-1][1]} without nesting in it")
            stack.append((end, e["name"]))
            n += 1
    return n
