"""Hierarchical perf events: the `[perf]` log lines and their structured records.

A call site asks its PerfLogger for a span and times a region with it:

    _perf = perf.get("pyml.nn.linear")
    with _perf.trace("linear::forward", "{}->{} {}", x.shape, w.shape, dtype, module=self.name):
        y = ...

With logging off the call returns a shared do-nothing span after one flag check:
no clock read, no string formatting. When on, the span reads the clock twice and,
on exit, (1) delivers a record dict to every registered collector and (2) logs
one line `[perf] name details elapsed_ms | context` at the span's level.

The text after ` | ` is what a report needs to rebuild the records from a saved
log (`pyml-report LOGFILE`): the module path (Hugging Face parameter prefix, when
the span has one), the nesting depth, the start time (perf_counter seconds, µs
resolution), and, on top-level spans only, the generation phase and step:

    [perf] linear::forward [1, 768]->[768, 2304] F32 0.412ms | transformer.h.0.attn.c_attn depth=4 start=8.503116
    [perf] generator::decode_step token=6 model=64.694ms sample=0.037ms total=64.731ms | depth=0 start=8.440050 \
        phase=decode step=1          (one line)

Lines are written when a span ends, so children come before their parent; the
depth and start put them back in their tree. Spans on a thread other than the
main thread add `thread=<ident>`.

Nesting is explicit: a thread-local stack gives every record its parent's id, and
`perf.context(phase=..., step=...)` stamps the generation phase on every record
opened inside it. A span can also time named parts of itself (`span.part("ffn")`);
parts are reported in the span's own line and record (`attn=1.2ms ffn=3.4ms`),
not as separate events.

Levels: TRACE (5) sits below DEBUG. `configure("pyml=debug,pyml.nn=trace")` or the
LOG environment variable sets them; collectors force their level on without
printing anything.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import sys
import threading
import time

from pyml.core.errors import PymlError

TRACE = 5
logging.addLevelName(TRACE, "TRACE")

# Read through the module so tests can count clock reads on the hot path.
clock = time.perf_counter

_LEVEL_NAMES = {"trace": TRACE, "debug": logging.DEBUG, "info": logging.INFO,
                "warning": logging.WARNING, "warn": logging.WARNING,
                "error": logging.ERROR, "off": logging.CRITICAL + 10}

_tls = threading.local()
_ids = itertools.count(1)
_loggers: dict[str, "PerfLogger"] = {}
_collectors: list = []        # [(callable, level)]
_collect_level = logging.CRITICAL + 10


def _stack() -> list:
    s = getattr(_tls, "stack", None)
    if s is None:
        s = _tls.stack = []
        _tls.ctx = {}
    return s


class _NullSpan:
    """Returned when the level is off: every method is a no-op."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def part(self, name):
        return self

    def set(self, **attrs):
        pass


NULL_SPAN = _NullSpan()


class _Part:
    __slots__ = ("span", "name", "t0")

    def __init__(self, span, name):
        self.span, self.name = span, name

    def __enter__(self):
        self.t0 = clock()
        return self

    def __exit__(self, *exc):
        parts = self.span.parts
        parts[self.name] = parts.get(self.name, 0.0) + (clock() - self.t0)
        return False


class Span:
    __slots__ = ("perf", "level", "name", "fmt", "args", "attrs", "parts",
                 "id", "parent", "t0")

    def __init__(self, perf, level, name, fmt, args, attrs):
        self.perf, self.level, self.name = perf, level, name
        self.fmt, self.args, self.attrs = fmt, args, attrs
        self.parts = {}

    def part(self, name):
        """Time a named part of this span (reported inline, e.g. `attn=1.2ms`)."""
        return _Part(self, name)

    def set(self, **attrs):
        """Attach attributes known only inside the span (e.g. a sampled token)."""
        self.attrs.update(attrs)

    def __enter__(self):
        stack = _stack()
        self.parent = stack[-1].id if stack else None
        self.id = next(_ids)
        stack.append(self)
        self.t0 = clock()
        return self

    def __exit__(self, exc_type, exc, tb):
        t1 = clock()
        _tls.stack.pop()
        if exc_type is None:
            self.perf._emit(self, t1 - self.t0)
        return False

    def details(self) -> str:
        """The formatted details; shapes are passed as tuples (no list built when the level is
        off) and printed as lists, `[1, 576]`."""
        if not self.args:
            return self.fmt
        return self.fmt.format(*(list(a) if type(a) is tuple else a for a in self.args))


