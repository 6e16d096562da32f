"""The numbers the reports print: pure functions of a Run's records.

Every event's time is split once into *pieces* of self time — the part of its
duration not spent in a child event — each with a label (`matmul:mlp.c_fc`,
`softmax`, `attention (other)`, `sample`) and a category (output head, FFN
projections, attention core, glue, ...). A span's timed parts that no child event
covers (at debug level: `attn=`, `ffn=`, `sample=`) become pieces of their own.
The pieces of a tree add up to its top-level duration, so every table built from
them sums to 100%.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from pyml.report.records import STEP_EVENTS

HEAD, FFN, ATTN_PROJ, ATTN_CORE = "output head", "FFN projections", "attention projections", "attention core"
ACT, NORM, EMB, SAMPLE = "activations", "norms", "embedding", "sampling"
GLUE, OTHER = "glue (Python/NumPy between ops)", "other ops"
ATTN_COARSE, FFN_COARSE = "attention (debug level: not split)", "FFN (debug level: not split)"
LOAD, WARMUP = "load", "warm-up"
PHASES = ("load", "warmup", "prefill", "decode")
GENERATION = ("prefill", "decode")

_LEAF_CATEGORY = {"gather": EMB, "layer_norm": NORM, "rms_norm": NORM, "gelu": ACT, "silu": ACT,
                  "gated_act": ACT, "kv_cache": ATTN_CORE, "rope": ATTN_CORE, "softmax": ATTN_CORE,
                  "sdpa": ATTN_CORE, "batched_matmul": ATTN_CORE, "matmul": ATTN_CORE}
# the attention core's ops: each sequence's attention over its own cache (a batched step shares them by sequence)
ATTN_CORE_OPS = frozenset(op for op, cat in _LEAF_CATEGORY.items() if cat == ATTN_CORE)
_CONTAINERS = {"generator", "model", "block", "attention", "feed_forward", "load", "warmup"}
# a timed part no child event covers becomes a piece: part -> (child ops that would cover it, label, category)
_UNCOVERED_PARTS = {
    "embedding": ({"gather"}, "gather", EMB),
    "norm": ({"layer_norm", "rms_norm"}, "norm", NORM),
    "projection": ({"linear", "quant_matmul"}, "matmul:lm_head", HEAD),
    "attn": ({"attention"}, "attention", ATTN_COARSE),
    "ffn": ({"feed_forward"}, "feed_forward", FFN_COARSE),
    "sample": (set(), "sample", SAMPLE),
}
_MODULE_TYPES = {"linear": "Linear", "quant_matmul": "Linear", "attention": "Attention",
                 "feed_forward": "MLP", "block": "Block", "model": "Model", "gather": "Embedding"}
_LAYER_PREFIX = re.compile(r"^.*?\.\d+\.(.+)$")
_LINEAR = re.compile(r"\[(\d+), (\d+)\]->\[(\d+), (\d+)\] (\S+)")


def short_module(path: str | None) -> str:
    """`transformer.h.3.mlp.c_fc` -> `mlp.c_fc`; `lm_head` stays."""
    if not path:
        return "?"
    m = _LAYER_PREFIX.match(path)
    return m.group(1) if m else path


def _section(rec) -> str | None:
    p = rec.parent_rec
    while p is not None and p.op not in ("attention", "feed_forward", "model", "block"):
        p = p.parent_rec
    return p.op if p is not None else None


def pieces(rec) -> list:
    """[(label, category, ms)] splitting rec.self_ms."""
    op = rec.op
    if op in ("linear", "quant_matmul"):
        label = "matmul:" + short_module(rec.owner)
        sec = _section(rec)
        cat = {"attention": ATTN_PROJ, "feed_forward": FFN, "model": HEAD}.get(sec, OTHER)
        if rec.owner == "lm_head":
            cat = HEAD
        return [(label, cat, rec.self_ms)]
    if op not in _CONTAINERS and not rec.children and not rec.parts:
        cat = _LEAF_CATEGORY.get(op, OTHER)
        if op == "matmul" and _section(rec) != "attention":
            cat = OTHER
        return [(op, cat, rec.self_ms)]
    out, left = [], rec.self_ms
    child_ops = {c.op for c in rec.children}
    for part, ms in rec.parts.items():
        spec = _UNCOVERED_PARTS.get(part)
        if spec and not (spec[0] & child_ops):
            take = min(ms, left)
            left -= take
            out.append((spec[1], spec[2], take))
    cat = {"load": LOAD, "warmup": WARMUP}.get(op, GLUE)
    out.append((f"{op} (other)", cat, left))
    return out


def scope(records) -> tuple | None:
    """Prefill + decode when the run generated; otherwise every event (e.g. bare forward passes)."""
    return GENERATION if any(r.phase in GENERATION for r in records) else None


def in_phases(records, phases):
    return [r for r in records if phases is None or r.phase in phases]


def is_call(rec) -> bool:
    """False for a quantized kernel inside its Linear: the same matmul, not a second call."""
    return not (rec.op == "quant_matmul" and rec.parent_rec is not None and rec.parent_rec.op == "linear")


# --- tables of self time ---------------------------------------------------------------

def label_table(records, phases=None, by_layer: bool = False) -> dict:
    """label -> {ms, calls, category} over the records of `phases` (calls: events contributing)."""
    out = defaultdict(lambda: {"ms": 0.0, "calls": 0, "category": None})
    for r in in_phases(records, phases):
        for label, cat, ms in pieces(r):
            if by_layer and r.layer is not None:
                label = f"{label}:L{r.layer}"
            row = out[label]
            row["ms"] += ms
            row["calls"] += is_call(r)
            row["category"] = cat
    return dict(out)


def category_table(records, phases=None) -> dict:
    out = defaultdict(float)
    for r in in_phases(records, phases):
        for _, cat, ms in pieces(r):
            out[cat] += ms
    return dict(out)


def module_table(records, phases=GENERATION) -> dict:
    """Per module: self time of everything it owns that no child module owns (sums to the total)."""
    rows = defaultdict(lambda: {"ms": 0.0, "calls": 0, "type": None, "dtype": None})
    events = 0
    for r in in_phases(records, phases):
        events += 1
        key = r.owner or f"({r.op})"
        row = rows[key]
        row["ms"] += r.self_ms
        own_call = r.module == key and (r.parent_rec is None or r.parent_rec.owner != key)
        if own_call or r.owner is None:  # a quant kernel inside its Linear is not another call
            row["calls"] += 1
            row["type"] = row["type"] or _MODULE_TYPES.get(r.op, r.op.capitalize())
            row["dtype"] = row["dtype"] or r.dtype
    total = sum(v["ms"] for v in rows.values())
    table = []
    for mod, v in rows.items():
        calls = v["calls"] or 1
        table.append({"module": mod, "type": v["type"] or "?", "dtype": v["dtype"], "calls": v["calls"],
                      "total_ms": v["ms"], "per_call_ms": v["ms"] / calls,
                      "pct": 100.0 * v["ms"] / total if total else 0.0})
    table.sort(key=lambda x: -x["total_ms"])
    return {"rows": table, "total_ms": total, "modules": len(table), "events": events,
            "phases": list(phases) if phases else "all"}


# --- the run's timeline ------------------------------------------------------------------

def _int_detail(rec, key):
    m = re.search(rf"\b{key}=(\d+)", rec.details)
    return int(m.group(1)) if m else None


def _child(rec, op):
    return next((c for c in rec.children if c.op == op), None)


def prefills(run) -> list:
    out = []
    for r in run.named("generator::prefill"):
        fwd = _child(r, "model")
        out.append({"tokens": _int_detail(r, "tokens"), "ms": r.dur_ms, "sample": r.parts.get("sample", 0.0),
                    "forward": fwd.parts if fwd else {}})
    return out


def step_breakdowns(run) -> list:
    """One dict per decode step: its total and components (debug-level parts), and its layers."""
    steps = []
    for r in run.decode_steps():
        fwd = _child(r, "model")
        parts = fwd.parts if fwd else {}
        blocks = sorted((c for c in fwd.children if c.op == "block"), key=lambda b: b.layer) if fwd else []
        s = {"step": r.step, "token": _int_detail(r, "token"), "total": r.dur_ms,
             "tokens": _int_detail(r, "decoding") or 1,  # a batched step chooses one token per decoding sequence
             "model": r.parts.get("model", fwd.dur_ms if fwd else 0.0), "sample": r.parts.get("sample", 0.0)}
        for k in ("embedding", "layers", "norm", "projection"):
            s[k] = parts.get(k, 0.0)
        s["other"] = s["total"] - sum(s[k] for k in ("embedding", "layers", "norm", "projection", "sample"))
        s["layer_ms"] = [b.dur_ms for b in blocks]
        s["attn"] = [b.parts.get("attn", 0.0) for b in blocks]
        s["ffn"] = [b.parts.get("ffn", 0.0) for b in blocks]
        steps.append(s)
    return steps


def timeline(run) -> dict:
    load = run.named("model::load")
    warm = run.named("runtime::warmup")
    pre = prefills(run)
    steps = step_breakdowns(run)
    d = [s["total"] for s in steps]
    out = {"load_ms": sum(r.dur_ms for r in load) if load else None,
           "load_source": load[0].details if load else None,
           "warmup_ms": sum(r.dur_ms for r in warm) if warm else None,
           "generations": len(pre), "prefill": pre[0] if pre else None,
           "decode_steps": len(steps), "decode_mean_ms": statistics.fmean(d) if d else None,
           "decode_median_ms": statistics.median(d) if d else None,
           "decode_tok_s": 1e3 * sum(s["tokens"] for s in steps) / sum(d) if d else None,
           "decode_batched": any(s["tokens"] > 1 for s in steps),
           "decode_mean_sequences": statistics.fmean(s["tokens"] for s in steps) if steps else None,
           "ttft_ms": pre[0]["ms"] if pre else None}
    if pre and pre[0]["tokens"]:
        out["prefill_ms_per_token"] = pre[0]["ms"] / pre[0]["tokens"]
        out["prefill_tok_s"] = 1e3 * pre[0]["tokens"] / pre[0]["ms"] if pre[0]["ms"] else None
    return out


def workers(run) -> list:
    """One row per worker process of a run spread over several (pyml-batch --ray): what each did."""
    rows = {}
    for r in run.records:
        if r.parent_rec is not None:
            continue
        row = rows.setdefault(r.worker, {"worker": r.worker, "generations": 0, "prompt_tokens": 0,
                                         "prefill_ms": 0.0, "decode_steps": 0, "decode_ms": 0.0, "load_ms": 0.0})
        if r.name == "generator::prefill":
            row["generations"] += 1
            row["prompt_tokens"] += _int_detail(r, "tokens") or 0
            row["prefill_ms"] += r.dur_ms
        elif r.name in STEP_EVENTS and r.phase == "decode":
            row["decode_steps"] += 1
            row["decode_ms"] += r.dur_ms
        elif r.name == "model::load":
            row["load_ms"] += r.dur_ms
    for row in rows.values():
        row["decode_tok_s"] = 1e3 * row["decode_steps"] / row["decode_ms"] if row["decode_ms"] else None
    return [rows[w] for w in sorted(rows)]


COMPONENTS = ("embedding", "layers", "norm", "projection", "sample", "other")


def components(steps) -> dict:
    """Mean, min and max per decode-step component, and its share of the mean step."""
    if not steps:
        return {}
    total = statistics.fmean(s["total"] for s in steps)
    out = {}
    for k in COMPONENTS:
        vals = [s[k] for s in steps]
        mean = statistics.fmean(vals)
        out[k] = {"mean": mean, "min": min(vals), "max": max(vals), "pct": 100.0 * mean / total if total else 0}
    out["total"] = {"mean": total, "min": min(s["total"] for s in steps), "max": max(s["total"] for s in steps),
                    "pct": 100.0}
    return out


# --- layers -------------------------------------------------------------------------------

def mixed_steps(run) -> set:
    """The decode steps (by step number) of a batched run in which prompt rows went beside the
    decode rows (`rows` > `decoding`): a decode step to the sequences that decoded in it, but its
    layers multiply and attend over the prompts' rows too."""
    return {r.step for r in run.decode_steps()
            if r.name == "generator::batch_step" and (_int_detail(r, "rows") or 0) > (_int_detail(r, "decoding") or 0)}


