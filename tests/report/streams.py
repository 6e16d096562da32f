"""Hand-made perf event streams with known answers, in the collector's record format.

`S(name, dur_ms, *children, **fields)` describes a span; `emit(roots)` lays the
tree out in time (children back to back from their parent's start, 1 µs apart)
and returns the raw records in the order spans end, as a collector sees them.
"""

from __future__ import annotations


class S:
    def __init__(self, name, dur, *children, **fields):
        self.name, self.dur, self.children, self.fields = name, dur, children, fields


def emit(roots, start=100.0, phase_steps=None):
    """Raw records (post-order). Each root may carry phase/step in its fields; they are stamped
    on its whole tree, as perf.context does."""
    raws, ids = [], iter(range(1, 10 ** 6))

    def walk(spec, parent, t, ctx):
        rid = next(ids)
        ctx = {**ctx, **{k: spec.fields[k] for k in ("phase", "step") if k in spec.fields}}
        at = t + 1e-6
        for c in spec.children:
            walk(c, rid, at, ctx)
            at += c.dur / 1e3 + 1e-6
        rec = {"id": rid, "parent": parent, "name": spec.name, "level": "trace", "logger": "pyml.test",
               "thread": 1, "start": t, "dur_ms": spec.dur, "phase": ctx.get("phase"), "step": ctx.get("step"),
               "details": spec.fields.get("details", ""), "parts": spec.fields.get("parts", {})}
        rec.update({k: v for k, v in spec.fields.items() if k not in ("phase", "step", "details", "parts")})
        raws.append(rec)

    t = start
    for r in roots:
        walk(r, None, t, {})
        t += r.dur / 1e3 + 1e-3
    return raws


def block(i, prefix="transformer.h"):
    """A 3.0 ms GPT-2 block: attn part 1.8 (norm 0.2 + attention 1.5 + add), ffn part 1.1."""
    p = f"{prefix}.{i}"
    attention = S("attention::forward", 1.5,
                  S("linear::forward", 0.6, details="[1, 64]->[64, 192] F32", module=f"{p}.attn.c_attn"),
                  S("kv_cache::update", 0.05, details=f"layer={i} pos=5"),
                  S("attention::sdpa", 0.25, details="q=[4, 16] kv=[4, 6, 16]"),
                  S("linear::forward", 0.4, details="[1, 64]->[64, 64] F32", module=f"{p}.attn.c_proj"),
                  details=f"layer={i} global tokens=1 pos=5", module=f"{p}.attn")
    ffn = S("feed_forward", 0.8,
            S("linear::forward", 0.4, details="[1, 64]->[64, 256] F32", module=f"{p}.mlp.c_fc"),
            S("gelu", 0.1, details="[1, 256] tanh"),
            S("linear::forward", 0.2, details="[1, 256]->[256, 64] F32", module=f"{p}.mlp.c_proj"),
            details="[1, 64] mlp", module=f"{p}.mlp")
    return S(f"transformer[{i}]::forward", 3.0,
             S("layer_norm", 0.2, details="[1, 64]"), attention,
             S("layer_norm", 0.2, details="[1, 64]"), ffn,
             parts={"attn": 1.8, "ffn": 1.1}, module=p)


def decode_step(step, layer_ms=3.0, head_ms=1.4):
    """A 10 ms decode step: forward 9.0 ms (gather 0.8, two 3.0 ms blocks, final norm 0.4,
    lm_head 1.4; parts embedding 0.9, layers 6.1, norm 0.45, projection 1.45), sample 0.5 ms.

    Per step, by category: head 1.4, FFN projections 1.2, attention projections 2.0,
    attention core 0.6, activations 0.2, norms 1.2, embedding 0.8, sampling 0.5, glue 2.1.
    """
    b0, b1 = block(0), block(1)
    b0.dur = b1.dur = layer_ms
    fwd = S("model::forward", 9.0,
            S("embedding::lookup", 0.8, details="tokens=1 dim=64 F32", module="transformer.wte"),
            b0, b1,
            S("layer_norm", 0.4, details="[1, 64]"),
            S("linear::forward", head_ms, details="[1, 64]->[64, 512] F32", module="lm_head"),
            details=f"tokens=1 pos={4 + step}", module="model",
            parts={"embedding": 0.9, "layers": 6.1, "norm": 0.45, "projection": 1.45})
    return S("generator::decode_step", 10.0, fwd, details=f"token={4 + step}",
             parts={"model": 9.2, "sample": 0.5}, phase="decode", step=step)


def prefill(tokens=5):
    """A 20 ms prefill: forward 18 ms (blocks of 8 ms), sample 1 ms."""
    b0, b1 = block(0), block(1)
    b0.dur = b1.dur = 8.0
    b0.fields["parts"] = b1.fields["parts"] = {"attn": 5.0, "ffn": 2.5}
    fwd = S("model::forward", 18.0,
            S("embedding::lookup", 0.5, details=f"tokens={tokens} dim=64 F32", module="transformer.wte"),
            b0, b1, S("layer_norm", 0.3, details="[1, 64]"),
            S("linear::forward", 1.0, details="[1, 64]->[64, 512] F32", module="lm_head"),
            details=f"tokens={tokens} pos=0", module="model",
            parts={"embedding": 0.6, "layers": 16.2, "norm": 0.35, "projection": 1.05})
    return S("generator::prefill", 20.0, fwd, details=f"tokens={tokens}", parts={"sample": 1.0},
             phase="prefill", step=0)


def generation(n_steps=3, **kw):
    return [S("model::load", 50.0, details="tiny", phase="load"), prefill()] + \
        [decode_step(i, **kw) for i in range(1, n_steps + 1)]


def to_log(raws, main_thread=1) -> str:
    """The `[perf]` lines pyml.core.perf would have written for these records."""
    from pyml.core.perf import format_line
    by_id = {r["id"]: r for r in raws}
    lines = []
    for r in raws:
        depth, p = 0, r["parent"]
        while p is not None:  # a parent that never ended was a top-level span
            depth, p = depth + 1, by_id[p]["parent"] if p in by_id else None
        ctx = (f"{r['module']} " if r.get("module") else "") + f"depth={depth} start={r['start']:.6f}"
        if depth == 0:
            if r["phase"] is not None:
                ctx += f" phase={r['phase']}"
            if r["step"] is not None:
                ctx += f" step={r['step']}"
        if r["thread"] != main_thread:
            ctx += f" thread={r['thread']}"
        if r.get("compiled"):
            ctx += " compiled=1"
        parts = {k: v / 1e3 for k, v in r["parts"].items()}
        lines.append("[perf] " + format_line(r["name"], r["details"], parts, r["dur_ms"] / 1e3, ctx))
    return "\n".join(lines) + "\n"
