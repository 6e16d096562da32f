"""Logs written before `[perf]` lines carried their context (` | module depth= start=`).

Those lines say what ran and for how long, but not where in the tree, which module,
or when. This module puts them back together from what pyml's spans are known to
contain, so such a log still gives its tables — with three approximations, stated in
the report: nesting follows pyml's span hierarchy (a container adopts the events just
before it that it can contain), module paths are synthesized from the layer and the
position of a projection (`layers.3.attn.in0`, `layers.3.mlp.out`, `lm_head`), and
start times are laid out back to back (the trace's gaps are unknown).
"""

from __future__ import annotations

import re

# container -> names of the events it may hold directly (matched by prefix)
_HOLDS = {
    "linear::forward": ("quant::matmul",),
    "attention::forward": ("linear::forward", "rope", "kv_cache::update", "batched_matmul", "softmax",
                           "attention::sdpa", "rms_norm", "layer_norm", "matmul"),
    "feed_forward": ("linear::forward", "gelu", "silu", "gated_act"),
    "transformer[": ("layer_norm", "rms_norm", "attention::forward", "feed_forward"),
    "model::forward": ("embedding::lookup", "transformer[", "layer_norm", "rms_norm", "linear::forward"),
    "generator::": ("model::forward",),
    "runtime::warmup": ("model::forward",),
}
_PHASE_OF_ROOT = {"model::load": "load", "runtime::warmup": "warmup", "generator::prefill": "prefill",
                  "generator::decode_step": "decode"}
NOTE = ("this log predates the ` | module depth= start=` context of `[perf]` lines: nesting is inferred "
        "from pyml's span hierarchy, module paths are synthesized (`layers.N.attn.in0` … `lm_head`), and "
        "start times are laid out back to back")


def _holds(container: str):
    for prefix, names in _HOLDS.items():
        if container.startswith(prefix):
            return names
    return None


def _can_hold(names, child: str) -> bool:
    return any(child.startswith(n) for n in names)


def link(raws: list) -> None:
    """Set parent ids, phases, steps, synthesized modules and starts on post-order raw dicts."""
    pending = []
    for rec in raws:
        names = _holds(rec["name"])
        if names is None:
            pending.append(rec)
            continue
        take = len(pending)
        while take > 0 and pending[take - 1]["parent"] is None and _can_hold(names, pending[take - 1]["name"]):
            take -= 1
        kids = pending[take:]
        if rec["name"] == "attention::forward":  # it starts with its input projection(s)
            first = next((i for i, k in enumerate(kids) if k["name"] == "linear::forward"), len(kids))
            take, kids = take + first, kids[first:]
        del pending[take:]
        for k in kids:
            k["parent"] = rec["id"]
        rec["_kids"] = kids
        pending.append(rec)
    roots = [r for r in raws if r["parent"] is None]
    step = 0
    t = 0.0
    for r in roots:
        phase = _PHASE_OF_ROOT.get(r["name"])
        if phase == "prefill":
            step = 0
        elif phase == "decode":
            step += 1
        r["phase"], r["step"] = phase, (step if phase in ("prefill", "decode") else None)
        _place(r, t, None, "")
        t += r["dur_ms"] / 1e3 + 1e-6


def _place(rec, start, layer, role):
    rec["start"] = start
    m = re.match(r"transformer\[(\d+)\]", rec["name"])
    if m:
        layer = int(m.group(1))
    kids = rec.pop("_kids", [])
    if rec["name"] == "attention::forward":
        role = "attn"
    elif rec["name"] == "feed_forward":
        role = "mlp"
    if layer is not None and rec["name"] in ("attention::forward", "feed_forward"):
        rec["module"] = f"layers.{layer}.{role}"
    elif rec["name"].startswith("transformer["):
        rec["module"] = f"layers.{layer}"
    elif rec["name"] == "model::forward":
        rec["module"] = "model"
    elif rec["name"] == "embedding::lookup":
        rec["module"] = "embed_tokens"
    lins = [k for k in kids if k["name"] == "linear::forward"]
    for i, k in enumerate(lins):
        if rec["name"] == "model::forward":
            k["module"] = "lm_head"
        elif layer is not None and role:
            k["module"] = f"layers.{layer}.{role}.{'out' if i == len(lins) - 1 and i > 0 else f'in{i}'}"
    at = start + 1e-6
    for k in kids:
        _place(k, at, layer, role)
        at += k["dur_ms"] / 1e3 + 1e-6
