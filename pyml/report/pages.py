"""The three reports — bottlenecks (report.md), modules (modules.md), jitter (jitter.md) — as Docs."""

from __future__ import annotations

import statistics
from collections import Counter

from pyml.report import aggregate, contention, findings
from pyml.report.doc import Doc, ms, num, pct, ratio
from pyml.report.machine_section import jitter_causes_section, machine_section

_COMPONENT_NAMES = {"embedding": "Embedding", "layers": "Layers", "norm": "Norm",
                    "projection": "Projection (lm_head)", "sample": "Sample", "other": "Other (untimed)"}


def _model_line(run) -> str:
    m = run.info.get("model") or {}
    bits = [f"**Model**: `{m.get('source') or run.label}`"]
    if m.get("describe"):
        bits.append(f"`{m['describe']}`")
    if run.info.get("threads"):
        bits.append(f"{run.info['threads']} threads")
    mach = run.info.get("machine") or {}
    if mach:
        bits.append(f"{mach.get('cpu')} ({mach.get('usable_cores')} cores, "
                    f"{(mach.get('memory_bytes') or 0) / 2**30:.0f} GiB"
                    + (f", kernels for {mach['isa']}" if mach.get("isa") else "") + ")")
    return " · ".join(bits)


def _source_line(run) -> str:
    kind = {"profile": "profile directory", "events": "events file", "log": "saved stderr log"}[run.kind]
    text = f"Built from the {kind} `{run.source}` ({len(run.records):,} events)."
    git = run.info.get("git")
    if git:
        text += f" Code at `{git['commit'][:12]}`{' (with local changes)' if git.get('dirty') else ''}."
    if run.info.get("started"):
        text += f" Recorded {run.info['started']}."
    return text


def timing_of(run) -> tuple[dict | None, str]:
    """The measured cost of one span, and where the figure comes from."""
    t = run.info.get("timing")
    if t:
        return t, "measured when the profile started"
    return None, ""


def overhead_line(run) -> str | None:
    """What the recording added to this run's decode steps, as measured after it (run.json)."""
    o = run.info.get("overhead")
    if not o or o.get("pct") is None:
        return None
    what = "trace (records and `[perf]` lines)" if o.get("lines") else "trace recording"
    made = (f"; making the records{' and lines' if o.get('lines') else ''} after the steps took "
            f"{o['made_ms']:.2f} ms per step more" if o.get("made_ms") is not None else "")
    return (f"**Instrumentation**: {what} added **{o['pct']:+.1f}%** to this run's decode steps "
            f"({o['on_ms']:.2f} ms per step recorded, {o['off_ms']:.2f} ms not{made}; {o['method']}).")


# --- report.md ------------------------------------------------------------------------------

