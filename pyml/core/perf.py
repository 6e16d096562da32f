"""Hierarchical perf events: the `[perf]` log lines and their structured records.

A call site asks its PerfLogger for a span and times a region with it:

    _perf = perf.get("pyml.nn.linear")
    with _perf.trace("linear::forward", "{}->{} {}", x.shape, w.shape, dtype, module=self.name):
        y = ...

With logging off the call returns a shared do-nothing span after one flag check:
no clock read, no string formatting. When on, the span reads the clock twice and,
on exit, is appended to a pending buffer — no dict, no string, no logging call
while the code it times runs. Spans timed inside compiled calls wait there too, as the
raw tick events the kernels wrote (`defer`). When a top-level span ends at least a
second after the last drain, or a reader asks (`flush`: the end of a generation or a
profile, any other log record, the process's exit), the buffer is drained in end
order: each span (1) delivers a record dict to every registered collector and (2)
becomes one line `[perf] name details elapsed_ms | context` at its level. Details
repeat step after step (a layer's shapes), so each distinct one is formatted once.

The text after ` | ` is what a report needs to rebuild the records from a saved
log (`pyml-report LOGFILE`): the module path (Hugging Face parameter prefix, when
the span has one), the nesting depth, the start time (perf_counter seconds, µs
resolution), and, on top-level spans only, the generation phase and step:

    [perf] linear::forward [1, 768]->[768, 2304] F32 0.412ms | transformer.h.0.attn.c_attn depth=4 start=8.503116
    [perf] generator::decode_step token=6 model=64.694ms sample=0.037ms total=64.731ms | depth=0 start=8.440050 \
        phase=decode step=1          (one line)

By default the lines of a top-level span (a step, a prefill) wait for it to end and come as
one tree, each parent first, indented two spaces a level after `[perf] ` (the same text
otherwise); warm-up passes (`phase=warmup`) make records but print no lines. `LOG=trace,flat`
writes lines as spans end, children first (the order of the records), `LOG=trace,warmup`
prints the warm-up too. Either way the depth and start put a line in its tree. Spans on a
thread other than the main thread add `thread=<ident>`; spans timed inside compiled code
(CompiledSpan) end with `compiled=1`. What the drains cost this thread is `drain_seconds()`.

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
import math
import os
import sys
import threading
import time

from pyml.core.errors import PymlError
from pyml.core.perf_line import format_line, span_line  # noqa: F401 - format_line: what readers of logs import from here

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
        _tls.ident = threading.get_ident()
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
        span = self.span
        if span.parts is None:
            span.parts = {}
        span.parts[self.name] = span.parts.get(self.name, 0.0) + (clock() - self.t0)
        return False


class Span:
    """One timed region. On exit it is appended, as it is, to the pending buffer: the record dict
    and the `[perf]` text are made from it later, when the buffer is drained (see _drain)."""

    __slots__ = ("perf", "level", "name", "fmt", "args", "attrs", "parts",
                 "id", "parent", "t0", "t1", "depth", "ctx", "thread")
    compiled = False  # timed by two perf_counter reads here (CompiledSpan: inside compiled code)

    def __init__(self, perf, level, name, fmt, args, attrs):
        self.perf, self.level, self.name = perf, level, name
        self.fmt, self.args, self.attrs = fmt, args, attrs
        self.parts = None  # a dict once a part is timed

    def part(self, name):
        """Time a named part of this span (reported inline, e.g. `attn=1.2ms`)."""
        return _Part(self, name)

    def set(self, **attrs):
        """Attach attributes known only inside the span (e.g. a sampled token)."""
        self.attrs.update(attrs)

    def __enter__(self):
        try:
            stack = _tls.stack
        except AttributeError:
            stack = _stack()
        self.parent = stack[-1].id if stack else None
        self.id = next(_ids)
        stack.append(self)
        self.t0 = clock()
        return self

    def __exit__(self, exc_type, exc, tb):
        t1 = self.t1 = clock()
        stack = _tls.stack
        stack.pop()
        if exc_type is None:
            _end(self, t1, stack)
        return False

    def details(self) -> str:
        """The formatted details; shapes are passed as tuples (no list built when the level is
        off) and printed as lists, `[1, 576]`. A decode step repeats its details step after
        step (a layer's shapes), so they are formatted once and looked up after that."""
        args = self.args
        if not args:
            return self.fmt
        key = (self.fmt, args)
        try:
            return _details_memo[key]
        except KeyError:
            pass
        except TypeError:  # an unhashable argument: formatted every time
            return _format_details(self.fmt, args)
        if len(_details_memo) >= _DETAILS_MEMO_SIZE:
            _details_memo.clear()
        text = _details_memo[key] = _format_details(self.fmt, args)
        return text


_details_memo: dict = {}
_DETAILS_MEMO_SIZE = 8192  # a model's distinct shapes and layers; positions and tokens cycle through


def _format_details(fmt: str, args: tuple) -> str:
    return fmt.format(*(list(a) if type(a) is tuple else a for a in args))


# Ended spans wait here, in end order, beside the raw records of compiled calls (`defer`), until
# a top-level span ends at least DRAIN_EVERY_S after the last drain, or a reader asks (`flush`:
# the end of a generation or a profile, any other log record, the exit): a span's exit is then a
# clock read and two list operations, and the records, dicts, strings and handler calls are all
# made in one pass outside the steps they time. One list for all threads: list.append is atomic.
_pending: list = []
_drain_lock = threading.RLock()
_drained_at = [0.0]
DRAIN_EVERY_S = 1.0
LONG_PASS_S = 1.0  # a top-level span open this long drains once this often from inside it
_PENDING_MAX = 100_000  # entries: past this a drain comes at once (memory stays bounded)

new_id = _ids.__next__  # a record id, for spans whose record is made later (`defer`)


def _end(span, t1, stack):
    span.depth = len(stack)  # the span is already popped: its ancestors remain
    span.ctx = _tls.ctx      # never mutated in place (perf.context replaces it): a snapshot
    span.thread = _tls.ident
    _pending.append(span)
    # due a second after the last drain: when a top-level span ends (never inside a decode step), or
    # inside a pass that has itself run for over a second (a long prefill shows its finished layers)
    if (t1 - _drained_at[0] > DRAIN_EVERY_S if not stack else
            t1 - stack[0].t0 > LONG_PASS_S and t1 - _drained_at[0] > LONG_PASS_S) or len(_pending) > _PENDING_MAX:
        _drain()


def defer(entry: tuple):
    """Queue the raw data of spans timed elsewhere (a compiled call's tick events): `entry[0]`
    is a function that, given `entry[1:]`, returns their Span objects in end order, finished
    (see `nest`); it is called when the buffer is drained, in this entry's place among the
    spans that ended around it."""
    _pending.append(entry)
    if len(_pending) > _PENDING_MAX:
        _drain()


def frame():
    """(stack, ctx, thread ident) of this thread: where a deferred span is opened."""
    try:
        return _tls.stack, _tls.ctx, _tls.ident
    except AttributeError:
        return _stack(), _tls.ctx, _tls.ident


def _on_grid(t: float, up: bool = False) -> float:
    """A time on the µs grid logs and reports keep. Spans timed in compiled code follow each
    other with no gap (a feed-forward is its three ops, to the ns): rounded one by one, the
    children's durations could add up to 1 µs more than their parent's. Start and end put on
    the grid first, every duration is a whole number of µs and the children's never exceed the
    parent's. (A clock conversion may also land a hair before the open parent began: clamped.)"""
    return (math.ceil(t * 1e6) if up else round(t * 1e6)) / 1e6


def within_ended(spans: list, parent) -> list:
    """Deferred spans (made when the buffer drains) kept inside their Python parent's end when it
    has ended: their times come from the counter through a calibration good to a µs or two, and
    an op that ends as the parent closes could otherwise land just past it."""
    t_end = getattr(parent, "t1", None)
    if t_end is None:
        return spans
    ceiling = max(math.floor(t_end * 1e6) / 1e6, _on_grid(parent.t0, up=True))
    for s in spans:
        s.t0, s.t1 = min(s.t0, ceiling), min(s.t1, ceiling)
    return spans


class CompiledSpan(Span):
    """A span timed inside compiled code (span_at, nest: nn/fused.py's decode step), by two reads of
    the time-stamp counter. Its record says so (`compiled`) and its line ends ` compiled=1`, so that
    a report charges it what it cost the step (two counter reads), not a Python span's cost."""

    __slots__ = ()
    compiled = True


def span_at(p: "PerfLogger", level: int, name: str, fmt: str, args: tuple, attrs: dict, t0: float, t1: float,
            parent, depth: int, ctx: dict, thread: int, span_id: int | None = None, parts: dict | None = None,
            floor: float = 0.0) -> Span:
    """A finished span timed elsewhere (perf_counter seconds, put on the µs grid, not before
    `floor`), as Span.__exit__ would have left it."""
    s = CompiledSpan(p, level, name, fmt, args, attrs)
    s.id = new_id() if span_id is None else span_id
    s.parent, s.depth, s.ctx, s.thread, s.parts = parent, depth, ctx, thread, parts
    s.t0, s.t1 = max(_on_grid(t0), floor), max(_on_grid(t1), floor)
    return s


def nest(items, parent, depth: int, ctx: dict, thread: int, floor: float = 0.0) -> list:
    """Spans timed elsewhere, given in the order they ended as (PerfLogger, level, name, fmt, args,
    attrs, start, end) with perf_counter times, as children of `parent` (an id or None) at
    `depth`, nested among themselves by their times (a span inside another's interval is its
    child), exactly as if they had been opened there. Returned in end order."""
    spans, roots = [], []
    for p, level, name, fmt, args, attrs, t0, t1 in items:
        s = CompiledSpan(p, level, name, fmt, args, attrs)
        s.id, s.t0, s.t1, s.parent = new_id(), t0, t1, None
        while roots and roots[-1].t0 >= t0 and roots[-1].t1 <= t1:  # ended earlier, inside this one
            roots.pop().parent = s
        roots.append(s)
        spans.append(s)
    for s in reversed(spans):  # parents end after their children: they are placed first
        up = s.parent
        s.parent, s.depth = (parent, depth) if up is None else (up.id, up.depth + 1)
        s.ctx, s.thread = ctx, thread
        s.t0, s.t1 = max(_on_grid(s.t0), floor), max(_on_grid(s.t1), floor)
    return spans


def add_ended(items):
    """Spans timed elsewhere (`nest`'s items), made now as children of the current Python span."""
    stack, ctx, ident = frame()
    top = stack[-1] if stack else None
    floor = _on_grid(top.t0, up=True) if top is not None else 0.0
    _pending.extend(nest(items, top.id if top is not None else None, len(stack), ctx, ident, floor))
    if not stack:
        _drain()


def _drain(final: bool = False):
    """Turn the pending spans (and deferred entries) into records (to the collectors) and `[perf]`
    lines, in end order; in tree order (the default), a top-level span's lines wait for it and
    are written parent first (`_tree_order`). `final` (flush): also what still waits for a top-level
    span that has not ended. The time it takes is this thread's (`drain_seconds`)."""
    if not _pending and not (final and _held):
        return
    t0 = clock()
    with _drain_lock:
        n = len(_pending)
        batch = _pending[:n]
        del _pending[:n]  # other threads only append: what they add after n stays
        made = []  # (span, line or None), in end order
        for item in batch:
            for span in (item[0](*item[1:]) if type(item) is tuple else (item,)):
                p, level = span.perf, span.level
                shown = p.logger.isEnabledFor(level) and (_options["warmup"] or span.ctx.get("phase") != "warmup")
                if not (shown or _collectors):
                    if _holding:
                        made.append((span, None))  # its place in the tree, for the lines inside it
                    continue
                details = span.details()
                if _collectors:
                    _deliver(span, details)
                made.append((span, span_line(span, details, _holding) if shown else None))
        _write(_tree_order(made, final or not _holding) if _holding or _held else made)
        _drained_at[0] = clock()
    _tls.drain_s = drain_seconds() + (clock() - t0)


def drain_seconds() -> float:
    """Seconds this thread has spent in drains: making records and `[perf]` lines and writing them
    (a step that ends a batch pays for it; subtract it for the engine's own time)."""
    return getattr(_tls, "drain_s", 0.0)


# Tree order: a thread's ended spans (with their lines, or None) wait here until the top-level span
# they belong to ends, then are written parent first. Unprinted spans wait too: they place the
# printed ones inside them (a per-logger filter can print an op and not its layer).
_held: dict = {}  # thread ident -> [(span, line or None)] in end order
_holding = False  # tree order and some logger prints: set by _update_holding


def _tree_order(made: list, final: bool) -> list:
    """`made` ((span, line) in end order) rearranged into whole trees, each parent first; what
    belongs to a top-level span still open is kept in _held (all of it too when `final`)."""
    out = []
    for item in made:
        span = item[0]
        group = _held.get(span.thread)
        if span.depth == 0:
            if group is None:
                out.append(item)  # a top-level span with nothing inside it
                continue
            group.append(item)
        else:
            if group is None:
                group = _held[span.thread] = []
            group.append(item)
            if len(group) <= _PENDING_MAX:
                continue  # memory stays bounded: past this the partial tree goes out
        out += _preorder(_held.pop(span.thread))
    if final:
        for thread in list(_held):
            out += _preorder(_held.pop(thread))
    return out


def _preorder(group: list) -> list:
    """A group of (span, line) in end order, each parent before its children; siblings keep their
    end order (on one thread, their start order). A span whose parent is not in the group (the
    group's top-level span, or one whose parent raised) starts a tree of its own."""
    ids = {item[0].id for item in group}
    kids, roots = {}, []
    for item in group:
        parent = item[0].parent
        if parent in ids:
            kids.setdefault(parent, []).append(item)
        else:
            roots.append(item)
    out, todo = [], roots[::-1]
    while todo:
        item = todo.pop()
        out.append(item)
        inside = kids.get(item[0].id)
        if inside:
            todo.extend(reversed(inside))
    return out


def _write(items: list):
    """The lines of (span, line or None) items, in this order, to pyml's handler or through logging."""
    direct = None
    for span, line in items:
        if line is None:
            continue
        p = span.perf
        if p.direct is not None:
            direct = p.direct
            direct.pending.append(line)
        else:  # through logging: its handler first writes what is pending, so the order holds
            p.logger.log(span.level, "%s", line)
    if direct is not None:
        direct.write_pending()


def _deliver(span, details):
    ctx, parts = span.ctx, span.parts
    level = span.level
    record = {
        "id": span.id, "parent": span.parent, "name": span.name,
        "level": "trace" if level == TRACE else "debug",
        "logger": span.perf.name, "thread": span.thread,
        "start": span.t0, "dur_ms": (span.t1 - span.t0) * 1e3,
        "phase": ctx.get("phase"), "step": ctx.get("step"),
        "details": details,
        "parts": {k: v * 1e3 for k, v in parts.items()} if parts else {},
    }
    record.update(span.attrs)
    if span.compiled:
        record["compiled"] = True
    for fn, min_level in _collectors:
        if level >= min_level:
            fn(record)


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
        self.prints = self.logger.isEnabledFor(logging.DEBUG)  # some of its lines (TRACE is lower)

    def debug(self, name, fmt="", *args, **attrs):
        if not self.debug_on:
            return NULL_SPAN
        return Span(self, logging.DEBUG, name, fmt, args, attrs)

    def trace(self, name, fmt="", *args, **attrs):
        if not self.trace_on:
            return NULL_SPAN
        return Span(self, TRACE, name, fmt, args, attrs)


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
    ~25 µs, several times the span it reports) and are written in one piece at each drain (see
    `_pending`); any other record first writes what is pending, so the order is kept."""

    _pyml = True

    def __init__(self, stream=None):
        super().__init__()
        self._stream = stream  # None: whatever sys.stderr is at each write, not the one at configure time
        self.pending: list[str] = []
        self.setFormatter(_LineFormatter())

    # pytest's capture and contextlib.redirect_stderr swap sys.stderr and close the old one: a
    # handler holding the stderr of the first configure() would write to a closed file ever after
    @property
    def stream(self):
        return sys.stderr if self._stream is None else self._stream

    @stream.setter
    def stream(self, value):
        self._stream = value

    def setStream(self, stream):
        """As logging's, but returns what was set (None: sys.stderr at each write), so that setting it
        back restores the following of sys.stderr rather than pinning today's."""
        with self.lock:
            self.flush()
            old, self._stream = self._stream, stream
        return old

    def write_pending(self):
        with self.lock:
            if self.pending:
                text, self.pending = "\n".join(self.pending) + "\n", []
                try:
                    self.stream.write(text)
                    self.flush()
                except (OSError, ValueError):  # a closed or broken stderr: nothing to tell
                    pass

    def handle(self, record):
        # a record from outside a drain: the spans that ended before it go first (taken before
        # this handler's lock, as a drain takes them: one lock order)
        if not _drain_lock._is_owned():
            _drain()
        return super().handle(record)

    def emit(self, record):
        self.write_pending()
        super().emit(record)


