"""`pyml.profile(dir)`: record every perf event of a run into a directory for `pyml-report`.

    with pyml.profile("prof/") as prof:
        lm = pyml.load_model(gguf="smollm2-135m")
        prof.set_model(lm)
        prof.set_result(lm.generate("Hello", max_tokens=16))
    # prof/events.jsonl, prof/run.json; then: pyml-report prof/

Inside the block every span is recorded at trace level, whatever LOG says (the
text log is left as configured). events.jsonl holds one JSON record per event in
the order the spans ended (children first): name, module path, op kind, parent,
phase, step, layer, details (shapes), dtype, start, duration, thread. run.json
holds the model, threads, machine, versions, git commit, command line, and the
measured cost of the timing itself (see `measure_timing_overhead`).

The collector only appends each record to a list: serialising happens when a
top-level span ends (every FLUSH_EVERY records) or at the end, outside any span,
so it never lands inside a measured time.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from pyml.core import perf
from pyml.core.errors import PymlError

FLUSH_EVERY = 20000
_active: list = []


class _Sink:
    """The collector: append, and ask for a flush when a top-level span ends with a full buffer."""

    def __init__(self, on_full=None):
        self.buf, self.on_full = [], on_full

    def __call__(self, record):
        self.buf.append(record)
        if record["parent"] is None and self.on_full is not None and len(self.buf) >= FLUSH_EVERY:
            self.on_full(record["thread"])


class Profile:
    """Collects perf records into `directory` (see the module docstring)."""

    def __init__(self, directory, *, report: bool = False, formats=("md",), plots: bool = True,
                 argv=None):
        self.dir = Path(directory)
        self.report, self.formats, self.plots = report, tuple(formats), plots
        self.argv = list(sys.argv if argv is None else argv)
        self.info: dict = {}
        self.events = 0
        self.written: list[Path] = []
        self._threads: dict = {}
        self._sink = _Sink(self._flush_thread)
        self._file = None

    # --- what the caller knows --------------------------------------------------------
    def set_model(self, lm):
        """Describe the loaded model (a pyml LanguageModel) in run.json."""
        self.info["model"] = model_info(lm)
        self.info["threads"] = lm.runtime.threads
        self.info["warmup"] = lm.runtime.warmup
        self.info["load_s"] = lm.load_s

    def set_result(self, result):
        """Record the generation's own summary (a GenerationResult) in run.json."""
        self.info["generation"] = {
            "prompt_tokens": len(result.prompt_tokens), "generated_tokens": len(result.tokens),
            "prefill_s": result.prefill_s, "decode_steps": len(result.decode_s),
            "decode_ms_per_token": result.decode_ms_per_token, "decode_tok_s": result.decode_tok_s,
            "stop_reason": result.stop_reason, "summary": result.summary()}

    # --- collecting ------------------------------------------------------------------------
    def __enter__(self):
        if _active:
            raise PymlError(f"a profile is already recording into {_active[-1].dir}: profiles do not nest")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.dir / "events.jsonl", "w")
        except OSError as e:
            raise PymlError(f"cannot write the profile into {self.dir}: {e.strerror}") from None
        self.info["timing"] = measure_timing_overhead(
            with_lines=logging.getLogger("pyml").isEnabledFor(perf.TRACE))
        self.info["t0"] = perf.clock()
        self.info["started"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        _active.append(self)
        perf.add_collector(self._sink, level=perf.TRACE)
        return self

    def _flush_thread(self, thread=None):
        from pyml.nlp.report.records import normalize
        buf = self._sink.buf
        if thread is None:
            chunk, self._sink.buf = buf, []
        else:
            chunk = [r for r in buf if r["thread"] == thread]
            self._sink.buf = [r for r in buf if r["thread"] != thread]
        if not chunk:
            return
        recs, _ = normalize(chunk, main_thread=threading.main_thread().ident, threads=self._threads)
        write = self._file.write
        for r in recs:
            write(json.dumps(r.to_json(), default=str, separators=(",", ":")) + "\n")
        self.events += len(recs)

    def __exit__(self, exc_type, exc, tb):
        perf.remove_collector(self._sink)
        _active.remove(self)
        try:
            self._flush_thread()
        finally:
            self._file.close()
        self.info["duration_s"] = perf.clock() - self.info["t0"]
        self.info["events"] = self.events
        self.info["status"] = "ok" if exc_type is None else f"ended by {exc_type.__name__}"
        self.info.update(run_info(self.argv))
        (self.dir / "run.json").write_text(json.dumps(self.info, indent=2, default=str) + "\n")
        if self.report and exc_type is None and self.events:
            from pyml.nlp.report import write_reports
            self.written = write_reports(self.dir, formats=self.formats, plots=self.plots)
        return False


def profile(directory, *, report: bool = False, formats=("md",), plots: bool = True, argv=None) -> Profile:
    """Record every perf event inside the `with` block into `directory`.

    report: also write the reports (report.md, modules.md, jitter.md, trace.json,
    plots) when the block ends normally. formats: any of "md", "json", "html".
    argv: the command line to record (default sys.argv).
    """
    return Profile(directory, report=report, formats=formats, plots=plots, argv=argv)


# --- what run.json says about the model, the machine and the timing ---------------------------

def model_info(lm) -> dict:
    from pyml.nlp.models.base import _linears
    model = lm.model
    linears = [lin for b in model.blocks for lin in _linears(b)] + [model.lm_head]
    emb = getattr(model, "embed_tokens", None)
    cfg = model.config
    config = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(getattr(cfg, "__dict__", {}))
    tied = emb is not None and emb.weight.data is model.lm_head.weight.data
    head = model.lm_head
    return {
        "source": lm.source, "arch": getattr(model, "arch", type(model).__name__),
        "name": Path(str(lm.source)).name or str(lm.source),
        "describe": model.describe(), "config": config,
        "layers": len(model.blocks),
        "weight_types": dict(Counter(lin.weight.type_name for lin in linears)),
        "linear_params": sum(lin.in_features * lin.out_features for lin in linears),
        "linear_bytes": sum(lin.weight.nbytes for lin in linears),
        "embedding_params": int(emb.num_embeddings * emb.dim) if emb is not None else 0,
        "tied_head": bool(tied),
        "lm_head": {"in": head.in_features, "out": head.out_features, "dtype": head.weight.type_name,
                    "bytes": head.weight.nbytes},
        "fusions": sum(1 for lin in linears if lin.name.endswith(("qkv_proj", "gate_up_proj"))),
    }


def _read(path) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def machine_info() -> dict:
    import numba
    import numpy
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor() or platform.machine())
    mem = {}
    for line in _read("/proc/meminfo").splitlines():
        k, _, v = line.partition(":")
        if k in ("MemTotal", "MemAvailable"):
            mem[k] = int(v.split()[0]) * 1024
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    blas = []
    try:
        from threadpoolctl import threadpool_info
        blas = [{k: d.get(k) for k in ("internal_api", "version", "num_threads", "threading_layer")}
                for d in threadpool_info()]
    except Exception:  # optional, and its probing must never break a profile
        pass
    from pyml import __version__
    return {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": affinity,
            "memory_bytes": mem.get("MemTotal"), "memory_available_bytes": mem.get("MemAvailable"),
            "platform": platform.platform(), "python": platform.python_version(),
            "numpy": numpy.__version__, "numba": numba.__version__, "pyml": __version__, "blas": blas,
            "numba_threads": numba.get_num_threads()}


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
    env = {k: os.environ[k] for k in ("LOG", "NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                      "MKL_NUM_THREADS", "NUMBA_CACHE_DIR") if k in os.environ}
    return {"command": argv, "cwd": os.getcwd(), "env": env, "machine": machine_info(), "git": git_info(),
            "main_thread": threading.main_thread().ident}


def measure_timing_overhead(n: int = 400, repeats: int = 5, with_lines: bool = False) -> dict:
    """What timing costs, measured with empty spans on this machine (µs unless named _ns).

    span_floor_us: what an empty span reports as its own duration.
    span_overhead_us: what one empty child span adds to its parent's duration (the
      cost of recording a span, collector included, as seen from the parent).
    clock_us: one perf_counter read. off_call_ns: a call site when its level is off.
    line_us (with_lines): the extra cost of formatting the `[perf]` text line.
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
        if with_lines:
            handler = logging.StreamHandler(io.StringIO())
            logger.addHandler(handler)
            logger.setLevel(perf.TRACE)
            perf.refresh()
            with_text = _measure_spans(pl, n, repeats)
            out["line_us"] = max(0.0, with_text["span_overhead_us"] - out["span_overhead_us"])
    finally:
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
        logger.handlers[:] = saved[2]
        perf.refresh()
    out["method"] = (f"median of {repeats} runs of {n} empty spans nested in one parent, "
                     f"recorded by a collector like the profile's")
    return out


def _measure_spans(pl, n, repeats) -> dict:
    sink = _Sink()
    perf.add_collector(sink, level=perf.TRACE)
    try:
        floors, per_child = [], []
        for _ in range(repeats):
            sink.buf.clear()
            with pl.trace("calibrate::parent"):
                for _ in range(n):
                    # shaped like a real call site: details formatted from arguments, attributes
                    with pl.trace("calibrate::child", "{}->{} {}", [1, 768], [768, 3072], "F32",
                                  module="model.layers.0.mlp.up_proj", op="linear", dtype="F32"):
                        pass
            parent = sink.buf[-1]["dur_ms"]
            children = [r["dur_ms"] for r in sink.buf[:-1]]
            floors.append(statistics.median(children))
            per_child.append(parent / n)
    finally:
        perf.remove_collector(sink)
    return {"span_floor_us": statistics.median(floors) * 1e3,
            "span_overhead_us": statistics.median(per_child) * 1e3}