def report_page(run, layer: int | None = None, timing=None, timing_src="", plots=(), ranking=None) -> Doc:
    """ranking: findings.bottlenecks(run, timing), computed once for every page (default: here)."""
    ranking = findings.bottlenecks(run, timing) if ranking is None else ranking
    doc = Doc(f"Performance trace bottleneck report: {run.label}")
    doc.p(_model_line(run))
    doc.p(_source_line(run))
    for note in run.notes:
        doc.p(f"**Note**: {note}")
    tl = aggregate.timeline(run)
    steps = aggregate.step_breakdowns(run)
    _model_table(doc, run)

    doc.h("High-level timing")
    rows = []
    if tl["load_ms"] is not None:
        rows.append(["Load", ms(tl["load_ms"]), tl["load_source"] or ""])
    if tl["warmup_ms"] is not None:
        rows.append(["Warm-up", ms(tl["warmup_ms"]), _warmup_note(run)])
    pre = tl["prefill"]
    if pre:
        rows.append([f"Prefill ({pre['tokens']} tokens)", ms(pre["ms"]),
                     f"{ms(tl.get('prefill_ms_per_token'))}/token ({num(tl.get('prefill_tok_s'))} tok/s)"])
    if steps and tl["decode_batched"]:
        rows.append(["Decode (mean/batched step)", f"**{ms(tl['decode_mean_ms'])}**",
                     f"{num(tl['decode_tok_s'])} tok/s in all over {len(steps)} steps of {tl['decode_mean_sequences']:.1f} "
                     f"decoding sequences on average (median step {ms(tl['decode_median_ms'])})"])
    elif steps:
        rows.append(["Decode (mean/token)", f"**{ms(tl['decode_mean_ms'])}**",
                     f"{num(tl['decode_tok_s'])} tok/s over {len(steps)} steps (median {ms(tl['decode_median_ms'])})"])
    if tl["ttft_ms"] is not None:
        rows.append(["Time to first token", ms(tl["ttft_ms"]), "prompt in → first token sampled (after load)"])
    if tl["generations"] > 1:
        rows.append(["Generations", str(tl["generations"]), "the decode figures cover all of them"])
    doc.table(["Phase", "Time", "Notes"], rows, "lrl")
    _workers_section(doc, run)
    overhead = overhead_line(run)
    if overhead:
        doc.p(overhead)

    if steps:
        comps = aggregate.components(steps)
        doc.h("Decode breakdown (per step)")
        rows = [[_COMPONENT_NAMES[k], ms(comps[k]["mean"]), f"{ms(comps[k]['min'])}–{ms(comps[k]['max'])}",
                 pct(comps[k]["pct"])] for k in aggregate.COMPONENTS]
        rows.append(["**Total (decode_step)**", f"**{ms(comps['total']['mean'])}**",
                     f"{ms(comps['total']['min'])}–{ms(comps['total']['max'])}", "100.0%"])
        doc.table(["Component", "Mean", "Range", "% of total"], rows)
        doc.p("From each step's `model::forward` parts; *Other* is the step's time outside them "
              "(the sampler call, the cache bookkeeping, the parts' own clock reads).")

    _layer_section(doc, run, layer)
    _attn_ffn_section(doc, run)
    _head_section(doc, run, steps)
    _matmul_section(doc, run)

    machine_section(doc, run)
    if ranking:
        doc.h("Top bottlenecks (ranked by share of decode time)")
        for i, it in enumerate(ranking, 1):
            doc.h(f"{i}. {it['title']} — {ms(it['ms_per_step'])}/step, {pct(it['share'])} of decode", 3)
            if it["detail"]:
                doc.p(it["detail"])
            lines = [s["text"] + (f": `{s['command']}`" if s["command"] else "") for s in it["suggestions"]]
            if lines or it["mitigations"]:
                doc.items(lines + it["mitigations"])
        doc.p("Shares are of the summed decode-step time; every event's own time is counted once, in one "
              "category, so the categories add up to 100% (those under 1% are not listed). Machine contention "
              "is time lost waiting for a core, spread over the categories; it comes first when named and at "
              "least 10% of decode. Every option suggested was checked against what pyml accepts for this "
              "model and run, and its gain is worked out from this run's figures.")

    _methodology(doc, run, timing, timing_src)
    if plots:
        doc.h("Plots")
        for path, alt in plots:
            doc.image(path, alt)
    doc.h("Other outputs")
    doc.items(["`modules.md` — time per module and per op kind, per phase",
               "`jitter.md` — decode step and per-layer jitter, with the audit's verdict",
               "`trace.json` — the whole timeline: open it in https://ui.perfetto.dev or chrome://tracing"])
    return doc


def _warmup_note(run) -> str:
    """What the warm-up was: kernels compiled (the first run) or loaded from Numba's cache."""
    compile_s = run.info.get("compile_s")
    what = "thread pools started, one short forward"
    if compile_s is None:
        return f"kernels loaded or compiled, {what}"
    if compile_s >= 0.5:
        return f"**compiled {compile_s:.1f} s** (a first run: kernels into Numba's cache), {what}"
    return f"kernels from cache (compiling {compile_s:.2f} s), {what}"


def _workers_section(doc, run):
    rows = aggregate.workers(run)
    if len(rows) < 2:
        return
    doc.h("Workers")
    doc.table(["Worker", "Load", "Generations", "Prompt tokens", "Prefill", "Decode steps", "Decode", "Decode tok/s"],
              [[str(w["worker"]) if w["worker"] else "this process", ms(w["load_ms"]), str(w["generations"]),
                str(w["prompt_tokens"]), ms(w["prefill_ms"]), str(w["decode_steps"]), ms(w["decode_ms"]),
                num(w["decode_tok_s"])] for w in rows])
    doc.p("Each worker is a process of its own (a Ray actor) with its own copy of the model; the tables "
          "below merge every worker's records, and trace.json shows one process per worker.")