def flush():
    """Write the `[perf]` lines not yet written (before printing to stderr outside logging) and
    deliver the records of the spans that have ended to the collectors. In tree order the lines
    of a top-level span still open go out too, as the part of its tree that has ended."""
    _drain(final=True)
    for h in logging.getLogger("pyml").handlers:
        if isinstance(h, _PerfHandler):
            h.write_pending()


def get(name: str) -> PerfLogger:
    """The PerfLogger for a logger name (created once, refreshed on reconfiguration)."""
    p = _loggers.get(name)
    if p is None:
        p = _loggers[name] = PerfLogger(name)
        _update_holding()
    return p


def refresh():
    """Recompute every PerfLogger's flags (after changing levels by hand)."""
    for p in _loggers.values():
        p._refresh()
    _update_holding()


def _update_holding():
    global _holding
    _holding = _options["tree"] and any(p.prints for p in _loggers.values())


# What a LOG spec says besides levels (configure): `warmup` prints the warm-up passes' lines
# (their records are made either way), `flat` writes lines in end order, children first.
_options = {"warmup": False, "tree": True}
_OPTION_WORDS = {"warmup": ("warmup", True), "flat": ("tree", False), "tree": ("tree", True)}


class context:
    """Stamp records opened inside with generation state: `with perf.context(phase="decode", step=3):`."""

    def __init__(self, **values):
        self.values = values

    def __enter__(self):
        _stack()
        # a new dict, never an update in place: ended spans keep a reference to theirs
        self.saved = _tls.ctx
        _tls.ctx = {**self.saved, **self.values}
        return self

    def __exit__(self, *exc):
        _tls.ctx = self.saved
        return False