def table_steps(run) -> tuple:
    """(how many decode steps the per-layer and matmul tables cover, the tokens one of them chooses
    on average): every decode step but the mixed ones (_in_phase)."""
    mixed = mixed_steps(run)
    steps = [r for r in run.decode_steps() if r.step not in mixed] or run.decode_steps()
    tokens = [_int_detail(r, "decoding") or 1 for r in steps]
    return len(steps), (sum(tokens) / len(tokens) if tokens else 1.0)


def _in_phase(run, phase):
    """A predicate on records: in `phase`, and for decode, in a step of decode rows only (mixed_steps
    left out, unless every decode step is mixed): the per-layer and per-matmul tables describe a
    decode step, and a step that also prefilled 262 prompt rows is not one."""
    mixed = mixed_steps(run) if phase == "decode" else set()
    if mixed and len(mixed) == len(run.decode_steps()):
        mixed = set()
    return lambda r: r.phase == phase and r.step not in mixed


def blocks_by_layer(run, phase) -> dict:
    out = defaultdict(list)
    keep = _in_phase(run, phase)
    for r in run.records:
        if r.op == "block" and r.layer is not None and keep(r):
            out[r.layer].append(r)
    return dict(sorted(out.items()))


def layer_stats(run, phase) -> list:
    rows = []
    for layer, blocks in blocks_by_layer(run, phase).items():
        d = [b.dur_ms for b in blocks]
        a = [b.parts.get("attn", 0.0) for b in blocks]
        f = [b.parts.get("ffn", 0.0) for b in blocks]
        rows.append({"layer": layer, "kind": blocks[0].kind, "n": len(d), "mean": statistics.fmean(d),
                     "min": min(d), "max": max(d), "ratio": max(d) / min(d) if min(d) > 0 else None,
                     "attn": statistics.fmean(a), "ffn": statistics.fmean(f),
                     "attn_min": min(a), "attn_max": max(a), "ffn_min": min(f), "ffn_max": max(f)})
    return rows