def _model_table(doc, run):
    m = run.info.get("model") or {}
    cfg = m.get("config") or {}
    if not cfg:
        return
    d = cfg.get("n_embd") or cfg.get("hidden_size") or cfg.get("dim")
    vocab = cfg.get("vocab_size")
    params = (m.get("linear_params") or 0) + (m.get("embedding_params") or 0)
    if m.get("tied_head"):  # the head is the embedding matrix: count it once
        params -= m.get("embedding_params") or 0
    types = ", ".join(f"{k}×{v}" for k, v in (m.get("weight_types") or {}).items())
    doc.table(["Model", "Arch", "Params", "Layers", "d_model", "Vocab", "Weights (linears)", "Fusions"],
              [[m.get("name") or m.get("source"), m.get("arch"), f"{params / 1e6:,.1f}M", m.get("layers"), d,
                f"{vocab:,}" if vocab else "—", types, m.get("fusions", 0)]], "llrrrrlr")


def _layer_section(doc, run, layer):
    """The ops inside a layer: the median over every layer and step (default), or one layer's mean."""
    layers = aggregate.blocks_by_layer(run, "decode")
    if not layers:
        return
    if layer is not None:
        bd = aggregate.layer_breakdown(run, layer, "decode")
        if bd is None:
            doc.h(f"Per-layer breakdown (layer {layer})")
            doc.p(f"Layer {layer} does not exist in this run (layers 0–{max(layers)}).")
            return
        doc.h(f"Per-layer breakdown (trace, layer {layer}, single-token decode, mean of {bd['n']} steps)")
        spread = False
    else:
        bd = aggregate.op_medians(run, "decode")
        doc.h(f"Per-layer breakdown (trace, single-token decode, median over {bd['layers']} layers × "
              f"{bd['steps']} steps)")
        spread = True
    _mixed_note(doc, run)
    if not bd["traced"]:
        doc.p("This run was recorded at debug level: the layer's ops were not timed. Record at trace level "
              "(`pyml.profile`, or `LOG=trace`) for this table.")
    rows = []
    names = {"attn": "Attention", "ffn": "FFN", "block": "Block"}
    for sec in ("attn", "ffn", "block"):
        s = bd["sections"][sec]
        for label, v in s["rows"]:
            calls = v["calls"]
            details = _short_details(v["details"])
            if spread and v["blocks"] < bd["n"]:  # its median is over the layers it ran in, not all of them
                details += f" (in {v['blocks'] / max(bd['steps'], 1):.0f} of {bd['layers']} layers)"
            row = [f"{names[sec]}: {label}", details,
                   f"{calls:.0f}" if calls == int(calls) else f"{calls:.1f}", ms(v["ms"])]
            if spread:
                row.append(f"{ms(v['p10'])}–{ms(v['p90'])}")
            rows.append(row + [pct(100 * v["ms"] / bd["total"]) if bd["total"] else "—"])
        if sec != "block" and s["rows"]:
            rows.append([f"**{names[sec]} total**", "", "", f"**{ms(s['ms'])}**"] + ([""] if spread else [])
                        + [pct(100 * s["ms"] / bd["total"]) if bd["total"] else "—"])
    if spread:
        rows.append(["**Layer (median)**", "", "", f"**{ms(bd['total'])}**", f"{ms(bd['p10'])}–{ms(bd['p90'])}",
                     "100.0%"])
        doc.table(["Op", "Details", "Calls", "Median", "p10–p90", "% of layer"], rows, "llrrrr")
        doc.p("Each op's own time (its duration minus the events inside it) in one layer of one step; the "
              "median over every layer of every decode step, and the spread between the 10th and 90th "
              "percentile. Medians of parts need not add up to the median layer. *(other)* rows are the Python "
              "and NumPy work between timed ops in that span, e.g. reshapes, masks and residual adds. "
              "`--layer N` shows one layer's means instead.")
        if bd["outliers"]:
            doc.p("**Outlier layers** (mean time at least 1.5x from the median layer's "
                  f"{ms(bd['outliers'][0]['median_layer'])}, which the medians above are not moved by): "
                  + ", ".join(f"layer {o['layer']} {ms(o['mean'])} ({o['factor']:.1f}x)" for o in bd["outliers"]))
    else:
        rows.append(["**Layer total**", "", "", f"**{ms(bd['total'])}**", "100.0%"])
        doc.table(["Op", "Details", "Calls", "Time", "% of layer"], rows, "llrrr")
        doc.p("Each event's own time (its duration minus the events inside it); *(other)* rows are the Python "
              "and NumPy work between timed ops in that span, e.g. reshapes, masks and residual adds.")
        outlier = next((o for o in (aggregate.op_medians(run, "decode") or {}).get("outliers", [])
                        if o["layer"] == layer), None)
        if outlier:
            doc.p(f"**Outlier**: this layer took {outlier['factor']:.1f}x the median layer's time; the default "
                  f"table (no `--layer`) gives the median over every layer.")


