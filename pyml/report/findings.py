"""Judgements on top of the numbers: the ranked bottlenecks with their known mitigations,
and the audit's verdict lines (primary bottleneck, optimisation potential).

Thresholds are stated next to each rule so a reader can disagree with them.
"""

from __future__ import annotations

import statistics

from pyml.report import advice, aggregate, contention

COLD_FACTOR = 1.5          # a layer or step this much slower than the median is "cold"


def _facts(run) -> dict:
    mm = aggregate.matmul_table(run)
    labels = {r["label"] for r in mm}
    model = run.info.get("model") or {}
    machine = run.info.get("machine") or {}
    head = next((r for r in mm if r["category"] == aggregate.HEAD), None)
    return {
        "matmuls": mm, "head": head,
        "ffn_rows": [r for r in mm if r["category"] == aggregate.FFN],
        "attn_rows": [r for r in mm if r["category"] == aggregate.ATTN_PROJ],
        "qkv_separate": any(lbl.endswith("q_proj") for lbl in labels),
        "qkv_types": _separate_qkv_types(run),
        "gate_up_separate": any(lbl.endswith("gate_proj") for lbl in labels),
        "float_weights": any(r["dtype"] in ("F32", "F16", "BF16") for r in mm if r["category"] != aggregate.HEAD),
        "threads": run.info.get("threads"), "cores": machine.get("usable_cores"),
        "vocab": head["out"] if head else None, "tied": model.get("tied_head"),
        "contended": contention.assess(run)["named"],
    }


def _separate_qkv_types(run) -> dict:
    """{layer: (Q's, K's, V's storage type)} of the layers whose Q, K and V run as three matmuls."""
    types = {}
    for r in run.records:
        if r.op == "linear" and r.layer is not None and r.dtype and r.module \
                and r.module.endswith(("q_proj", "k_proj", "v_proj")):
            types.setdefault(r.layer, {})[r.module.rsplit(".", 1)[-1]] = r.dtype
    return {layer: (t["q_proj"], t["k_proj"], t["v_proj"]) for layer, t in sorted(types.items()) if len(t) == 3}


def _qkv_advice(types: dict, n_layers: int | None) -> str:
    """Why Q, K and V are three matmuls: one storage type is what Linear.fuse needs."""
    mixed = {layer: t for layer, t in types.items() if len(set(t)) > 1}
    if not mixed:
        return "Fuse Q, K and V into one matmul (one call instead of three per layer)"
    kinds = sorted({", ".join(t) for t in mixed.values()})
    of = f" of {n_layers}" if n_layers else ""
    return (f"Q, K and V stay three matmuls in {len(mixed)}{of} layers: the file stores them as "
            f"{' or '.join(kinds)} there, and one matmul needs one storage type (Linear.fuse); "
            f"re-quantizing them to one type would fuse them, at that type's accuracy")


def _projection_bytes(rows) -> tuple:
    """(weight bytes read, ms) over the decode steps, of the rows whose type is known."""
    rows = [r for r in rows if r["bytes"]]
    return sum(r["bytes"] for r in rows), sum(r["ms"] for r in rows)