def attn_ffn_by_phase(run) -> dict:
    out = {}
    for phase in GENERATION:
        rows = layer_stats(run, phase)
        if not rows:
            continue
        a = statistics.fmean(r["attn"] for r in rows)
        f = statistics.fmean(r["ffn"] for r in rows)
        out[phase] = {"attn": a, "ffn": f, "ratio": f / a if a else None,
                      "attn_pct": 100 * a / (a + f) if a + f else None}
    return out


def _assign_sections(block) -> list:
    """[(child, section)] for a block's children: norms go with the branch they belong to.

    Norms before the attention belong to it; between attention and FFN, all but the
    last follow the attention (Gemma's post-attention norm) and the last precedes the
    FFN; norms after the FFN follow it.
    """
    kids = block.children
    ia = next((i for i, c in enumerate(kids) if c.op == "attention"), None)
    jf = next((i for i, c in enumerate(kids) if c.op == "feed_forward"), None)
    out = []
    for i, c in enumerate(kids):
        if ia is None or jf is None:
            sec = "attn" if c.op == "attention" else "ffn" if c.op == "feed_forward" else "block"
        elif i <= ia:
            sec = "attn"
        elif i < jf:
            last_norm = max(k for k in range(ia + 1, jf))
            sec = "ffn" if i == last_norm else "attn"
        else:
            sec = "ffn"
        out.append((c, sec))
    return out