def _short_details(d: str) -> str:
    return d if len(d) <= 48 else d[:45] + "…"


def _attn_ffn_section(doc, run):
    by_phase = aggregate.attn_ffn_by_phase(run)
    if not by_phase:
        return
    doc.h("Attention vs FFN (per layer, mean)")
    doc.table(["Phase", "Attention", "FFN", "Ratio (FFN/Attn)", "Attn:FFN"],
              [[p.capitalize(), ms(v["attn"]), ms(v["ffn"]), ratio(v["ratio"]),
                f"{v['attn_pct']:.0f}:{100 - v['attn_pct']:.0f}" if v["attn_pct"] is not None else "—"]
               for p, v in by_phase.items()])
    pre = {r["layer"]: r for r in aggregate.layer_stats(run, "prefill")}
    dec = aggregate.layer_stats(run, "decode")
    if dec:
        rows = []
        for r in dec:
            p = pre.get(r["layer"])
            rows.append([r["layer"], r["kind"] or "", ms(p["attn"]) if p else "—", ms(p["ffn"]) if p else "—",
                         ms(r["attn"]), ms(r["ffn"]), ratio(r["ffn"] / r["attn"] if r["attn"] else None)])
        doc.table(["Layer", "Kind", "Prefill attn", "Prefill FFN", "Decode attn", "Decode FFN", "FFN/Attn (decode)"],
                  rows, "rlrrrrr")
    doc.p("The attention part is the pre-attention norm, the attention and its residual add; the FFN part likewise "
          "(the `attn=` and `ffn=` parts of `transformer[i]::forward`).")


def _head_section(doc, run, steps):
    if not steps:
        return
    comps = aggregate.components(steps)
    head = next((r for r in aggregate.matmul_table(run) if r["category"] == aggregate.HEAD), None)
    doc.h("Output head")
    lines = [f"Projection (final norm excluded): **{ms(comps['projection']['mean'])} per decode step, "
             f"{pct(comps['projection']['pct'])} of the step**"]
    if head:
        per_call = head["bytes"] / max(head["calls"], 1)
        lines.append(f"`lm_head` {head['in']:,} → {head['out']:,} {head['dtype']}: {per_call / 1e6:,.1f} MB of weights "
                     f"read per call (a call a decode step), {ms(head['ms'] / head['calls'])} per call"
                     + (f" = **{head['gb_s']:.3g} GB/s**" if head["gb_s"] else ""))
    m = run.info.get("model") or {}
    if m.get("tied_head"):
        lines.append("The head shares its weights with the token embedding (tied).")
    doc.items(lines)


def _mixed_note(doc, run):
    """Say which steps a per-layer or matmul table leaves out (aggregate.table_steps), if any."""
    steps, _ = aggregate.table_steps(run)
    left_out = len(run.decode_steps()) - steps
    if left_out:
        doc.p(f"Over the {steps} decode steps of decode rows only: the {left_out} steps in which prompt rows "
              "went beside the decode rows are left out.")


