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
import json
import logging
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from pyml.core import perf
from pyml.core.errors import PymlError
from pyml.report.machine import measure_read_bandwidth, run_info
from pyml.report.machine_use import MachineSampler
from pyml.report.records import normalize
from pyml.report.timing import RecordSink, measure_decode_overhead, measure_timing_overhead
from pyml.report.writer import write_reports

_active: list = []
WORKER_ID_BITS = 40   # a worker's record ids are moved to worker << 40 and up: no process makes 2**40 spans


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
        self._sink = RecordSink(self._flush_thread)
        self._file = None
        self._lm = None
        self._machine = None

    # --- what the caller knows --------------------------------------------------------
    def set_model(self, lm):
        """Describe the loaded model (a pyml LanguageModel) in run.json; at the end of the block
        a few untimed decode steps of it measure what the recording added (run.json "overhead")."""
        self.info["model"] = model_info(lm)
        self._lm = lm
        self.info["threads"] = lm.runtime.threads
        self.info["warmup"] = lm.runtime.warmup
        self.info["load_s"] = lm.load_s
        self._note_warmup(lm)

    def _note_warmup(self, lm):
        # compile_s: the Numba compile time the LanguageModel measured (absent on older versions)
        self.info["warmup_s"] = getattr(lm, "warmup_s", None)
        self.info["compile_s"] = getattr(lm, "compile_s", None)

    def set_result(self, result):
        """Record the generation's own summary (a GenerationResult) in run.json."""
        self.info["generation"] = {
            "prompt_tokens": len(result.prompt_tokens), "generated_tokens": len(result.tokens),
            "prefill_s": result.prefill_s, "decode_steps": len(result.decode_s),
            "decode_ms_per_token": result.decode_ms_per_token, "decode_tok_s": result.decode_tok_s,
            "stop_reason": result.stop_reason, "summary": result.summary()}
        if self._lm is not None:  # the first prefill may have warmed (and compiled) its kernels
            self._note_warmup(self._lm)

    def outcome(self) -> str:
        """One line for the command that ran it: why the generation stopped, and what was written where."""
        gen = self.info.get("generation") or {}
        stop = (f"stopped: {gen.get('stop_reason') or 'unknown'} after {gen.get('generated_tokens', 0)} tokens; "
                if gen else "no generation recorded; ")
        names = ["events.jsonl", "run.json"] + [p.name for p in self.written]
        return f"{stop}profile in {self.dir.resolve()}: {', '.join(names)}"

    # --- records made elsewhere --------------------------------------------------------------
    def add_records(self, records: list, worker: int, clock_shift: float = 0.0) -> None:
        """Write another process's records (Record.to_json dicts, e.g. a Ray worker's) as `worker`.

        Ids are moved into the worker's own range so they never meet this process's; `clock_shift`
        (seconds) moves their starts onto this process's clock.
        """
        base = worker << WORKER_ID_BITS
        write = self._file.write
        for r in records:
            r = dict(r, id=base + r["id"], parent=None if r.get("parent") is None else base + r["parent"],
                     start=r["start"] + clock_shift, worker=worker)
            write(json.dumps(r, default=str, separators=(",", ":")) + "\n")
        self.events += len(records)

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
        self._machine, self._spans = MachineSampler(), []
        perf.add_collector(self._collect, level=perf.TRACE)
        return self

    def _collect(self, record):
        if record["parent"] is None:  # what the machine did is shared out over these (machine_use.py)
            self._spans.append((record["phase"], record["step"], record["start"],
                                record["start"] + record["dur_ms"] / 1e3))
        self._sink(record)

    def _flush_thread(self, thread=None):
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
        perf.remove_collector(self._collect)
        _active.remove(self)
        self.info["machine_use"] = self._machine.summary(self._spans, self.info.get("threads"))
        try:
            self._flush_thread()
        finally:
            self._file.close()
        self.info["duration_s"] = perf.clock() - self.info["t0"]
        if exc_type is None and self._lm is not None and self.info.get("generation", {}).get("decode_steps"):
            self.info["overhead"] = measure_decode_overhead(self._lm)
            self.info["read_bandwidth"] = measure_read_bandwidth()
            self._lm = None
        self.info["events"] = self.events
        self.info["status"] = "ok" if exc_type is None else f"ended by {exc_type.__name__}"
        self.info.update(run_info(self.argv))
        (self.dir / "run.json").write_text(json.dumps(self.info, indent=2, default=str) + "\n")
        if self.report and exc_type is None and self.events:
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
    """What run.json says of a loaded model (a LanguageModel, read through its public API)."""
    model = lm.model
    linears = model.linears()
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
