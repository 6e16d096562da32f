"""The kernel compiles a run pays for: counted, timed and shown while they happen.

On a first run (an empty or stale Numba cache) loading a model's kernels means compiling them,
about a minute on 2 cores; later runs load the machine code from disk in a fraction of a second.
A wait that long must say what it is, and the figures must keep it apart from loading the weights
and from the warm-up: Numba signals every compile - a cache miss, never a cache load - as a
"numba:compile" event, which one process-wide listener here counts and times.

`showing(label)` wraps work that may compile (load_model, a warm-up): at the first compile inside
it, stderr says so - a bar naming the kernel being compiled at a terminal, one line otherwise -
and when it ends, one line with the count and the seconds. A warm cache stays silent.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from numba.core import event

from pyml.core import progress


class _Listener(event.Listener):
    """Counts compiles and times the outermost ones (a kernel's compile types, and so compiles,
    the jitted helpers it calls: their time is inside the outer one's)."""

    def __init__(self):
        self.kernels = 0        # compiles of any depth, this process
        self.compiled = []      # (kernel, argument types) of each, in order
        self.seconds = 0.0      # outermost compiles' wall time, this process
        self._depth = 0
        self._open = []         # the compiled entries of the compiles not yet ended, innermost last
        self._t0 = 0.0
        self.current = ""       # the kernel being compiled now
        self.on_change = None   # the display's hook, while one is active
        self.waited = 0.0       # seconds waiting, outside any compile here, for another process's compile
        self.elsewhere = 0      # kernels a compile helper process compiled for this one (add_elsewhere)
        self.when_compiling = []  # one-shot callbacks for the next outermost compile's start

    def on_start(self, ev):
        self.kernels += 1
        name = kernel_name(ev.data.get("dispatcher") if isinstance(ev.data, dict) else None)
        self._open.append(len(self.compiled))
        self.compiled.append((name, str(ev.data.get("args", "")) if isinstance(ev.data, dict) else ""))
        if self._depth == 0:
            self._t0 = time.perf_counter()
            self.current = name
            if self.on_change is not None:
                self.on_change()
            while self.when_compiling:
                self.when_compiling.pop(0)()
        self._depth += 1

    def on_end(self, ev):
        at = self._open.pop()
        if not _built(ev):  # no kernel: numba.literally's first try, typing the argument as a plain
            # int, stops at once and asks for a retry with the constant (the compile counted next)
            self.kernels -= 1
            self.compiled[at] = None
        self._depth -= 1
        if self._depth == 0:
            self.seconds += time.perf_counter() - self._t0
            self.current = ""
            if self.on_change is not None:
                self.on_change()


def kernel_name(dispatcher) -> str:
    """`module.function` of a dispatcher, and, for a kernel a factory makes per weight type or
    block shape (kernel_set.block_kernels(kind), decode_kernels.decode_layers_kernel(shape)), the
    constants its closure holds - `kernel_set.gemm[kind=2]`: without them one factory's kernels
    for two types read as the same kernel compiled twice."""
    func = getattr(dispatcher, "py_func", None)
    if func is None:
        return "?"
    name = f"{func.__module__.rpartition('.')[2]}.{func.__name__}"
    cells = zip(func.__code__.co_freevars, func.__closure__ or ())
    constants = [f"{var}={cell.cell_contents!r}" for var, cell in cells if _constant(cell)]
    keyed = [c for c in constants if c.startswith("key=")]  # a block shape's key says all its ints do
    constants = keyed or constants
    return f"{name}[{', '.join(constants)}]" if constants else name


def _constant(cell) -> bool:
    try:
        value = cell.cell_contents
    except ValueError:  # a cell not filled yet
        return False
    return isinstance(value, (bool, int, float, str))


def _built(ev) -> bool:
    """Whether the compile that `ev` ends added a kernel to its dispatcher (Numba 0.68's
    Event.is_failed says the opposite of what happened, so the dispatcher is asked)."""
    data = ev.data if isinstance(ev.data, dict) else {}
    overloads = getattr(data.get("dispatcher"), "overloads", None)
    if overloads is None or "args" not in data:
        return True
    return tuple(data["args"]) in overloads


_listener = _Listener()
event.register("numba:compile", _listener)  # compiles are serialised by Numba's global lock


def kernels() -> int:
    """Kernels compiled in this process so far (cache loads are not compiles)."""
    return _listener.kernels


def compiled() -> list[tuple[str, str]]:
    """(kernel, argument types) of every compile in this process so far."""
    return [c for c in _listener.compiled if c is not None]


def elsewhere() -> int:
    """Kernels compile helper processes compiled for this one (nlp/compile_helper.py), as they said."""
    return _listener.elsewhere


def add_elsewhere(n: int) -> None:
    _listener.elsewhere += n


def seconds() -> float:
    """Seconds this process has spent compiling kernels so far, or waiting while another process
    compiled one it needed (core/jit.py: one process compiles a kernel, the others load it)."""
    return (_listener.seconds + _listener.waited
            + (time.perf_counter() - _listener._t0 if _listener._depth else 0.0))


def when_compiling(callback):
    """Call `callback()` once, when this process next starts compiling a kernel (not a cache load);
    returns a function that takes it back if that has not happened yet."""
    _listener.when_compiling.append(callback)

    def cancel():
        if callback in _listener.when_compiling:
            _listener.when_compiling.remove(callback)
    return cancel


@contextmanager
def waiting(kernel: str):
    """Around a wait for another process's compile of `kernel`: shown as a compile, and its time
    counted as compile time (inside one of our own compiles it is counted already)."""
    if _listener._depth:
        yield
        return
    t0 = time.perf_counter()
    _listener.current = f"{kernel} (by another process)"
    if _listener.on_change is not None:
        _listener.on_change()
    try:
        yield
    finally:
        _listener.waited += time.perf_counter() - t0
        _listener.current = ""
        if _listener.on_change is not None:
            _listener.on_change()


def _history_file() -> Path:
    root = os.environ.get("PYML_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pyml")
    return Path(root) / "compile-history.json"


def _history() -> dict:
    try:
        return json.loads(_history_file().read_text())
    except (OSError, ValueError):
        return {}


def _remember(key: str, n_kernels: int, secs: float) -> None:
    """The last full compile's count and time per key: the next cold start's estimate."""
    try:
        history = _history()
        history[key] = {"kernels": n_kernels, "seconds": round(secs, 1)}
        path = _history_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(history, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # an estimate is a nicety: a read-only home goes without


class Compiles:
    """What one `showing` block compiled: `kernels`, `seconds` (so far, while it runs)."""

    def __init__(self, label: str, key: str | None, stream):
        self.label, self.key, self.stream = label, key, stream
        self._k0, self._s0 = _listener.kernels, seconds()
        self._w0, self._e0 = _listener.waited, _listener.elsewhere
        self._bar = None
        self._ticker = None
        self._stop = threading.Event()
        self.started = False

    @property
    def kernels(self) -> int:
        return _listener.kernels - self._k0

    @property
    def seconds(self) -> float:
        return seconds() - self._s0

    @property
    def elsewhere(self) -> int:
        """Kernels a helper process compiled for this block meanwhile."""
        return _listener.elsewhere - self._e0

    def _estimate(self) -> tuple[int | None, str]:
        known = _history().get(self.key) if self.key else None
        if known:
            return known["kernels"], f"last time {known['kernels']} kernels in {known['seconds']:.0f} s"
        return None, "about a minute on 2 cores"

    def _on_change(self):
        if not self.started and _listener.current:
            self.started = True
            total, estimate = self._estimate()
            if self._tty():
                self._bar = progress.bar(total=total, unit=" kernels",
                                         desc=f"pyml: compiling kernels for {self.label} (first run only)")
                self._ticker = threading.Thread(target=self._tick, daemon=True, name="pyml-compile-bar")
                self._ticker.start()
            else:
                self._say(f"pyml: compiling kernels for {self.label} (first run only, {estimate}; "
                          f"`pyml-cache warm` does it ahead) ...")
        if self._bar is not None:
            self._bar.n = min(self.kernels, self._bar.total or self.kernels)
            self._bar.set_postfix_str(_listener.current or "", refresh=False)

    def _tick(self):
        while not self._stop.wait(0.5):
            self._bar.refresh()

    def _tty(self) -> bool:
        return hasattr(self.stream, "isatty") and self.stream.isatty()

    def _say(self, line: str):
        try:
            self.stream.write(line + "\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass

    def close(self):
        if self._ticker is not None:
            self._stop.set()
            self._ticker.join()
        if self._bar is not None:
            self._bar.close()
        if self.started or self.elsewhere:  # a helper that ended before this block waited for it: said too
            waited = _listener.waited - self._w0
            helped = f"{self.elsewhere} more by a helper process; " if self.elsewhere else ""
            if self.kernels:
                also = f", {waited:.1f} s of it waiting for another process's compiles" if waited >= 0.05 else ""
                self._say(f"pyml: compiled {self.kernels} kernels in {self.seconds:.1f} s{also} "
                          f"({helped}cached for later runs)")
            elif self.started:
                self._say(f"pyml: waited {waited:.1f} s for kernels another process compiled "
                          f"({helped}cached for later runs)")
            else:
                self._say(f"pyml: a helper process compiled {self.elsewhere} kernels meanwhile "
                          f"(cached for later runs)")
            if self.key and self.kernels:
                _remember(self.key, self.kernels, self.seconds)


@contextmanager
def showing(label: str, key: str | None = None, stream=None):
    """Show the compiles inside the block on stderr (see the module's docstring); yields a
    `Compiles` whose `seconds` and `kernels` are what the block compiled. `key` names the set of
    kernels (model kind, weight types, instruction set) whose last count is the next estimate."""
    watch = Compiles(label, key, stream if stream is not None else sys.stderr)
    if _listener.on_change is not None:  # inside another showing block: that one speaks for both
        yield watch
        return
    _listener.on_change = watch._on_change
    try:
        yield watch
    finally:
        _listener.on_change = None
        watch.close()