def _matmul_section(doc, run):
    rows = aggregate.matmul_table(run)
    if not rows:
        return
    steps, tokens = aggregate.table_steps(run)
    steps = steps or 1
    doc.h("Matmuls in decode: time and memory bandwidth")
    _mixed_note(doc, run)
    doc.table(["Projection", "Shape (in→out)", "Type", "Calls/step", "Time/step", "Weights/step", "GB/s"],
              [[r["label"], f"{r['in']}→{r['out']}" if r["in"] else "—", r["dtype"] or "—",
                num(r["calls"] / steps, 0), ms(r["ms"] / steps), f"{r['bytes'] / steps / 1e6:,.1f} MB",
                f"{r['gb_s']:.3g}" if r["gb_s"] else "—"] for r in rows], "llrrrrr")
    tot_b = sum(r["bytes"] for r in rows)
    tot_ms = sum(r["ms"] for r in rows)
    if tot_ms and tot_b:
        per = ("per token" if tokens == 1 else
               f"per step, for {tokens:.1f} tokens ({tot_b / steps / tokens / 1e6:,.1f} MB a token)")
        achieved = tot_b / (tot_ms / 1e3) / 1e9
        read = run.info.get("read_bandwidth") or {}
        ceiling = (f"{achieved / read['gb_s']:.0%} of the {read['gb_s']:.3g} GB/s this machine read at the run's end "
                   f"(a streaming sum over {read['bytes'] / 2**20:,.0f} MiB, {read['threads']} threads)"
                   if read.get("gb_s") and "bytes" in read and "threads" in read
                   else "no read bandwidth was measured for this run")
        doc.p(f"All projections: {tot_b / steps / 1e6:,.1f} MB of weights {per} in {ms(tot_ms / steps)} = "
              f"**{achieved:.3g} GB/s** achieved (a decode step reads every weight once): {ceiling}.")


def _methodology(doc, run, timing, timing_src):
    doc.h("Methodology")
    traced = any(r.op in ("linear", "attention") for r in run.records)
    doc.p("Every op and layer is timed by a `pyml.core.perf` span: two `perf_counter` reads around it, "
          "nested explicitly (each event knows its parent), stamped with the phase (load / warmup / prefill / "
          "decode) and the decode step. Levels: **debug** times phases, forward passes and layers (with their "
          "`embedding/layers/norm/projection` and `attn/ffn` parts); **trace** adds every op inside a layer "
          "(linear projections with shapes and weight type, attention, KV cache, norms, activations, embedding "
          f"lookups). This run was recorded at **{'trace' if traced else 'debug'}** level. With logging off a "
          "call site costs one attribute check: no clock read, no formatting.")
    n_steps = len(run.decode_steps())
    if n_steps:
        per_step = Counter(r.name for r in run.records if r.phase == "decode")
        rows = sorted(((k if not k.startswith("transformer[") else "transformer[i]::forward", v)
                       for k, v in per_step.items()), key=lambda x: x[0])
        merged = Counter()
        for k, v in rows:
            merged[k] += v
        doc.table(["Event", "Per decode step"], [[f"`{k}`", num(v / n_steps, 1)]
                                                  for k, v in sorted(merged.items(), key=lambda x: -x[1])], "lr")
    if timing:
        lines = [f"Recording one span costs **{timing['span_overhead_us']:.2f} µs** as seen by its parent "
                 f"(an empty span reports {timing['span_floor_us']:.2f} µs as its own duration; a clock read "
                 f"{timing.get('clock_us', 0) * 1e3:.0f} ns) — {timing_src}; {timing.get('method', '')}."]
        if timing.get("off_call_ns") is not None:
            lines.append(f"A call site with its level off: {timing['off_call_ns']:.0f} ns.")
        if timing.get("compiled_clock_ns") is not None:
            lines.append(f"An op timed inside compiled code reads the time-stamp counter twice: "
                         f"{timing['compiled_clock_ns']:.0f} ns a read.")
        if timing.get("made_us") is not None:
            lines.append(f"Its record is made after the steps, in bulk: {timing['made_us']:.2f} µs per span"
                         + (f", its `[perf]` text line {timing['line_us']:.2f} µs more" if timing.get("line_us")
                            else "") + " (time the run takes, not time the spans show).")
        cost = aggregate.instrumentation_cost(run, timing)
        if cost:
            inside = (f" ({cost['compiled_per_step']:.0f} of them timed inside compiled code, "
                      f"{cost['per_compiled_us'] * 1e3:.0f} ns each)" if cost["compiled_per_step"] else "")
            lines.append(f"A decode step records {cost['spans_per_step']:.0f} spans{inside}: the timing costs "
                         f"about **{ms(cost['ms_per_step'])} per step ({pct(cost['pct'])})**, estimated from "
                         f"these costs; untimed steps are that much faster, and the op times include it.")
        doc.items(lines)
    else:
        doc.p("The cost of one span was not measured for this run (reports from a log have no calibration): "
              "`pyml.report.timing.measure_timing_overhead()` measures it on this machine.")
    checks = aggregate.consistency(run, timing)
    if checks:
        doc.p("Do the parts add up? Gaps between a span and what is timed inside it (decode, mean per step), "
              "next to the cost of the spans recorded inside that gap:")
        doc.table(["Check", "Gap", "Spans in gap", "Their timing cost", "Untimed work"],
                  [[c["check"], f"{c['gap_ms'] * 1e3:.1f} µs", num(c["spans"], 0),
                    f"{c['timing_ms'] * 1e3:.1f} µs" if c["timing_ms"] is not None else "—",
                    f"{(c['gap_ms'] - c['timing_ms']) * 1e3:.1f} µs" if c["timing_ms"] is not None else "—"]
                   for c in checks], "lrrrr")
    doc.p("Durations are kept to the microsecond (a log prints ms with three decimals; events.jsonl is rounded "
          "the same way when read), so a report from a saved `LOG=trace` log and one from the profile directory "
          "of the same run are identical.")