def _mitigations(cat: str, f: dict, run, timing, cat_ms: float, step_ms: float, n: int) -> tuple[list, list]:
    """(what could be done, as text; the options and commands to try, checked: advice.py).
    cat_ms: the category's ms per decode step; step_ms: a mean decode step."""
    out, try_ = [], []
    if cat == aggregate.HEAD:
        try_ += advice.head_quant(run, f["head"], step_ms)
        if f["head"]:
            out.append(f"Vocabulary pruning: project only the ids a task can emit ({f['head']['out']:,} rows "
                       f"today; engine work, no option yet)")
        elif run.kind == "log":  # a profile records every op: only a debug-level log lacks them
            out.append("Its shape and GB/s need the op-level records: `--profile DIR` records them")
        out.append("Speculative decoding spreads one head pass over several accepted tokens (engine work)")
    elif cat in (aggregate.FFN, aggregate.ATTN_PROJ):
        rows = f["ffn_rows"] if cat == aggregate.FFN else f["attn_rows"]
        if f["float_weights"]:
            before, ms = _projection_bytes(rows)
            after = sum(r["in"] * r["out"] * 34 / 32 * r["calls"] for r in rows if r["bytes"])
            gain = ms / max(aggregate.table_steps(run)[0], 1) * (1 - after / before) if before else None
            text = (f"Quantize the weights to Q8_0: {before / max(after, 1):.1f}x fewer bytes a token; at the "
                    f"measured speed about {advice.ms(gain or 0)} less per decode step")
            said = advice.quantize_weights(run, "q8_0", text, gain)
            try_ += said
            if not said:
                out.append(text + " (pyml-quantize reads GGUF files: convert this model with llama.cpp's "
                                  "convert_hf_to_gguf.py first)")
        if cat == aggregate.FFN:
            if f["gate_up_separate"]:
                out.append("Fuse gate and up into one matmul (Linear.fuse: needs one storage type for both)")
            slow = [r for r in rows if r["gb_s"]]
            if slow:
                lo, hi = min(r["gb_s"] for r in slow), max(r["gb_s"] for r in slow)
                out.append(f"A faster matmul kernel (engine work): the FFN projections stream their weights at "
                           f"{lo:.3g}–{hi:.3g} GB/s")
        elif f["qkv_separate"]:
            out.append(_qkv_advice(f["qkv_types"], (run.info.get("model") or {}).get("layers")))
        else:
            out.append("Q, K and V are already one matmul")
    elif cat == aggregate.ATTN_CORE:
        ops = aggregate.label_table(run.records, {"decode"})
        if "softmax" in ops and "sdpa" not in ops:
            out.append("Use the fused one-position attention kernel (`attention::sdpa`) for decode steps")
        core = _core_per_step(run)
        if len(core) >= 2:
            out.append(f"Grows with the context: {core[0]:.3f} ms at the first decode step, {core[-1]:.3f} ms at "
                       f"the last; sliding-window layers and a shorter context bound it")
    elif cat == aggregate.GLUE:
        cost = aggregate.instrumentation_cost(run, timing)
        if cost:
            n_python = cost["spans_per_step"] - cost["compiled_per_step"]
            out.append(f"Part of it is the timing itself: {n_python:.0f} Python spans per step × "
                       f"{cost['per_span_us']:.2f} µs"
                       + (f" + {cost['compiled_per_step']:.0f} timed inside compiled code × "
                          f"{cost['per_compiled_us'] * 1e3:.0f} ns" if cost["compiled_per_step"] else "")
                       + f" ≈ {cost['ms_per_step']:.3f} ms ({cost['pct']:.1f}% of a step), which a run "
                       f"without --profile and LOG does not pay")
        out.append("Fewer, larger ops: fused kernels (QKV, gate+up, attention) remove per-op Python dispatch, "
                   "which is what small models are bound by (engine work)")
    elif cat in (aggregate.NORM, aggregate.ACT):
        out.append("Fold into a neighbouring kernel (norm + next matmul, activation + gate); on small models "
                   "the call costs more than the arithmetic (engine work)")
    elif cat == aggregate.SAMPLE:
        try_ += advice.greedy(run, f"Greedy sampling (`--temperature 0`) skips sorting the {f['vocab'] or ''} "
                                   f"logits top-k/top-p need: up to {advice.ms(cat_ms)} less per step",
                              cat_ms)
    elif cat in (aggregate.ATTN_COARSE, aggregate.FFN_COARSE):
        if run.kind == "log":
            out.append("Split into ops: `--profile DIR` (or `LOG=trace`) records every op inside a layer")
    if (cat in (aggregate.FFN, aggregate.ATTN_PROJ, aggregate.HEAD) and f["threads"] and f["cores"]
            and f["threads"] < f["cores"] and not f["contended"]):
        gain = cat_ms * (1 - f["threads"] / f["cores"])
        try_ += advice.threads(run, f["cores"], "Use every core: `--threads {n}` (this run used "
                               f"{f['threads']}): at most {advice.ms(gain)} less per step if these matmuls "
                               f"scale with the cores", gain)
    return out, try_