def add_collector(fn, level: int = TRACE):
    """Deliver every record at `level` or above to `fn(record)`; forces that level on."""
    global _collect_level
    _drain()  # spans that ended before this collector existed are not its records
    _collectors.append((fn, level))
    _collect_level = min(lv for _, lv in _collectors)
    refresh()


def remove_collector(fn):
    global _collect_level
    _drain()  # the spans that ended while it was registered are its records
    _collectors[:] = [(f, lv) for f, lv in _collectors if f != fn]
    _collect_level = min((lv for _, lv in _collectors), default=logging.CRITICAL + 10)
    refresh()


def parse_level(text: str) -> int:
    try:
        return _LEVEL_NAMES[text.strip().lower()]
    except KeyError:
        raise PymlError(f"unknown log level {text!r}: use one of "
                        + ", ".join(k for k in _LEVEL_NAMES if k != "warn")
                        + " (and, to say how lines are written, " + ", ".join(_OPTION_WORDS) + ")") from None


class _LineFormatter(logging.Formatter):
    def format(self, record):
        msg = record.getMessage()
        if msg.startswith("[perf]"):
            return msg
        return f"{record.levelname.lower()}: {msg}"


def configure(spec: str | None = None, stream=None):
    """Set levels from a spec like `debug`, `trace` or `pyml.nn=trace,pyml=debug`, and how lines
    are written: `warmup` among the items prints the warm-up passes' lines too, `flat` writes
    them children first, in end order (`trace,warmup,flat`); by default a tree, no warm-up.

    With no spec, the environment is read: PYML_LOG first, then LOG. LOG is a common name that
    other programs set for themselves, so a LOG value that is not a pyml spec is ignored with one
    warning line; a bad --log or PYML_LOG is an error. Lines go to stderr.
    """
    _drain(final=True)  # what ended under the old levels is reported under them
    root = logging.getLogger("pyml")
    if not any(getattr(h, "_pyml", False) for h in root.handlers):
        root.addHandler(_PerfHandler(stream))
        root.propagate = False
    root.setLevel(logging.WARNING)
    if spec is None and not os.environ.get("PYML_LOG") and os.environ.get("LOG"):
        try:
            levels, options = _parse_spec(os.environ["LOG"])
        except PymlError as e:
            levels, options = {}, {}
            root.warning("LOG=%s is not a pyml log level, ignored (%s; PYML_LOG takes precedence)",
                         os.environ["LOG"], e)
    else:
        levels, options = _parse_spec(spec if spec is not None else os.environ.get("PYML_LOG", ""))
    _options.update(warmup=False, tree=True)
    _options.update(options)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    refresh()


def _parse_spec(spec: str) -> tuple[dict, dict]:
    """({logger name: level}, {option: value}) of a spec like `pyml.nn=trace,pyml=debug,warmup`."""
    levels, options = {}, {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        word = _OPTION_WORDS.get(item.lower())
        if word is not None:
            options[word[0]] = word[1]
            continue
        name, _, level = item.rpartition("=")
        if name and not (name == "pyml" or name.startswith("pyml.")):
            raise PymlError(f"log filter {item!r}: logger names start with 'pyml'")
        levels[name or "pyml"] = parse_level(level)
    return levels, options


atexit.register(flush)