# --- modules.md ----------------------------------------------------------------------------------

def modules_page(run, top: int = 30, ranking=None) -> Doc:
    ranking = findings.bottlenecks(run) if ranking is None else ranking
    doc = Doc(f"Modules and ops: {run.label}")
    doc.p(_model_line(run))
    doc.p(_source_line(run))
    mt = aggregate.module_table(run.records, aggregate.scope(run.records))
    _module_header(doc, run, mt)
    if ranking:
        doc.p(f"**Primary bottleneck**: {findings.first_bottleneck(ranking)} — the ranking of report.md; "
              f"the hotspot above is one module's own time over prefill and decode")
    _module_rows(doc, mt, top)
    doc.p("Total = time inside the module's events not spent in a child module's events (self time), so the "
          "rows add up to the total measured time. Ops without a module of their own (softmax, norms, KV cache) "
          "count toward the module around them; `(generator)` is sampling and the generation loop.")

    doc.h("Time per phase")
    ph = {p: sum(r.dur_ms for r in run.roots({p})) for p in (*aggregate.PHASES, None)}
    ph = {p: v for p, v in ph.items() if v}
    allt = sum(ph.values()) or 1.0
    doc.table(["Phase", "Time", "% of run", "Top-level events"],
              [[p or "(no phase)", ms(v), pct(100 * v / allt), len(run.roots({p}))] for p, v in ph.items()])

    doc.h("Per op kind and phase")
    tables = {p: aggregate.label_table(run.records, {p}) for p in aggregate.GENERATION}
    totals = {p: sum(v["ms"] for v in t.values()) or 1.0 for p, t in tables.items()}
    n_dec = len(run.decode_steps()) or 1
    labels = sorted(set(tables["prefill"]) | set(tables["decode"]),
                    key=lambda lbl: (-tables["decode"].get(lbl, {}).get("ms", 0),
                                     -tables["prefill"].get(lbl, {}).get("ms", 0)))
    rows = []
    for lbl in labels:
        p, d = tables["prefill"].get(lbl), tables["decode"].get(lbl)
        cat = (d or p)["category"]
        rows.append([lbl, cat, ms(p["ms"]) if p else "—", pct(100 * p["ms"] / totals["prefill"]) if p else "—",
                     ms(d["ms"]) if d else "—", pct(100 * d["ms"] / totals["decode"]) if d else "—",
                     num(d["calls"] / n_dec, 1) if d else "—",
                     num(1e3 * d["ms"] / d["calls"], 1) if d and d["calls"] else "—"])
    doc.table(["Op", "Category", "Prefill", "% prefill", "Decode", "% decode", "Decode calls/step", "Mean µs"],
              rows, "llrrrrrr")

    doc.h("Per category and phase")
    cats = {p: aggregate.category_table(run.records, {p}) for p in aggregate.GENERATION}
    names = sorted(set(cats["prefill"]) | set(cats["decode"]), key=lambda c: -cats["decode"].get(c, 0))
    doc.table(["Category", "Prefill", "% prefill", "Decode", "% decode", "Decode/step"],
              [[c, ms(cats["prefill"].get(c)), pct(100 * cats["prefill"].get(c, 0) / totals["prefill"]),
                ms(cats["decode"].get(c)), pct(100 * cats["decode"].get(c, 0) / totals["decode"]),
                ms(cats["decode"].get(c, 0) / n_dec)] for c in names])

    for phase in aggregate.GENERATION:
        kern = aggregate.label_table(run.records, {phase}, by_layer=True)
        if not kern:
            continue
        tot = sum(v["ms"] for v in kern.values()) or 1.0
        doc.h(f"Kernel profile: {phase} (top 40, by layer)")
        rows = sorted(kern.items(), key=lambda kv: -kv[1]["ms"])
        text = [f"{'Kernel':<40}{'Time (ms)':>12}{'%':>8}", "─" * 60]
        for lbl, v in rows[:40]:
            text.append(f"{lbl:<40}{v['ms']:>12.3f}{100 * v['ms'] / tot:>8.1f}")
        if len(rows) > 40:
            rest = sum(v["ms"] for _, v in rows[40:])
            text.append(f"{f'… {len(rows) - 40} more':<40}{rest:>12.3f}{100 * rest / tot:>8.1f}")
        text.append("─" * 60)
        text.append(f"{'Total':<40}{tot:>12.3f}{100.0:>8.1f}")
        doc.code("\n".join(text))
    return doc


