"""The text of a `[perf]` line (docs/logging.md): format_line for a record read back from a log or
made by a report, span_line for a live span as perf.py drains it. The two give the same text;
span_line is written out in as few f-strings as it takes, as it runs once per span logged.
"""

from __future__ import annotations

import threading


def span_line(span, details: str, tree: bool = False) -> str:
    """The whole `[perf]` line of an ended span: format_line's text and the ` | ` tail (module,
    depth, start; phase and step on top-level spans), in as few f-strings as it takes; in `tree`
    order indented by its depth, two spaces a level, after `[perf] `."""
    elapsed, parts, depth = span.t1 - span.t0, span.parts, span.depth
    name = f"{INDENT * depth}{span.name}" if tree and depth else span.name
    head = f"[perf] {name} {details}" if details else f"[perf] {name}"
    if parts:
        timed = " ".join([f"{k}={v * 1e3:.3f}ms" for k, v in parts.items()])
        head = f"{head} {timed} total={elapsed * 1e3:.3f}ms | "
    else:
        head = f"{head} {elapsed * 1e3:.3f}ms | "
    module = span.attrs.get("module")
    line = (f"{head}{module} depth={depth} start={span.t0:.6f}" if module
            else f"{head}depth={depth} start={span.t0:.6f}")
    if depth == 0:
        ctx = span.ctx
        phase, step = ctx.get("phase"), ctx.get("step")
        if phase is not None:
            line = f"{line} phase={phase}"
        if step is not None:
            line = f"{line} step={step}"
    if span.thread != _MAIN_THREAD:
        line = f"{line} thread={span.thread}"
    return f"{line} compiled=1" if span.compiled else line


_MAIN_THREAD = threading.main_thread().ident
INDENT = "  "  # a level of depth in tree order


def format_line(name: str, details: str, parts: dict, elapsed: float, context: str = "") -> str:
    """`name details [k=v ms ...] elapsed [| context]` — with parts, the elapsed reads `total=`.

    Times are printed in ms with three decimals: a log holds durations to the µs. (The live
    lines are written by span_line, which must give the same text.)
    """
    head = f"{name} {details}" if details else name
    if parts:
        timed = " ".join([f"{k}={v * 1e3:.3f}ms" for k, v in parts.items()])
        line = f"{head} {timed} total={elapsed * 1e3:.3f}ms"
    else:
        line = f"{head} {elapsed * 1e3:.3f}ms"
    return f"{line} | {context}" if context else line