def _core_per_step(run) -> list:
    out = []
    for s in run.decode_steps():
        ms = 0.0
        stack = [s]
        while stack:
            r = stack.pop()
            stack.extend(r.children)
            ms += sum(m for _, cat, m in aggregate.pieces(r) if cat == aggregate.ATTN_CORE)
        out.append(ms)
    return out


def _detail(cat, run, f, labels) -> str:
    n = len(run.decode_steps()) or 1
    top = sorted(((lbl, v["ms"] / n) for lbl, v in labels.items() if v["category"] == cat), key=lambda x: -x[1])
    if cat == aggregate.HEAD and f["head"]:
        h = f["head"]
        gbs = f", {h['gb_s']:.3g} GB/s" if h["gb_s"] else ""
        return f"lm_head {h['in']}→{h['out']:,} {h['dtype']}{gbs}"
    if not top:
        return ""
    return ", ".join(f"{lbl} {v:.3f}ms" for lbl, v in top[:4]) + (" …" if len(top) > 4 else "")


def bottlenecks(run, timing=None, limit: int = 6, min_share: float = 1.0) -> list:
    """The ranking every page uses: where decode time goes, by share of decode time, each with
    what could be done (`mitigations`) and the options or commands to try (`suggestions`, checked
    by advice.py, each with its expected gain). Contention comes first when contention.py names
    it and it cost >= contention.FIRST_PCT of decode time: it distorts every other figure."""
    steps = aggregate.step_breakdowns(run)
    if not steps:
        return []
    n = len(steps)
    cats = aggregate.category_table(run.records, {"decode"})
    total = sum(cats.values())
    step_ms = total / n
    labels = aggregate.label_table(run.records, {"decode"})
    f = _facts(run)
    items = []
    for cat, ms in cats.items():
        share = 100.0 * ms / total if total else 0.0
        if share < min_share:
            continue
        text, said = _mitigations(cat, f, run, timing, ms / n, step_ms, n)
        items.append(_item(cat, ms / n, share, _detail(cat, run, f, labels), text, said))
    items += _cold(run, steps, total, n)
    items.sort(key=lambda x: -x["share"])
    machine = _contention_item(run, n, total)
    if machine is not None:
        items.append(machine)
    items.sort(key=lambda x: (not x["first"], -x["share"]))
    return items[:limit]


def first_bottleneck(ranking) -> str:
    """The first of the ranking, as every page names it."""
    if not ranking:
        return "none recorded"
    top = ranking[0]
    return f"{top['title']} ({top['share']:.0f}% of decode time)"


def _item(title, ms_per_step, share, detail, mitigations, suggestions, first=False) -> dict:
    return {"title": title, "ms_per_step": ms_per_step, "share": share, "detail": detail,
            "mitigations": mitigations, "suggestions": suggestions, "first": first}


def _cold(run, steps, total, n) -> list:
    """Jitter that costs time: a cold first layer, a cold first step."""
    out = []
    layers = aggregate.layer_stats(run, "decode")
    warm_text = "Warm up before timing: drop `--no-warmup` (pyml.load_model warms by default)"
    if len(layers) >= 3:
        med = statistics.median(r["mean"] for r in layers[1:])
        if layers[0]["mean"] >= COLD_FACTOR * med:
            excess = layers[0]["mean"] - med
            out.append(_item("cold layer 0", excess, 100.0 * excess * n / total if total else 0.0,
                             f"layer 0 {layers[0]['mean']:.3f}ms vs median {med:.3f}ms",
                             ["Check the embedding output is not freshly paged in every step"],
                             advice.warm_up(run, warm_text, excess)))
    if n >= 3:
        med = statistics.median(s["total"] for s in steps[1:])
        if steps[0]["total"] >= COLD_FACTOR * med:
            excess = steps[0]["total"] - med
            said = advice.warm_up(run, warm_text + f": about {advice.ms(excess)} off the first step", excess)
            out.append(_item("slow first decode step", excess / n, 100.0 * excess / total if total else 0.0,
                             f"step 1 {steps[0]['total']:.2f}ms vs median {med:.2f}ms",
                             [] if said else ["The warm-up ran; the first step still paid for something cold "
                                              "(pages of the weights, the caches): see jitter.md"], said))
    return out