def _subtree(rec):
    yield rec
    for c in rec.children:
        yield from _subtree(c)


def _block_rows(b) -> dict:
    """(section, label) -> {ms, calls, details, category} of one block's own time, every µs once."""
    rows = {}
    for child, sec in _assign_sections(b):
        for r in _subtree(child):
            for label, cat, ms in pieces(r):
                row = rows.setdefault((sec, label), {"ms": 0.0, "calls": 0, "details": r.details, "category": cat})
                row["ms"] += ms
                row["calls"] += is_call(r)
    for label, cat, ms in pieces(b):
        row = rows.setdefault(("block", label), {"ms": 0.0, "calls": 0, "details": "", "category": cat})
        row["ms"] += ms
        row["calls"] += 1
    return rows


def _sections(per_op: dict) -> dict:
    sections = {}
    for sec in ("attn", "ffn", "block"):
        items = sorted(((k[1], v) for k, v in per_op.items() if k[0] == sec), key=lambda kv: -kv[1]["ms"])
        sections[sec] = {"ms": sum(v["ms"] for _, v in items), "rows": items}
    return sections


def layer_breakdown(run, layer: int, phase: str = "decode") -> dict | None:
    """Mean time per op inside one layer, grouped under attention and FFN (trace level)."""
    blocks = blocks_by_layer(run, phase).get(layer)
    if not blocks:
        return None
    n = len(blocks)
    rows = {}
    for b in blocks:
        for key, v in _block_rows(b).items():
            row = rows.setdefault(key, {"ms": 0.0, "calls": 0, "details": v["details"], "category": v["category"]})
            row["ms"] += v["ms"]
            row["calls"] += v["calls"]
    mean = {k: {**v, "ms": v["ms"] / n, "calls": v["calls"] / n} for k, v in rows.items()}
    return {"layer": layer, "phase": phase, "n": n, "total": statistics.fmean(b.dur_ms for b in blocks),
            "sections": _sections(mean), "traced": any(b.children for b in blocks),
            "attn_part": statistics.fmean(b.parts.get("attn", 0.0) for b in blocks),
            "ffn_part": statistics.fmean(b.parts.get("ffn", 0.0) for b in blocks)}