def _module_header(doc, run, mt):
    threads = run.info.get("threads")
    doc.code("\n".join(["pyml report", f"modules profiled: {mt['modules']}", f"total events: {mt['events']}",
                        f"total measured time: {mt['total_ms']:.2f} ms",
                        f"phases: {', '.join(mt['phases']) if isinstance(mt['phases'], list) else mt['phases']}",
                        f"device: cpu{f' ({threads} threads)' if threads else ''}"]))
    rows = mt["rows"]
    if rows:
        top = rows[0]
        doc.p(f"**TOP HOTSPOT** `{top['module']}` · {top['total_ms']:.2f} ms · {top['pct']:.1f}% of total")
        head = next((r for r in rows if r["module"] == "lm_head"), None)
        if head:
            doc.p(f"**LM_HEAD** {head['total_ms']:.2f} ms · {head['pct']:.1f}%")


def _module_rows(doc, mt, top):
    rows = mt["rows"]
    shown = rows[:top]
    out = [[r["module"], r["type"] + (f" {r['dtype']}" if r["dtype"] else ""), r["calls"], f"{r['total_ms']:.2f}",
            f"{r['per_call_ms']:.3f}", f"{r['pct']:.1f}"] for r in shown]
    if len(rows) > top:
        rest = rows[top:]
        t = sum(r["total_ms"] for r in rest)
        out.append([f"… {len(rest)} more modules", "", sum(r["calls"] for r in rest), f"{t:.2f}", "",
                    f"{100 * t / mt['total_ms']:.1f}" if mt["total_ms"] else "0.0"])
    out.append(["**Total**", "", "", f"**{mt['total_ms']:.2f}**", "", "100.0"])
    doc.table(["Module", "Type", "Calls", "Total ms", "Per-call ms", "% of total"], out, "llrrrr")


# --- jitter.md ---------------------------------------------------------------------------------

