"""Is the machine the bottleneck? Contention read from run.json's machine_use and the step times,
and the jitter of slow decode steps put down to its causes where the evidence allows.

Thresholds, so a reader can disagree with them:
- other processes used >= OTHERS_CORES cores on average while our threads wanted every core
  (threads + others > cores), or the load average (ours included) ended OTHERS_CORES or more
  above the cores: contention;
- otherwise two of: the process ran < CPU_PER_WALL of the wall clock (it waited for a core),
  >= NIVCSW_PER_S involuntary context switches a second, spikes in multiples of the scheduler's
  time slice, a prefill slower per token than decode (a batch is cheaper per token when the
  cores are ours);
- a spike is a layer (or step) >= SPIKE_MS and >= its own median over its median;
- the time lost is the larger of the spikes' excess and the wall time the process did not run
  (1 - CPU/wall, decode); contention comes first in the ranking when named and >= FIRST_PCT of
  decode time: while another process holds the cores every other figure is distorted.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

OTHERS_CORES = 0.5
CPU_PER_WALL = 0.8
NIVCSW_PER_S = 50
SPIKE_MS = 2.0
QUANTUM_MS = (2.5, 6.5)   # CFS gives a contended core to the next task every few ms (HZ=250: 4 ms)
FIRST_PCT = 10.0
GC_MS, FAULTS = 0.5, 100  # a step's GC pause / page faults worth naming


def _blocks(run):
    """(step, layer, ms) of every decode layer."""
    return [(r.step, r.layer, r.dur_ms) for r in run.records
            if r.op == "block" and r.phase == "decode" and r.layer is not None]


def spikes(run) -> dict:
    """Layers (or, without layer events, steps) far over their median: how many, the time over,
    and whether the excesses come in multiples of one slice in QUANTUM_MS."""
    blocks = _blocks(run)
    excess = []
    if blocks:
        excess, of = _layer_spikes(run, blocks), len(blocks)
    else:
        steps = run.decode_steps()
        if steps:
            m = statistics.median(r.dur_ms for r in steps)
            excess = [(r.step, None, r.dur_ms - m) for r in steps if r.dur_ms - m >= max(SPIKE_MS, m)]
        of = len(steps)
    values = [e for _, _, e in excess]
    quantum = multiples = None
    in_window = [e for e in values if QUANTUM_MS[0] <= e <= QUANTUM_MS[1]]
    if len(values) >= 3 and in_window:
        quantum = statistics.median(in_window)
        near = [e for e in values if abs(e / quantum - round(e / quantum)) <= 0.25]
        multiples = 100.0 * len(near) / len(values)
    return {"count": len(values), "of": of, "lost_ms": sum(values), "quantum_ms": quantum,
            "multiples_pct": multiples, "largest": sorted(excess, key=lambda x: -x[2])[:3],
            "steps": sorted({s for s, _, _ in excess if s is not None})}


def assess(run) -> dict:
    """The evidence for and against contention, whether it is named, and the decode time it cost."""
    use = run.info.get("machine_use") or {}
    spread = bool(run.info.get("workers")) or any(r.worker for r in run.records)
    if spread:  # the figures are the driver process's: the workers' CPU would read as "other processes"
        use = {}
    phases = use.get("phases") or {}
    dec = phases.get("decode") or {}
    cores = use.get("usable_cores") or (run.info.get("machine") or {}).get("usable_cores")
    threads = use.get("threads_used") or run.info.get("threads")
    decode_ms = sum(r.dur_ms for r in run.decode_steps())
    sp = spikes(run)
    hits, quiet = [], []

    def note(hit, text):
        (hits if hit else quiet).append(text)

    strong = False
    others = dec.get("others_cores")
    if others is not None and cores:
        over = others >= OTHERS_CORES and (threads or cores) + others > cores
        strong |= over
        note(over, f"other processes used {others:.2f} of {cores} cores during decode "
                   f"(machine {dec.get('machine_busy_pct', 0):.0f}% busy) while this run used {threads} threads")
    load = (use.get("load_average_end") or [None])[0]
    if load is not None and cores:
        over = load >= cores + OTHERS_CORES
        strong |= over
        note(over, f"load average {load:.2f} at the end (start "
                   f"{(use.get('load_average_start') or ['?'])[0]}) on {cores} cores")
    weak = 0
    ratio = dec.get("cpu_per_wall")
    if ratio is not None:
        weak += ratio < CPU_PER_WALL
        note(ratio < CPU_PER_WALL, f"the process ran {ratio:.2f} s of CPU per second of decode wall time")
    wall = dec.get("wall_s")
    if wall and dec.get("nivcsw") is not None:
        rate = dec["nivcsw"] / wall
        weak += rate >= NIVCSW_PER_S
        note(rate >= NIVCSW_PER_S, f"{rate:.0f} involuntary context switches a second of decode")
    if sp["quantum_ms"] is not None and sp["multiples_pct"] >= 60:
        weak += 1
        hits.append(f"{sp['count']} of {sp['of']} layers ran {SPIKE_MS:.0f}+ ms over their median, "
                    f"{sp['multiples_pct']:.0f}% of them in multiples of ~{sp['quantum_ms']:.1f} ms "
                    f"(a scheduler time slice: another task held the core)")
    elif sp["count"]:
        quiet.append(f"{sp['count']} of {sp['of']} layers spiked, not in multiples of a time slice")
    pre = _prefill_vs_decode(run)
    if pre:
        weak += pre[0] > pre[1]
        note(pre[0] > pre[1], f"prefill {pre[0]:.2f} ms/token vs decode {pre[1]:.2f} ms/token")
    steal = dec.get("steal_pct")
    if steal:
        note(steal >= 5, f"{steal:.1f}% of the machine's CPU time was stolen by the hypervisor")
        strong |= steal >= 5
    if spread:
        quiet.append("the run was spread over worker processes: the machine figures are left out (the "
                     "workers' CPU would read as other processes'), only the step times are judged")
    named = strong or weak >= 2
    waited = max(0.0, 1 - ratio) * wall * 1e3 if ratio is not None and wall else 0.0
    lost = max(sp["lost_ms"], waited) if named else sp["lost_ms"]
    lost_pct = 100 * lost / decode_ms if decode_ms else 0.0
    return {"named": named, "evidence": hits, "quiet": quiet, "lost_ms": lost, "lost_pct": min(lost_pct, 100.0),
            "others_cores": others, "threads": threads, "cores": cores, "spikes": sp,
            "recorded": bool(use), "first": named and lost_pct >= FIRST_PCT}


def _prefill_vs_decode(run):
    pre = [r for r in run.records if r.name == "generator::prefill"]
    dec = [r.dur_ms for r in run.decode_steps()]
    if not pre or not dec:
        return None
    tokens = next((int(t.split("=")[1]) for t in pre[0].details.split() if t.startswith("tokens=")), 0)
    if tokens < 4:
        return None
    return pre[0].dur_ms / tokens, statistics.median(dec)


def threads_to_try(a: dict) -> int:
    """The cores the other processes left free (at least one)."""
    cores, others = a["cores"] or 1, a["others_cores"] or 0.0
    return max(1, min(a["threads"] or cores, int(cores - others + 0.5)))


# --- jitter, put down to its causes ---------------------------------------------------------

def attribute_steps(run) -> list:
    """Decode steps over their median by SPIKE_MS or more, each with what the record says was going
    on: involuntary context switches (contention), GC pauses, page faults, spiking layers."""
    steps = run.decode_steps()
    if len(steps) < 3:
        return []
    med = statistics.median(r.dur_ms for r in steps)
    per_step = ((run.info.get("machine_use") or {}).get("decode_steps")) or {}
    index = {s: i for i, s in enumerate(per_step.get("step") or [])}
    layer_spikes = defaultdict(list)
    for step, layer, e in _layer_spikes(run):
        layer_spikes[step].append((layer, e))
    rows = []
    for r in steps:
        over = r.dur_ms - med
        if over < max(SPIKE_MS, 0.2 * med):
            continue
        causes = []
        i = index.get(r.step)
        if i is not None:
            cs, gc_ms, faults = per_step["nivcsw"][i], per_step["gc_ms"][i], per_step["faults"][i]
            if cs >= 1:
                causes.append(f"contention: ~{cs:.0f} involuntary context switches")
            if gc_ms >= GC_MS:
                causes.append(f"GC pause {gc_ms:.1f} ms")
            if faults >= FAULTS:
                causes.append(f"~{faults:.0f} page faults")
        if layer_spikes.get(r.step):
            worst = max(layer_spikes[r.step], key=lambda x: x[1])
            causes.append(f"{len(layer_spikes[r.step])} layer(s) spiked, layer {worst[0]} +{worst[1]:.1f} ms")
        rows.append({"step": r.step, "ms": r.dur_ms, "over_ms": over,
                     "causes": causes or ["not attributed (no switch, GC pause or fault recorded in it)"]})
    return rows


def _layer_spikes(run, blocks=None) -> list:
    """(step, layer, ms over the layer's median) of the layers that spiked."""
    blocks = _blocks(run) if blocks is None else blocks
    by_layer = defaultdict(list)
    for _, layer, d in blocks:
        by_layer[layer].append(d)
    med = {k: statistics.median(v) for k, v in by_layer.items()}
    return [(s, layer, d - med[layer]) for s, layer, d in blocks if d - med[layer] >= max(SPIKE_MS, med[layer])]


def drains(run) -> dict | None:
    """The time between decode steps (perf's drain of records and lines, the generator's loop):
    outside every step's time, inside the run's."""
    steps = sorted(run.decode_steps(), key=lambda r: r.start)
    gaps = [(b.start - a.start) * 1e3 - a.dur_ms for a, b in zip(steps, steps[1:])]
    if not gaps:
        return None
    return {"median_ms": statistics.median(gaps), "max_ms": max(gaps), "n": len(gaps)}
