"""The bottleneck summary of one generation (a server request, a chat reply), from the perf
records of its own decode steps, aggregated by pyml.report: the attention / FFN / head /
sampling split of the decode time and the top ops."""

from __future__ import annotations

import contextlib

from pyml.core import perf
from pyml.report.aggregate import (ACT, ATTN_CORE, ATTN_CORE_OPS, ATTN_PROJ, FFN, HEAD, SAMPLE, category_table,
                                   label_table)
from pyml.report.records import STEP_EVENTS, normalize

SPLIT = {"attention": (ATTN_PROJ, ATTN_CORE), "ffn": (FFN, ACT), "head": (HEAD,), "sampling": (SAMPLE,)}


@contextlib.contextmanager
def recording(records: list, enabled: bool = True):
    """Append every perf record (trace level) made inside the block to `records`."""
    if not enabled:
        yield records
        return
    perf.add_collector(records.append, level=perf.TRACE)
    try:
        yield records
    finally:
        perf.remove_collector(records.append)


def profile_summary(raw_records: list, top: int = 10, shares: dict | None = None) -> dict:
    """The bottleneck summary of one request's decode steps, from its own perf records; with
    `shares` (step -> (its rows, rows, sequences) of batched steps), its share of each step."""
    records, _ = normalize(raw_records)
    for r in records if shares else ():
        if r.phase == "decode" and r.step in shares:
            own, rows, sequences = shares[r.step]
            _scale(r, own / sequences if r.op in ATTN_CORE_OPS else own / rows)
    categories = category_table(records, phases=("decode",))
    total = sum(categories.values())
    steps = sum(1 for r in records if r.name in STEP_EVENTS and r.phase == "decode")

    def share(ms):
        return {"ms": round(ms, 3), "pct": round(100 * ms / total, 1) if total else 0.0}

    split = {name: share(sum(categories.get(c, 0.0) for c in cats)) for name, cats in SPLIT.items()}
    split["other"] = share(total - sum(v["ms"] for v in split.values()))
    labels = sorted(label_table(records, phases=("decode",)).items(), key=lambda kv: -kv[1]["ms"])[:top]
    return {"decode_steps": steps, "decode_ms": round(total, 3),
            "ms_per_step": round(total / steps, 3) if steps else 0.0, "split": split,
            "categories": {c: share(ms) for c, ms in sorted(categories.items(), key=lambda kv: -kv[1])},
            "top_ops": [{"op": label, "category": row["category"], "calls": row["calls"], **share(row["ms"])}
                        for label, row in labels]}


def _scale(rec, share: float) -> None:
    rec.dur_ms *= share
    rec.self_ms *= share
    rec.parts = {k: v * share for k, v in rec.parts.items()}


def batched_profile(raw_records: list, shares: dict) -> dict:
    """A request's summary under --parallel (shares: step -> (its rows, rows, sequences)): of each
    batched step it decoded in, the request's share — the projections' and the rest's time split by
    rows, attention over the caches by sequence; `batch` says what it shared the steps with."""
    summary = profile_summary(raw_records, shares=shares)
    sequences = [s for _, _, s in shares.values()]
    summary["batch"] = {"steps": len(shares),
                        "mean_sequences": round(sum(sequences) / len(sequences), 2) if sequences else 0.0,
                        "max_sequences": max(sequences, default=0),
                        "split": "a step's time shared by rows; attention over the caches by sequence"}
    return summary


def split_line(summary: dict) -> str:
    """One line: where a reply's decode time went."""
    parts = " ".join(f"{name} {v['pct']:.0f}%" for name, v in summary["split"].items())
    return f"decode {summary['ms_per_step']:.2f} ms/step: {parts}"
