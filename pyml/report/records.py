"""Perf records from a profile directory (events.jsonl) or a saved `LOG=trace` stderr log.

Both sources end up as the same list of `Record`s, in the order the spans ended
(children before their parent), with the tree rebuilt and the derived fields
(depth, op kind, layer, owning module, dtype) filled in by one function,
`normalize`. Durations are kept to the microsecond in both: a log prints them in
ms with three decimals, and events.jsonl is rounded the same way when read, so
every table comes out identical from either source.

A log line is `[perf] name [details] [parts] elapsed | [module] depth=N start=S
[phase=P step=K] [thread=T] [compiled=1]` (see pyml.core.perf). Only top-level lines carry the
phase and step; the spans inside a tree inherit them, as they do from
`perf.context` when recorded live.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from pyml.core.errors import PymlError
from pyml.report import old_logs


STEP_EVENTS = ("generator::decode_step", "generator::batch_step")  # one sequence's decode step; a batched one

class ReportInputError(PymlError):
    """A profile directory, events file or log that cannot be read."""


class EventsFormatError(ReportInputError):
    """A malformed or truncated events.jsonl."""


class LogFormatError(ReportInputError):
    """A `[perf]` line that cannot be read, or a log cut off mid-line."""


@dataclass(eq=False)
class Record:
    id: int
    parent: int | None
    name: str
    dur_ms: float
    start: float                    # perf_counter seconds, µs resolution
    details: str = ""
    parts: dict = field(default_factory=dict)   # name -> ms
    module: str | None = None       # the span's own module path (HF parameter prefix)
    phase: str | None = None        # load | warmup | prefill | decode | None
    step: int | None = None         # 0 for prefill, 1.. for decode steps
    thread: int = 0                 # 0 = main thread, then 1, 2, .. in order of appearance
    worker: int = 0                 # the process that made it: 0 = the run's own, 1.. = batch workers
    line: int = 0                   # line in the source file (for messages)
    orphan: bool = False            # its enclosing span never ended
    compiled: bool = False          # timed inside compiled code (two counter reads), not by a Python span
    # derived by normalize()
    depth: int = 0
    op: str = ""
    layer: int | None = None
    kind: str | None = None         # attention kind: global | sliding
    dtype: str | None = None        # weight storage: F32, Q8_0, ..
    owner: str | None = None        # nearest module path: own or an ancestor's
    parent_rec: "Record | None" = field(default=None, repr=False)
    children: list = field(default_factory=list, repr=False)
    self_ms: float = 0.0            # dur_ms minus the children's (>= 0)

    def key(self) -> tuple:
        """Everything a table may use, for comparing two sources of the same run."""
        return (self.name, self.details, tuple(sorted(self.parts.items())), self.dur_ms, self.start,
                self.module, self.phase, self.step, self.thread, self.depth, self.op, self.layer,
                self.kind, self.dtype, self.owner, self.compiled,
                self.parent_rec.name if self.parent_rec else None, len(self.children))

    def to_json(self) -> dict:
        return {"id": self.id, "parent": self.parent, "name": self.name, "module": self.module,
                "op": self.op, "phase": self.phase, "step": self.step, "layer": self.layer,
                "kind": self.kind, "dtype": self.dtype, "depth": self.depth, "details": self.details,
                "parts": self.parts, "start": self.start, "dur_ms": self.dur_ms, "thread": self.thread,
                **({"worker": self.worker} if self.worker else {}), **({"orphan": True} if self.orphan else {}),
                **({"compiled": True} if self.compiled else {})}


# --- deriving the fields a table groups by ------------------------------------------------

_OPS = {"linear::forward": "linear", "attention::forward": "attention", "attention::sdpa": "sdpa",
        "feed_forward": "feed_forward", "model::forward": "model", "model::load": "load",
        "runtime::warmup": "warmup", "embedding::lookup": "gather", "kv_cache::update": "kv_cache"}
_LAYER_NAME = re.compile(r"^transformer\[(\d+)\]")
_LAYER_DETAIL = re.compile(r"\blayer=(\d+)\b")
_DTYPE = re.compile(r"^(F32|F16|BF16|Q\d\w*|IQ\w+|TQ\w+)$")


def op_of(name: str) -> str:
    """The op kind of an event name (derived from the name alone, so logs and records agree)."""
    if name in _OPS:
        return _OPS[name]
    if name.startswith("transformer["):
        return "block"
    if name.startswith("generator::"):
        return "generator"
    if name.startswith("quant::matmul"):
        return "quant_matmul"
    return name.split("::")[0]


def _fmt3(x) -> float:
    return float(f"{float(x):.3f}")


def _fmt6(x) -> float:
    return float(f"{float(x):.6f}")


def normalize(raws: list[dict], main_thread: int | None = None,
              threads: dict | None = None) -> tuple[list[Record], int]:
    """Records (in the given post-order) with the tree linked and derived fields set.

    `raws` are dicts with id, parent, name, dur_ms, start and optionally details,
    parts, module, phase, step, thread, line, orphan. Returns (records, orphans):
    orphans are events whose enclosing span never ended (an exception or an
    interrupted run); they are kept as top-level events outside any phase (a log
    cannot tell their phase, and a partial step would skew the step tables). With `main_thread`, thread idents become
    track numbers (main = 0); `threads` keeps that numbering across calls.
    """
    recs, lost = [], set()
    threads = {} if threads is None else threads
    for r in raws:
        if r.get("orphan"):
            lost.add(r["id"])
        t = r.get("thread", 0)
        if main_thread is not None:
            t = 0 if t == main_thread else threads.setdefault(t, len(threads) + 1)
        recs.append(Record(id=r["id"], parent=r.get("parent"), name=r["name"], dur_ms=_fmt3(r["dur_ms"]),
                           start=_fmt6(r["start"]), details=r.get("details") or "",
                           parts={k: _fmt3(v) for k, v in (r.get("parts") or {}).items()},
                           module=r.get("module") or None, phase=r.get("phase"), step=r.get("step"),
                           thread=t, worker=r.get("worker") or 0, line=r.get("line", 0),
                           compiled=bool(r.get("compiled"))))
    index = {r.id: r for r in recs}
    orphans = 0
    for r in recs:  # children in the order they ended
        p = index.get(r.parent) if r.parent is not None else None
        if (r.parent is not None and p is None) or r.id in lost:
            orphans += 1
            lost.add(r.id)
            r.parent, r.phase, r.step, r.orphan = None, None, None, True
        r.parent_rec = p
        if p is not None:
            p.children.append(r)
    for r in reversed(recs):  # reversed post-order: every parent before its children
        p = r.parent_rec
        r.depth = p.depth + 1 if p else 0
        if p is not None and p.id in lost:  # inside an orphan: no phase either
            lost.add(r.id)
            r.phase = r.step = None
        elif p is not None:
            if r.phase is None:
                r.phase = p.phase
            if r.step is None and r.phase == p.phase:
                r.step = p.step
        r.op = op_of(r.name)
        m = _LAYER_NAME.match(r.name) or _LAYER_DETAIL.search(r.details)
        r.layer = int(m.group(1)) if m else (p.layer if p else None)
        r.owner = r.module or (p.owner if p else None)
        if r.op in ("linear", "gather") and r.details:
            last = r.details.rsplit(" ", 1)[-1]
            r.dtype = last if _DTYPE.match(last) else None
        elif r.op == "quant_matmul":
            r.dtype = r.name.rsplit("_f32_", 1)[-1].upper()
        if r.op == "attention":
            r.kind = "sliding" if " sliding " in f" {r.details} " else "global"
    for r in recs:
        r.self_ms = max(0.0, r.dur_ms - sum(c.dur_ms for c in r.children))
        if r.op == "block":
            r.kind = next((c.kind for c in r.children if c.op == "attention"), None)
    return recs, orphans


# --- events.jsonl --------------------------------------------------------------------------

_REQUIRED = {"id": int, "name": str, "dur_ms": (int, float), "start": (int, float)}


def _not_a_profile(path, wrong: str) -> EventsFormatError:
    return EventsFormatError(f"{path}: not a pyml profile: its first line is no perf event ({wrong}); "
                             f"pyml.profile(dir) and pyml-infer --profile DIR write one")


def read_events(path: Path) -> list[dict]:
    """Raw dicts from an events.jsonl, with a one-line error naming the line for bad input."""
    raws = []
    with open(path, "rb") as f:
        data = f.read()
    text = data.decode("utf-8", errors="replace")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    elif lines:
        raise EventsFormatError(f"{path}:{len(lines)}: truncated: the last record has no end of line "
                                f"(the run was cut off while writing it)")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            wrong = f"not a JSON record ({e.msg} at column {e.colno})"
            raise (_not_a_profile(path, wrong) if not raws else EventsFormatError(f"{path}:{n}: {wrong}")) from None
        if not isinstance(r, dict):
            wrong = f"expected a JSON object, got {type(r).__name__}"
            raise _not_a_profile(path, wrong) if not raws else EventsFormatError(f"{path}:{n}: {wrong}")
        for k, types in _REQUIRED.items():
            wrong = (f"record has no {k!r} field" if k not in r else
                     f"field {k!r} has the wrong type ({type(r[k]).__name__})"
                     if not isinstance(r[k], types) or isinstance(r[k], bool) else None)
            if wrong:  # on the first record: some other JSONL, not a profile cut short
                raise _not_a_profile(path, wrong) if not raws else EventsFormatError(f"{path}:{n}: {wrong}")
        if r.get("parent") is not None and not isinstance(r["parent"], int):
            raise EventsFormatError(f"{path}:{n}: field 'parent' must be an integer or null")
        if r.get("worker") is not None and (not isinstance(r["worker"], int) or isinstance(r["worker"], bool)
                                            or r["worker"] < 0):
            raise EventsFormatError(f"{path}:{n}: field 'worker' must be a non-negative integer")
        if r.get("parts") is not None and not isinstance(r["parts"], dict):
            raise EventsFormatError(f"{path}:{n}: field 'parts' must be an object")
        r["line"] = n
        raws.append(r)
    return raws


# --- saved stderr logs -----------------------------------------------------------------------

_PERF = "[perf] "
_LINE = re.compile(r"^(?P<body>\S.*?) (?P<total>total=)?(?P<ms>\d+\.\d{3})ms(?: \| (?P<ctx>.*))?$")
_PARTS = re.compile(r"(?: [A-Za-z_]\w*=\d+\.\d{3}ms)+$")
_CTX_KEYS = {"depth": int, "start": float, "phase": str, "step": int, "thread": int, "compiled": int}


def _parse_context(ctx: str):
    out, tokens = {}, ctx.split(" ")
    if tokens and "=" not in tokens[0]:
        out["module"] = tokens.pop(0)
    for tok in tokens:
        k, sep, v = tok.partition("=")
        if not sep or k not in _CTX_KEYS:
            return None
        try:
            out[k] = _CTX_KEYS[k](v)
        except ValueError:
            return None
    if "depth" not in out or "start" not in out:
        return None
    return out


def parse_log_line(text: str) -> dict | None:
    """The fields of one `[perf]` line body (the text after `[perf] `), or None if unreadable."""
    m = _LINE.match(text)
    if not m:
        return None
    body, ctx = m.group("body"), m.group("ctx")
    rec = {"dur_ms": float(m.group("ms")), "parts": {}}
    if ctx is not None:
        c = _parse_context(ctx)
        if c is None:
            return None
        rec.update(c)
    name, _, rest = body.partition(" ")
    if m.group("total"):
        pm = _PARTS.search(" " + rest)
        if pm:
            for tok in pm.group(0).split():
                k, _, v = tok.partition("=")
                rec["parts"][k] = float(v[:-2])
            rest = (" " + rest)[:pm.start()].strip()
    rec["name"], rec["details"] = name, rest
    return rec


def read_log(path: Path) -> tuple[list[dict], dict]:
    """Raw dicts (post-order, parents linked) from a saved stderr log, and what else it says.

    Other lines (warnings, the generated text, the summary) are skipped; the model
    description and the run summary are kept for the report's header. Lines may come in
    either order pyml writes: a tree (a top-level line, then the lines inside it, parent first,
    indented by depth) or flat (children first, as spans end). A log written before the lines
    carried their context is put back together by report.old_logs.
    """
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    lines = text.split("\n")
    ends_cleanly = lines[-1] == ""
    if ends_cleanly:
        lines.pop()
    info, raws, threads = {}, [], {}
    pending: dict[int, list] = {}  # thread -> flat lines waiting for their parent: (depth, rec)
    trees: dict[int, list] = {}    # thread -> the open path of its tree, top-level first: (depth, rec)
    for n, line in enumerate(lines, 1):
        at = line.find(_PERF)
        if at < 0:
            s = line.strip()
            if s.startswith("debug: ") and ": layers=" in s:
                info.setdefault("describe", s[len("debug: "):])
            elif s.startswith("[prompt ") and s.endswith("]"):
                info["summary"] = s[1:-1]
            continue
        if n == len(lines) and not ends_cleanly:
            raise LogFormatError(f"{path}:{n}: truncated: the last [perf] line has no end of line")
        body = line[at + len(_PERF):].rstrip("\r")
        rec = parse_log_line(body.lstrip(" "))
        if rec is None:
            raise LogFormatError(f"{path}:{n}: cannot read this [perf] line: {line[at:at + 100]!r}")
        legacy = "depth" not in rec
        if raws and legacy != (info.get("legacy", False)):
            raise LogFormatError(f"{path}:{n}: this [perf] line {'lacks' if legacy else 'has'} the ' | depth= "
                                 f"start=' context that the lines before it {'have' if legacy else 'lack'} "
                                 f"(two runs of different pyml versions in one log?)")
        info["legacy"] = legacy
        tid = rec.pop("thread", None)
        rec["thread"] = 0 if tid is None else threads.setdefault(tid, len(threads) + 1)
        rec["id"], rec["parent"], rec["line"] = len(raws) + 1, None, n
        raws.append(rec)
        if legacy:
            rec["start"] = 0.0
            continue
        depth, start = rec.pop("depth"), rec["start"]
        if body.startswith(" "):  # tree order: inside the open line one level up
            info["tree"] = True
            path_open = trees.setdefault(rec["thread"], [])
            while path_open and path_open[-1][0] >= depth:
                path_open.pop()
            up = path_open[-1][1] if path_open and path_open[-1][0] == depth - 1 else None
            if up is not None and up["start"] <= start <= up["start"] + up["dur_ms"] / 1e3 + 2e-6:
                rec["parent"] = up["id"]
            else:  # its parent's line never came (a span that raised): not the open line's child
                rec["orphan"] = True
            path_open.append((depth, rec))
            continue
        stack = pending.setdefault(rec["thread"], [])
        while stack and stack[-1][0] > depth and stack[-1][1]["start"] >= start:
            stack.pop()[1]["parent"] = rec["id"]
        stack.append((depth, rec))
        if depth == 0:
            trees[rec["thread"]] = [(0, rec)]
    for stack in pending.values():  # never adopted although nested: their parent never ended
        for depth, rec in stack:
            if depth > 0:
                rec["orphan"] = True
    if not raws:
        raise LogFormatError(f"{path}: not a pyml profile or log: no [perf] lines "
                             f"(a log needs LOG=trace or --log trace)")
    if info.get("legacy"):
        old_logs.link(raws)
    if info.get("tree"):
        raws = _post_order(raws)
    return raws, info


def _post_order(raws: list[dict]) -> list[dict]:
    """Linked raw dicts in the order their spans ended (each child before its parent), as flat
    lines and records come; top-level trees in the order of their lines."""
    kids: dict[int, list] = {}
    roots = []
    for r in raws:
        (roots if r["parent"] is None else kids.setdefault(r["parent"], [])).append(r)
    out = []
    for root in roots:
        todo = [(root, False)]
        while todo:
            r, done = todo.pop()
            if done:
                out.append(r)
                continue
            todo.append((r, True))
            todo.extend((k, False) for k in reversed(kids.get(r["id"], ())))
    return out


# --- a run: its records and what is known about it -------------------------------------------

@dataclass
class Run:
    records: list
    info: dict
    source: str
    kind: str                      # profile | events | log
    notes: list = field(default_factory=list)

    def decode_steps(self) -> list:
        """The decode steps' records: one sequence's (`generator::decode_step`) or a batched forward in
        which some sequence decodes (`generator::batch_step` stamped phase=decode)."""
        return [r for r in self.records if r.name in STEP_EVENTS and r.phase == "decode"]

    def named(self, name: str, phase: str | None = None) -> list:
        return [r for r in self.records if r.name == name and (phase is None or r.phase == phase)]

    def roots(self, phases=None) -> list:
        return [r for r in self.records if r.parent_rec is None and (phases is None or r.phase in phases)]

    @property
    def label(self) -> str:
        m = self.info.get("model") or {}
        return m.get("name") or m.get("source") or self.source


def _model_from_records(records) -> dict:
    load = next((r for r in records if r.name == "model::load"), None)
    return {"source": load.details} if load else {}


_NUMBER = (int, float)
# the types capture.py writes run.json's fields as (null allowed): an edited or damaged file is named, not a crash
RUN_FIELDS = {"threads": int, "events": int, "main_thread": int, "warmup": bool, "t0": _NUMBER,
              "load_s": _NUMBER, "warmup_s": _NUMBER, "compile_s": _NUMBER, "duration_s": _NUMBER,
              "started": str, "status": str, "cwd": str, "command": list,
              **dict.fromkeys(("timing", "model", "generation", "machine_use", "overhead", "read_bandwidth",
                               "env", "machine", "git"), dict)}


def _read_info(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        info = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ReportInputError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(info, dict):
        raise ReportInputError(f"{path}: not a run description (a JSON {type(info).__name__}, not an object)")
    for key, kind in RUN_FIELDS.items():
        value = info.get(key)
        if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
            raise ReportInputError(f"{path}: \"{key}\" is a {type(value).__name__}, where pyml writes "
                                   f"{' or '.join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))}")
    return info


def load_run(path) -> Run:
    """A profile directory, an events.jsonl file, or a saved stderr log."""
    p = Path(path)
    if not p.exists():
        raise ReportInputError(f"{p}: no such file or directory")
    notes = []
    if p.is_dir():
        events = p / "events.jsonl"
        if not events.is_file():
            raise ReportInputError(f"{p}: not a profile directory (no events.jsonl; write one with "
                                   f"pyml.profile(dir) or pyml-infer --profile DIR)")
        info = _read_info(p / "run.json")
        recs, orphans = normalize(read_events(events))
        kind = "profile"
    else:
        with open(p, "rb") as f:
            head = f.read(4096).lstrip()
        if b"\0" in head:  # a model file, an archive: not read whole to find no [perf] line in it
            raise ReportInputError(f"{p}: not a pyml profile or log: a binary file")
        if head.startswith(b"{"):
            recs, orphans = normalize(read_events(p))
            info, kind = _read_info(p.parent / "run.json"), "events"
        else:
            raws, log_info = read_log(p)
            recs, orphans = normalize(raws)
            info = {"model": {"describe": log_info.get("describe")}, "summary": log_info.get("summary")}
            kind = "log"
            if log_info.get("legacy"):
                notes.append(old_logs.NOTE)
    if not recs:
        raise ReportInputError(f"{p}: no events recorded")
    info.setdefault("model", {})
    for k, v in _model_from_records(recs).items():
        info["model"].setdefault(k, v)
    run = Run(recs, info, str(p), kind, notes)
    if orphans:
        run.notes.append(f"{orphans} events belong to spans that never ended (an interrupted run or a "
                         f"log cut short); they are counted as top-level events outside any phase")
    return run