OUTLIER_FACTOR = 1.5   # a layer whose mean is this far from the median layer's (either way) is an outlier


def _quantile(sorted_vals, q):
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))]


def op_medians(run, phase: str = "decode") -> dict | None:
    """Per op inside a layer: the median of its own time over every layer of every step of `phase`,
    with the spread (10th-90th percentile) and the number of blocks it ran in; and the layers whose
    mean time is an outlier against the median layer (OUTLIER_FACTOR), named."""
    by_layer = blocks_by_layer(run, phase)
    blocks = [b for bs in by_layer.values() for b in bs]
    if not blocks:
        return None
    values: dict = {}
    for b in blocks:
        for key, v in _block_rows(b).items():
            row = values.setdefault(key, {"vals": [], "calls": [], "details": v["details"], "category": v["category"]})
            row["vals"].append(v["ms"])
            row["calls"].append(v["calls"])
    per_op = {}
    for key, v in values.items():
        vals = sorted(v["vals"])
        per_op[key] = {"ms": statistics.median(vals), "p10": _quantile(vals, 0.1), "p90": _quantile(vals, 0.9),
                       "blocks": len(vals), "calls": statistics.median(v["calls"]), "details": v["details"],
                       "category": v["category"]}
    totals = sorted(b.dur_ms for b in blocks)
    means = {layer: statistics.fmean(b.dur_ms for b in bs) for layer, bs in by_layer.items()}
    typical = statistics.median(means.values())
    outliers = [{"layer": k, "mean": m, "median_layer": typical, "factor": m / typical}
                for k, m in means.items() if typical > 0 and (m >= OUTLIER_FACTOR * typical
                                                              or m * OUTLIER_FACTOR <= typical)]
    return {"phase": phase, "n": len(blocks), "layers": len(by_layer), "steps": len(blocks) // max(len(by_layer), 1),
            "total": statistics.median(totals), "p10": _quantile(totals, 0.1), "p90": _quantile(totals, 0.9),
            "sections": _sections(per_op), "traced": any(b.children for b in blocks), "outliers": outliers}


# --- matmuls: bytes moved and bandwidth ------------------------------------------------

def bytes_per_weight(dtype: str | None) -> float | None:
    if dtype in ("F32",):
        return 4.0
    if dtype in ("F16", "BF16"):
        return 2.0
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[dtype]]
        return size / block
    except KeyError:  # an unknown type name: no bandwidth figure, nothing else depends on it
        return None


def linear_shape(rec):
    """(tokens, in, out, dtype) from a linear::forward's details, or None."""
    m = _LINEAR.search(rec.details)
    if not m:
        return None
    return int(m.group(1)), int(m.group(3)), int(m.group(4)), m.group(5)


def matmul_table(run, phase="decode") -> list:
    """Per projection label: ms per call, weight bytes, achieved GB/s (weights read once per call)."""
    rows = defaultdict(lambda: {"ms": 0.0, "calls": 0, "bytes": 0.0, "in": None, "out": None, "dtype": None,
                                "category": None})
    keep = _in_phase(run, phase)
    for r in run.records:
        if r.op != "linear" or not keep(r):
            continue
        shape = linear_shape(r)
        label = short_module(r.owner)
        row = rows[label]
        row["ms"] += r.dur_ms
        row["calls"] += 1
        row["category"] = pieces(r)[0][1]
        if shape:
            _, n_in, n_out, dtype = shape
            bpw = bytes_per_weight(dtype)
            row.update({"in": n_in, "out": n_out, "dtype": dtype})
            if bpw:
                row["bytes"] += n_in * n_out * bpw
    out = []
    for label, v in rows.items():
        gbs = v["bytes"] / (v["ms"] / 1e3) / 1e9 if v["ms"] and v["bytes"] else None
        out.append({"label": label, **v, "gb_s": gbs})
    return sorted(out, key=lambda x: -x["ms"])