class PerfLogger:
    """Perf events of one component (a logger name under `pyml`).

    `debug_on` / `trace_on` are plain attributes so that a call site's check is
    one attribute load; `refresh()` recomputes them when levels or collectors change.
    """

    def __init__(self, name: str):
        self.name = name
        self.logger = logging.getLogger(name)
        self.debug_on = False
        self.trace_on = False
        self._refresh()

    def _refresh(self):
        self.debug_on = self.logger.isEnabledFor(logging.DEBUG) or _collect_level <= logging.DEBUG
        self.trace_on = self.logger.isEnabledFor(TRACE) or _collect_level <= TRACE
        self.direct = _direct_handler(self.logger)

    def debug(self, name, fmt="", *args, **attrs):
        if not self.debug_on:
            return NULL_SPAN
        return Span(self, logging.DEBUG, name, fmt, args, attrs)

    def trace(self, name, fmt="", *args, **attrs):
        if not self.trace_on:
            return NULL_SPAN
        return Span(self, TRACE, name, fmt, args, attrs)

    def _emit(self, span: Span, elapsed: float):
        level = span.level
        details = span.details()
        if _collectors:
            ctx = _tls.ctx
            record = {
                "id": span.id, "parent": span.parent, "name": span.name,
                "level": "trace" if level == TRACE else "debug",
                "logger": self.name, "thread": threading.get_ident(),
                "start": span.t0, "dur_ms": elapsed * 1e3,
                "phase": ctx.get("phase"), "step": ctx.get("step"),
                "details": details,
                "parts": {k: v * 1e3 for k, v in span.parts.items()},
            }
            record.update(span.attrs)
            for fn, min_level in _collectors:
                if level >= min_level:
                    fn(record)
        if self.logger.isEnabledFor(level):
            line = "[perf] " + format_line(span.name, details, span.parts, elapsed, _context(span))
            if self.direct is not None:
                self.direct.add(line, top_level=not _tls.stack)
            else:
                self.logger.log(level, "%s", line)


def _direct_handler(logger: logging.Logger) -> "_PerfHandler | None":
    """pyml's own handler when it is the only place this logger's records can go (no other
    handler or filter on the way up to `pyml`): then lines may skip the logging machinery."""
    while logger is not None:
        if logger.filters:
            return None
        if logger.name == "pyml":
            hs = logger.handlers
            ok = len(hs) == 1 and isinstance(hs[0], _PerfHandler) and not hs[0].filters and not logger.propagate
            return hs[0] if ok else None
        if logger.handlers or not logger.propagate:
            return None
        logger = logger.parent
    return None


class _PerfHandler(logging.StreamHandler):
    """pyml's stderr handler. `[perf]` lines reach it without a LogRecord (building one costs
    ~25 µs, several times the span it reports) and are written in one piece when a top-level
    span ends (a decode step) or 50 ms after the last write; any other record first writes
    what is pending, so the order is kept."""

    _pyml = True

    def __init__(self, stream):
        super().__init__(stream)
        self.pending: list[str] = []
        self.written_at = clock()
        self.setFormatter(_LineFormatter())

    def add(self, line: str, top_level: bool):
        with self.lock:
            self.pending.append(line)
        # one write per decode step; in a long pass (a prefill) at least every 50 ms, so a
        # layer's line still shows while the pass runs
        if top_level or clock() - self.written_at > 0.05:
            self.write_pending()

    def write_pending(self):
        with self.lock:
            self.written_at = clock()
            if self.pending:
                text, self.pending = "\n".join(self.pending) + "\n", []
                try:
                    self.stream.write(text)
                    self.flush()
                except (OSError, ValueError):  # a closed or broken stderr: nothing to tell
                    pass

    def emit(self, record):
        self.write_pending()
        super().emit(record)


def flush():
    """Write the `[perf]` lines not yet written (before printing to stderr outside logging)."""
    for h in logging.getLogger("pyml").handlers:
        if isinstance(h, _PerfHandler):
            h.write_pending()