def _contention_item(run, n, total) -> dict | None:
    a = contention.assess(run)
    if not a["named"]:
        return None
    try_ = contention.threads_to_try(a)
    said = advice.threads(run, try_, "Fewer threads than cores, so the run's threads do not wait for each "
                          "other behind another process: `-t {n}`; up to "
                          f"{advice.ms(a['lost_ms'] / n)} per step back (the time lost)", a["lost_ms"] / n)
    text = ["A quieter machine: stop or wait for the other processes (`top` shows them), then profile again "
            "and `pyml-report compare` the two runs"]
    return _item("machine contention: other processes held the cores", a["lost_ms"] / n, a["lost_pct"],
                 "; ".join(a["evidence"]), text, said, first=a["first"])


def verdict(run, ranking=None) -> dict | None:
    """The audit's closing lines: status, primary (the ranking's first) and secondary, potential."""
    steps = aggregate.step_breakdowns(run)
    if not steps:
        return None
    ranking = bottlenecks(run) if ranking is None else ranking
    comps = aggregate.components(steps)
    cats = aggregate.category_table(run.records, {"decode"})
    total = sum(cats.values()) or 1.0
    head = comps["projection"]["pct"]
    glue = 100.0 * cats.get(aggregate.GLUE, 0.0) / total
    af = aggregate.attn_ffn_by_phase(run).get("decode")
    totals = [s["total"] for s in steps]
    steady = totals[1:] if len(totals) > 2 else totals
    step_jitter = max(steady) / min(steady) if min(steady) > 0 else None
    layer_durs = [d for s in steps for d in s["layer_ms"]]
    layer_jitter = max(layer_durs) / min(layer_durs) if layer_durs and min(layer_durs) > 0 else None
    primary = first_bottleneck(ranking)
    top = ranking[0] if ranking else None
    secondary = [f"{r['title']} ({r['share']:.0f}%)" for r in ranking[1:] if r["title"].startswith("machine")]
    if layer_jitter and layer_jitter >= 2.5:
        secondary.append(f"layer jitter ({layer_jitter:.1f}x)")
    if step_jitter and step_jitter >= 1.5:
        secondary.append(f"step jitter ({step_jitter:.1f}x)")
    if len(totals) > 2 and totals[0] >= COLD_FACTOR * statistics.median(totals[1:]):
        secondary.append(f"cold first step ({totals[0] / statistics.median(totals[1:]):.1f}x the median)")
    if head >= 25 or glue >= 40 or (step_jitter or 0) >= 2:
        potential = "High"
    elif head >= 10 or glue >= 20 or (layer_jitter or 0) >= 2.5 or (step_jitter or 0) >= 1.3:
        potential = "Medium"
    else:
        potential = "Low"
    why = [f"lm_head {head:.0f}%"]
    if glue:
        why.append(f"glue {glue:.0f}%")
    if step_jitter:
        why.append(f"step jitter {step_jitter:.1f}x")
    if layer_jitter:
        why.append(f"layer jitter {layer_jitter:.1f}x")
    split = f", attention:FFN {af['attn_pct']:.0f}:{100 - af['attn_pct']:.0f}" if af and af["attn_pct"] else ""
    if top is not None and top["title"].startswith("machine contention"):
        status = ("Contended: other processes held the cores, so every other figure here is inflated; "
                  "profile again on a quieter machine or with fewer threads")
    elif top is not None and top["title"] == aggregate.HEAD and top["share"] >= 15:
        status = "lm_head projection is a significant overhead"
    elif top is not None and top["title"] == aggregate.GLUE and top["share"] >= 30:
        status = ("Bound by per-op dispatch: the time between timed ops outweighs the ops themselves "
                  "(typical of a model small for its op count)")
    elif top is None or top["share"] < 25:
        status = f"Well-balanced: layers {comps['layers']['pct']:.0f}% of a step{split}"
    else:
        status = f"Layers dominate ({comps['layers']['pct']:.0f}% of a step){split}"
    return {"status": status, "primary": primary, "secondary": secondary or ["none"],
            "potential": potential, "because": ", ".join(why),
            "step_jitter": step_jitter, "layer_jitter": layer_jitter}