# --- the cost of timing, and whether the numbers add up ------------------------------------

def spans_per_step(run, phase="decode", compiled: bool | None = None) -> float:
    """Spans per decode step (per phase); only those timed inside compiled code (compiled=True) or
    only the Python ones (False)."""
    steps = len(run.decode_steps()) if phase == "decode" else 1
    n = sum(1 for r in run.records if r.phase == phase and (compiled is None or r.compiled == compiled))
    return n / steps if steps else 0.0


def _span_costs(timing: dict | None) -> tuple:
    """(a Python span's cost as its parent sees it beyond its own reported time, a span timed in
    compiled code's: two counter reads), in ms; None where the timing was not measured."""
    if not timing or timing.get("span_overhead_us") is None:
        return None, None
    outside = max(0.0, timing["span_overhead_us"] - timing.get("span_floor_us", 0.0)) / 1e3
    return outside, 2 * timing.get("compiled_clock_ns", 0.0) / 1e6


def consistency(run, timing: dict | None) -> list:
    """Gaps between a span and what is timed inside it (decode, mean per step), next to the
    cost of the timing that sits in those gaps."""
    steps = run.decode_steps()
    if not steps:
        return []
    outside, compiled = _span_costs(timing)
    n = len(steps)
    checks = []

    def add(what, gap_total, spans):
        """spans: the records timed inside the gap (their own cost sits in it)."""
        n_compiled = sum(1 for r in spans if r.compiled)
        cost = (len(spans) - n_compiled) * outside + n_compiled * compiled if outside is not None else None
        checks.append({"check": what, "gap_ms": gap_total / n, "spans": len(spans) / n,
                       "timing_ms": cost / n if cost is not None else None})

    fwds = [f for s in steps for f in s.children if f.op == "model"]
    add("decode_step − (model + sample parts)",
        sum(s.dur_ms - sum(s.parts.values()) for s in steps), [])
    add("model part − model::forward", sum(s.parts.get("model", 0) for s in steps) - sum(f.dur_ms for f in fwds),
        fwds)
    add("model::forward − (embedding + layers + norm + projection)",
        sum(f.dur_ms - sum(f.parts.values()) for f in fwds), [])
    blocks = [c for f in fwds for c in f.children if c.op == "block"]
    add("layers part − Σ transformer[i]", sum(f.parts.get("layers", 0) for f in fwds)
        - sum(b.dur_ms for b in blocks), blocks)
    add("transformer[i] − (attn + ffn parts)", sum(b.dur_ms - sum(b.parts.values()) for b in blocks), [])
    attns = [c for b in blocks for c in b.children if c.op == "attention"]
    if attns and any(a.children for a in attns):
        add("attention::forward − Σ its ops", sum(a.self_ms for a in attns),
            [c for a in attns for c in a.children])
    return checks


def instrumentation_cost(run, timing: dict | None) -> dict | None:
    """Spans per decode step times the measured cost of one: a Python span's (two perf_counter
    reads and its bookkeeping), or, timed inside compiled code, two counter reads."""
    if not timing or timing.get("span_overhead_us") is None or not run.decode_steps():
        return None
    per_span = timing["span_overhead_us"]  # lines are made after the steps (perf's drain): not in them
    per_compiled = _span_costs(timing)[1] * 1e3
    n, n_compiled = spans_per_step(run), spans_per_step(run, compiled=True)
    step = statistics.fmean(s.dur_ms for s in run.decode_steps())
    ms = ((n - n_compiled) * per_span + n_compiled * per_compiled) / 1e3
    return {"spans_per_step": n, "compiled_per_step": n_compiled, "per_span_us": per_span,
            "per_compiled_us": per_compiled, "ms_per_step": ms, "pct": 100 * ms / step if step else 0}
