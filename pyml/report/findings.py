"""Judgements on top of the numbers: the ranked bottlenecks with their known mitigations,
and the audit's verdict lines (primary bottleneck, optimisation potential).

Thresholds are stated next to each rule so a reader can disagree with them.
"""

from __future__ import annotations

import statistics

from pyml.report import aggregate

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
        "gate_up_separate": any(lbl.endswith("gate_proj") for lbl in labels),
        "float_weights": any(r["dtype"] in ("F32", "F16", "BF16") for r in mm if r["category"] != aggregate.HEAD),
        "threads": run.info.get("threads"), "cores": machine.get("usable_cores"),
        "vocab": head["out"] if head else None, "tied": model.get("tied_head"),
    }


def _mb(b) -> str:
    return f"{b / 1e6:,.1f} MB"


def _mitigations(cat: str, f: dict, run, timing) -> list:
    out = []
    quant_tip = ("Quantize the weights: Q8_0 reads ~3.8x fewer bytes per token than F32, Q4_0 ~7x "
                 "(decode is bound by reading the weights once per token)")
    if cat == aggregate.HEAD and f["head"]:
        h = f["head"]
        n = (h["in"] or 0) * (h["out"] or 0)
        if h["dtype"] in ("F32", "F16", "BF16"):
            out.append(f"Quantize the head: `--lm-head-quant q8_0` reads ~{_mb(n * 34 / 32)} per token instead "
                       f"of {_mb(h['bytes'] / max(h['calls'], 1))} (q4_0: ~{_mb(n * 18 / 32)})")
        elif h["dtype"] == "Q8_0":
            out.append(f"Already Q8_0: `--lm-head-quant q4_0` would read ~{_mb(n * 18 / 32)} per token")
        out.append(f"Vocabulary pruning: project only the ids a task can emit ({h['out']:,} rows today)")
        out.append("Speculative decoding spreads one head pass over several accepted tokens")
    elif cat == aggregate.HEAD:
        out.append("Quantize the head (`--lm-head-quant q8_0`); profile at trace level for its shape and GB/s")
    elif cat == aggregate.FFN:
        if f["float_weights"]:
            out.append(quant_tip)
        if f["gate_up_separate"]:
            out.append("Fuse gate and up into one matmul (Linear.fuse: needs one storage type for both)")
        slow = [r for r in f["ffn_rows"] if r["gb_s"]]
        if slow:
            lo, hi = min(r["gb_s"] for r in slow), max(r["gb_s"] for r in slow)
            out.append(f"A faster matmul kernel: the FFN projections stream their weights at "
                       f"{lo:.3g}–{hi:.3g} GB/s")
    elif cat == aggregate.ATTN_PROJ:
        if f["qkv_separate"]:
            out.append("Fuse Q, K and V into one matmul (one call instead of three per layer)")
        else:
            out.append("Q, K and V are already one matmul")
        if f["float_weights"]:
            out.append(quant_tip)
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
                       + f" ≈ {cost['ms_per_step']:.3f} ms ({cost['pct']:.1f}% of a step); profile at debug "
                       f"level (`LOG=debug`) for layer totals at a fraction of the cost")
        out.append("Fewer, larger ops: fused kernels (QKV, gate+up, attention) remove per-op Python dispatch, "
                   "which is what small models are bound by")
    elif cat in (aggregate.NORM, aggregate.ACT):
        out.append("Fold into a neighbouring kernel (norm + next matmul, activation + gate); on small models "
                   "the call costs more than the arithmetic")
    elif cat == aggregate.SAMPLE:
        out.append(f"Greedy sampling (temperature 0) skips sorting the {f['vocab'] or 'vocabulary'} logits that "
                   f"top-k/top-p need")
    elif cat in (aggregate.ATTN_COARSE, aggregate.FFN_COARSE):
        out.append("Profile at trace level (`LOG=trace` or `pyml.profile`) to split this into ops")
    if cat in (aggregate.FFN, aggregate.ATTN_PROJ, aggregate.HEAD) and f["threads"] and f["cores"] and f["threads"] < f["cores"]:
        out.append(f"Use every core: `--threads {f['cores']}` (this run used {f['threads']})")
    return out


def _core_per_step(run) -> list:
    out = []
    for s in run.named("generator::decode_step"):
        ms = 0.0
        stack = [s]
        while stack:
            r = stack.pop()
            stack.extend(r.children)
            ms += sum(m for _, cat, m in aggregate.pieces(r) if cat == aggregate.ATTN_CORE)
        out.append(ms)
    return out