def _context(span: Span) -> str:
    """The ` | ` tail of a line: module, depth, start; phase and step on top-level spans."""
    depth = len(_tls.stack)  # the span is already popped: its ancestors remain
    module = span.attrs.get("module")
    text = f"{module} depth={depth} start={span.t0:.6f}" if module else f"depth={depth} start={span.t0:.6f}"
    if depth == 0:
        ctx = _tls.ctx
        phase, step = ctx.get("phase"), ctx.get("step")
        if phase is not None:
            text = f"{text} phase={phase}"
        if step is not None:
            text = f"{text} step={step}"
    ident = threading.get_ident()
    return text if ident == _MAIN_THREAD else f"{text} thread={ident}"


_MAIN_THREAD = threading.main_thread().ident


def format_line(name: str, details: str, parts: dict, elapsed: float, context: str = "") -> str:
    """`name details [k=v ms ...] elapsed [| context]` — with parts, the elapsed reads `total=`.

    Times are printed in ms with three decimals: a log holds durations to the µs. (Written as a
    few f-strings: at trace level this runs ~500 times per decode step.)
    """
    head = f"{name} {details}" if details else name
    if parts:
        timed = " ".join([f"{k}={v * 1e3:.3f}ms" for k, v in parts.items()])
        line = f"{head} {timed} total={elapsed * 1e3:.3f}ms"
    else:
        line = f"{head} {elapsed * 1e3:.3f}ms"
    return f"{line} | {context}" if context else line


def get(name: str) -> PerfLogger:
    """The PerfLogger for a logger name (created once, refreshed on reconfiguration)."""
    p = _loggers.get(name)
    if p is None:
        p = _loggers[name] = PerfLogger(name)
    return p


def refresh():
    """Recompute every PerfLogger's flags (after changing levels by hand)."""
    for p in _loggers.values():
        p._refresh()


class context:
    """Stamp records opened inside with generation state: `with perf.context(phase="decode", step=3):`."""

    def __init__(self, **values):
        self.values = values

    def __enter__(self):
        _stack()
        self.saved = dict(_tls.ctx)
        _tls.ctx.update(self.values)
        return self

    def __exit__(self, *exc):
        _tls.ctx = self.saved
        return False


def add_collector(fn, level: int = TRACE):
    """Deliver every record at `level` or above to `fn(record)`; forces that level on."""
    global _collect_level
    _collectors.append((fn, level))
    _collect_level = min(lv for _, lv in _collectors)
    refresh()


def remove_collector(fn):
    global _collect_level
    _collectors[:] = [(f, lv) for f, lv in _collectors if f != fn]
    _collect_level = min((lv for _, lv in _collectors), default=logging.CRITICAL + 10)
    refresh()


def parse_level(text: str) -> int:
    try:
        return _LEVEL_NAMES[text.strip().lower()]
    except KeyError:
        raise PymlError(f"unknown log level {text!r}: use one of "
                        + ", ".join(k for k in _LEVEL_NAMES if k != "warn")) from None


class _LineFormatter(logging.Formatter):
    def format(self, record):
        msg = record.getMessage()
        if msg.startswith("[perf]"):
            return msg
        return f"{record.levelname.lower()}: {msg}"


def configure(spec: str | None = None, stream=None):
    """Set levels from a spec like `debug`, `trace` or `pyml.nn=trace,pyml=debug`.

    With no spec, the environment is read: PYML_LOG first, then LOG. LOG is a common name that
    other programs set for themselves, so a LOG value that is not a pyml spec is ignored with one
    warning line; a bad --log or PYML_LOG is an error. Lines go to stderr.
    """
    root = logging.getLogger("pyml")
    if not any(getattr(h, "_pyml", False) for h in root.handlers):
        root.addHandler(_PerfHandler(stream or sys.stderr))
        root.propagate = False
    root.setLevel(logging.WARNING)
    if spec is None and not os.environ.get("PYML_LOG") and os.environ.get("LOG"):
        try:
            levels = _parse_spec(os.environ["LOG"])
        except PymlError as e:
            levels = {}
            root.warning("LOG=%s is not a pyml log level, ignored (%s; PYML_LOG takes precedence)",
                         os.environ["LOG"], e)
    else:
        levels = _parse_spec(spec if spec is not None else os.environ.get("PYML_LOG", ""))
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    refresh()


def _parse_spec(spec: str) -> dict:
    """{logger name: level} of a spec like `pyml.nn=trace,pyml=debug`."""
    levels = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, level = item.rpartition("=")
        if name and not (name == "pyml" or name.startswith("pyml.")):
            raise PymlError(f"log filter {item!r}: logger names start with 'pyml'")
        levels[name or "pyml"] = parse_level(level)
    return levels


atexit.register(flush)
