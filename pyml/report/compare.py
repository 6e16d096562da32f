"""Two runs side by side — cold vs warm, before vs after, two quant types — as in glasstrace's
"Cold Start vs. Warmed" page: total measured time and its change, each run's module
table and top hotspot, the share of the top modules, and per-module deltas."""

from __future__ import annotations

from pyml.report import aggregate
from pyml.report.doc import Doc, ms, num, pct
from pyml.report.pages import _module_header, _module_rows


def _change(a, b) -> str:
    if a is None or b is None or not a:
        return "—"
    return f"{100.0 * (b - a) / a:+.1f}%"


def _summary(run) -> dict:
    mt = aggregate.module_table(run.records, aggregate.scope(run.records))
    tl = aggregate.timeline(run)
    rows = mt["rows"]
    head = next((r for r in rows if r["module"] == "lm_head"), None)
    return {"modules": mt, "timeline": tl, "top": rows[0] if rows else None, "head": head,
            "by_module": {r["module"]: r for r in rows},
            "ops": {p: aggregate.label_table(run.records, {p}) for p in aggregate.GENERATION}}


def compare(a, b, labels=("BEFORE", "AFTER"), top: int = 20) -> tuple[Doc, dict]:
    """(the page, the numbers) for runs a and b."""
    sa, sb = _summary(a), _summary(b)
    la, lb = labels
    ta, tb = sa["modules"]["total_ms"], sb["modules"]["total_ms"]
    doc = Doc(f"{la} vs {lb}: {a.label} · {b.label}")
    doc.p(f"**{la}**: `{a.source}` · **{lb}**: `{b.source}` · measured time = prefill + decode "
          f"(load and warm-up are listed separately below; every event when a run did not generate)")
    doc.items([f"● **{la}** {ta:.2f} ms", f"● **{lb}** {tb:.2f} ms"])

    doc.h("Side by side")
    rows = []

    def row(name, va, vb, fmt=ms, change=True):
        rows.append([name, fmt(va), fmt(vb), _change(va, vb) if change else ""])

    row("Total measured time (prefill + decode)", ta, tb)
    tla, tlb = sa["timeline"], sb["timeline"]
    row("Load", tla["load_ms"], tlb["load_ms"])
    row("Warm-up", tla["warmup_ms"], tlb["warmup_ms"])
    row("Time to first token (prefill)", tla["ttft_ms"], tlb["ttft_ms"])
    row("Prefill per token", tla.get("prefill_ms_per_token"), tlb.get("prefill_ms_per_token"))
    row("Decode mean per token", tla["decode_mean_ms"], tlb["decode_mean_ms"])
    row("Decode median per token", tla["decode_median_ms"], tlb["decode_median_ms"])
    row("Decode tok/s", tla["decode_tok_s"], tlb["decode_tok_s"], num)
    row("Decode steps", tla["decode_steps"], tlb["decode_steps"], lambda x: num(x, 0), False)
    row("Events", sa["modules"]["events"], sb["modules"]["events"], lambda x: num(x, 0), False)
    for phase in aggregate.GENERATION:
        ca = aggregate.category_table(a.records, {phase})
        cb = aggregate.category_table(b.records, {phase})
        for cat in sorted(set(ca) | set(cb), key=lambda c: -(ca.get(c, 0) + cb.get(c, 0)))[:5]:
            row(f"{phase}: {cat}", ca.get(cat), cb.get(cat))
    doc.table(["Metric", la, lb, "Change"], rows)

    for run, s, lab in ((a, sa, la), (b, sb, lb)):
        doc.h(f"{lab}: {run.label}")
        _module_header(doc, run, s["modules"])
        _module_rows(doc, s["modules"], top)

    doc.h("Hotspots")
    items = []
    for s, lab in ((sa, la), (sb, lb)):
        t = s["top"]
        if t:
            items.append(f"**TOP HOTSPOT ({lab})** `{t['module']}` · {t['total_ms']:.2f} ms · {t['pct']:.1f}%")
    for s, lab in ((sa, la), (sb, lb)):
        h = s["head"]
        if h:
            items.append(f"**LM_HEAD ({lab})** {h['total_ms']:.2f} ms · {h['pct']:.1f}%")
    if sa["top"] and sb["top"]:
        items.append(f"**SHARE OF TOTAL** (top module) {sb['top']['pct']:.1f}% vs {sa['top']['pct']:.1f}% "
                     f"({lb} vs {la})")
    for n in (5, 10):
        pa = sum(r["pct"] for r in sa["modules"]["rows"][:n])
        pb = sum(r["pct"] for r in sb["modules"]["rows"][:n])
        items.append(f"Top {n} modules hold {pct(pa)} of {la}'s time and {pct(pb)} of {lb}'s")
    doc.items(items)

    deltas = []
    for mod in set(sa["by_module"]) | set(sb["by_module"]):
        ra, rb = sa["by_module"].get(mod), sb["by_module"].get(mod)
        va, vb = (ra or {}).get("total_ms"), (rb or {}).get("total_ms")
        deltas.append({"module": mod, "type": (ra or rb)["type"], "before": va, "after": vb,
                       "delta": (vb or 0.0) - (va or 0.0)})
    deltas.sort(key=lambda d: -abs(d["delta"]))
    doc.h("Per-module change (largest first)")
    doc.table(["Module", "Type", f"{la} ms", f"{lb} ms", "Δ ms", "Δ %"],
              [[d["module"], d["type"], f"{d['before']:.2f}" if d["before"] is not None else "—",
                f"{d['after']:.2f}" if d["after"] is not None else "—", f"{d['delta']:+.2f}",
                _change(d["before"], d["after"])] for d in deltas[:top]], "llrrrr")

    for phase in aggregate.GENERATION:
        oa, ob = sa["ops"][phase], sb["ops"][phase]
        keys = sorted(set(oa) | set(ob), key=lambda k: -abs(ob.get(k, {}).get("ms", 0) - oa.get(k, {}).get("ms", 0)))
        if not keys:
            continue
        doc.h(f"Per op kind change: {phase}")
        doc.table(["Op", f"{la} ms", f"{lb} ms", "Δ ms", "Δ %"],
                  [[k, ms(oa.get(k, {}).get("ms")), ms(ob.get(k, {}).get("ms")),
                    f"{ob.get(k, {}).get('ms', 0) - oa.get(k, {}).get('ms', 0):+.3f}",
                    _change(oa.get(k, {}).get("ms"), ob.get(k, {}).get("ms"))] for k in keys[:top]])

    doc.p(f"● **{_change(ta, tb)}** total measured time, {lb} vs {la}")
    numbers = {"labels": list(labels), "a": a.source, "b": b.source, "total_ms": [ta, tb],
               "change_pct": 100.0 * (tb - ta) / ta if ta else None,
               "timeline": [tla, tlb], "top": [sa["top"], sb["top"]], "lm_head": [sa["head"], sb["head"]],
               "module_deltas": deltas}
    return doc, numbers