def _detail(cat, run, f, labels) -> str:
    n = len(run.named("generator::decode_step")) or 1
    top = sorted(((lbl, v["ms"] / n) for lbl, v in labels.items() if v["category"] == cat), key=lambda x: -x[1])
    if cat == aggregate.HEAD and f["head"]:
        h = f["head"]
        gbs = f", {h['gb_s']:.3g} GB/s" if h["gb_s"] else ""
        return f"lm_head {h['in']}→{h['out']:,} {h['dtype']}{gbs}"
    if not top:
        return ""
    return ", ".join(f"{lbl} {v:.3f}ms" for lbl, v in top[:4]) + (" …" if len(top) > 4 else "")


def bottlenecks(run, timing=None, limit: int = 6, min_share: float = 1.0) -> list:
    """Where decode time goes, ranked by share of decode time, each with mitigations."""
    steps = aggregate.decode_steps(run)
    if not steps:
        return []
    n = len(steps)
    cats = aggregate.category_table(run.records, {"decode"})
    total = sum(cats.values())
    labels = aggregate.label_table(run.records, {"decode"})
    f = _facts(run)
    items = []
    for cat, ms in cats.items():
        share = 100.0 * ms / total if total else 0.0
        if share < min_share:
            continue
        items.append({"title": cat, "ms_per_step": ms / n, "share": share, "detail": _detail(cat, run, f, labels),
                      "mitigations": _mitigations(cat, f, run, timing)})
    # jitter that costs time: a cold first layer, a cold first step
    layers = aggregate.layer_stats(run, "decode")
    if len(layers) >= 3:
        med = statistics.median(r["mean"] for r in layers[1:])
        if layers[0]["mean"] >= COLD_FACTOR * med:
            excess = layers[0]["mean"] - med
            items.append({"title": "cold layer 0", "ms_per_step": excess,
                          "share": 100.0 * excess * n / total if total else 0.0,
                          "detail": f"layer 0 {layers[0]['mean']:.3f}ms vs median {med:.3f}ms",
                          "mitigations": ["Warm up before timing (pyml.load_model does by default; "
                                          "`--no-warmup` turns it off)",
                                          "Check the embedding output is not freshly paged in every step"]})
    if n >= 3:
        med = statistics.median(s["total"] for s in steps[1:])
        if steps[0]["total"] >= COLD_FACTOR * med:
            excess = steps[0]["total"] - med
            items.append({"title": "slow first decode step", "ms_per_step": excess / n,
                          "share": 100.0 * excess / total if total else 0.0,
                          "detail": f"step 1 {steps[0]['total']:.2f}ms vs median {med:.2f}ms",
                          "mitigations": ["Warm up (compiles kernels, starts the thread pools, pages in the "
                                          "weights) before the first measured token"]})
    items.sort(key=lambda x: -x["share"])
    return items[:limit]


def verdict(run) -> dict | None:
    """The audit's closing lines: status, primary and secondary bottleneck, potential."""
    steps = aggregate.decode_steps(run)
    if not steps:
        return None
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
    if head >= 15:
        primary = f"lm_head projection ({head:.0f}% of decode time)"
    elif glue >= 30:
        primary = f"Python/NumPy glue between ops ({glue:.0f}% of decode time)"
    elif af and af["ratio"] and af["ratio"] >= 2:
        primary = f"FFN ({af['ratio']:.1f}x the attention time per layer)"
    elif af and af["ratio"] and af["ratio"] <= 0.5:
        primary = f"attention ({1 / af['ratio']:.1f}x the FFN time per layer)"
    else:
        primary = "None dominant"
    secondary = []
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
    if primary == "None dominant":
        status = f"Well-balanced: layers {comps['layers']['pct']:.0f}% of a step{split}"
    elif primary.startswith("lm_head"):
        status = "lm_head projection is a significant overhead"
    elif primary.startswith("Python"):
        status = ("Bound by per-op dispatch: the time between timed ops outweighs the ops themselves "
                  "(typical of a model small for its op count)")
    else:
        status = f"Layers dominate ({comps['layers']['pct']:.0f}% of a step){split}"
    return {"status": status, "primary": primary, "secondary": secondary or ["none"],
            "potential": potential, "because": ", ".join(why),
            "step_jitter": step_jitter, "layer_jitter": layer_jitter}