def jitter_page(run, ranking=None) -> Doc:
    ranking = findings.bottlenecks(run) if ranking is None else ranking
    doc = Doc(f"Jitter analysis: {run.label}")
    doc.p(_model_line(run))
    doc.p(_source_line(run))
    steps = aggregate.step_breakdowns(run)
    if not steps:
        doc.p("No decode steps were recorded (`generator::decode_step`): nothing to analyse.")
        return doc
    doc.h("Decode step timings")
    doc.table(["Step", "Token", "Layers", "Projection", "Sample", "Total"],
              [[s["step"], s["token"], ms(s["layers"]), ms(s["projection"]), ms(s["sample"]), ms(s["total"])]
               for s in steps], "rrrrrr")
    totals = [s["total"] for s in steps]
    lines = [f"**Step jitter**: {ms(min(totals))}–{ms(max(totals))} "
             f"({ratio(max(totals) / min(totals) if min(totals) else None)} max/min) over {len(totals)} steps; "
             f"mean {ms(statistics.fmean(totals))}, stdev {ms(statistics.pstdev(totals))}"]
    if len(totals) > 2:
        st = totals[1:]
        lines.append(f"**Without the first step**: {ms(min(st))}–{ms(max(st))} "
                     f"({ratio(max(st) / min(st) if min(st) else None)})")
    doc.items(lines)

    layers = aggregate.layer_stats(run, "decode")
    if layers:
        every = [d for s in steps for d in s["layer_ms"]]
        attn = [a for s in steps for a in s["attn"]]
        ffn = [f for s in steps for f in s["ffn"]]
        af = aggregate.attn_ffn_by_phase(run).get("decode")
        doc.h("Layer-level analysis")
        doc.table(["Metric", "Value"], [
            ["Layer min", ms(min(every))], ["Layer max", ms(max(every))],
            ["Layer variance", f"**{ratio(max(every) / min(every) if min(every) else None)}** (max/min over every "
                               f"layer of every step)"],
            ["Slowest layer (mean)", f"{max(layers, key=lambda r: r['mean'])['layer']}"],
            ["Attention range", f"{ms(min(attn))}–{ms(max(attn))}"],
            ["FFN range", f"{ms(min(ffn))}–{ms(max(ffn))}"],
            ["Attention:FFN ratio", f"~{af['attn_pct']:.0f}:{100 - af['attn_pct']:.0f}" if af and af["attn_pct"]
             else "—"]], "ll")
        doc.table(["Layer", "Kind", "Mean", "Min", "Max", "Max/min", "Attn", "FFN"],
                  [[r["layer"], r["kind"] or "", ms(r["mean"]), ms(r["min"]), ms(r["max"]), ratio(r["ratio"]),
                    ms(r["attn"]), ms(r["ffn"])] for r in layers], "rlrrrrrr")

    comps = aggregate.components(steps)
    doc.h("Component breakdown")
    n_layers = len(layers)
    rows = []
    for k in aggregate.COMPONENTS:
        c = comps[k]
        name = _COMPONENT_NAMES[k] + (f" ({n_layers})" if k == "layers" and n_layers else "")
        rows.append([name, f"{ms(c['min'])}–{ms(c['max'])}", ms(c["mean"]), pct(c["pct"])])
    doc.table(["Component", "Range", "Mean", "% of total"], rows)

    jitter_causes_section(doc, run)
    v = findings.verdict(run, ranking)
    doc.h("Bottleneck summary")
    doc.items([f"**Status**: {v['status']}", f"**Primary bottleneck**: {v['primary']}",
               f"**Secondary**: {'; '.join(v['secondary'])}",
               f"**Optimization potential**: {v['potential']} ({v['because']})"])
    doc.p("Rules: the primary bottleneck is the first of report.md's ranking; potential is High from a 25% "
          "head, 40% glue or 2x step jitter, Medium from 10%, 20%, 2.5x layer jitter or 1.3x step jitter.")
    return doc


# --- everything as one JSON document ---------------------------------------------------------------

def _json_sections(bd):
    if not bd:
        return bd
    return {**bd, "sections": {k: {"ms": v["ms"], "rows": [{"label": lbl, **row} for lbl, row in v["rows"]]}
                               for k, v in bd["sections"].items()}}


def report_json(run, layer=None, timing=None, ranking=None) -> dict:
    ranking = findings.bottlenecks(run, timing) if ranking is None else ranking
    steps = aggregate.step_breakdowns(run)
    bd = _json_sections(aggregate.layer_breakdown(run, layer, "decode")) if layer is not None else None
    return {
        "source": run.source, "kind": run.kind, "info": run.info, "notes": run.notes, "events": len(run.records),
        "timeline": aggregate.timeline(run), "decode_steps": steps, "components": aggregate.components(steps),
        "layers": {p: aggregate.layer_stats(run, p) for p in aggregate.GENERATION}, "attn_ffn": aggregate.attn_ffn_by_phase(run),
        "layer_breakdown": bd, "matmuls": aggregate.matmul_table(run),
        "modules": aggregate.module_table(run.records, aggregate.scope(run.records)),
        "ops": {p: aggregate.label_table(run.records, {p}) for p in aggregate.GENERATION},
        "categories": {p: aggregate.category_table(run.records, {p}) for p in aggregate.GENERATION},
        "bottlenecks": ranking, "verdict": findings.verdict(run, ranking),
        "op_medians": _json_sections(aggregate.op_medians(run, "decode")), "contention": contention.assess(run),
        "jitter_causes": contention.attribute_steps(run),
        "timing": timing, "instrumentation": aggregate.instrumentation_cost(run, timing),
        "consistency": aggregate.consistency(run, timing),
    }
