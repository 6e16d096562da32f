"""report.md's "The machine during the run" and jitter.md's "Where the jitter came from":
run.json's machine_use (machine_use.py) and contention.py's reading of it, as Doc sections."""

from __future__ import annotations

from pyml.report import contention
from pyml.report.doc import ms

_PHASE_ORDER = ("load", "warmup", "prefill", "decode", "other")


def _num(x, fmt="{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


def machine_section(doc, run) -> None:
    use = run.info.get("machine_use")
    a = contention.assess(run)
    doc.h("The machine during the run")
    if not use:
        doc.p("Not recorded (a report from a log, or a profile from before run.json had `machine_use`): "
              + ("; ".join(a["evidence"]) + "." if a["evidence"] else "only the step times speak for the machine."))
        return
    cores, threads = use.get("usable_cores"), use.get("threads_used")
    doc.p(f"{threads} threads on {cores} usable cores ({use.get('process_threads')} threads in the process); "
          f"load average {_num((use.get('load_average_start') or [None])[0])} at the start, "
          f"{_num((use.get('load_average_end') or [None])[0])} at the end.")
    phases = use.get("phases") or {}
    rows = []
    for p in sorted(phases, key=lambda k: _PHASE_ORDER.index(k) if k in _PHASE_ORDER else 99):
        v = phases[p]
        rows.append([p, ms(v["wall_s"] * 1e3), ms(v["cpu_s"] * 1e3), _num(v["cpu_per_wall"]),
                     _num(v["nivcsw"], "{:.0f}"), _num(v["faults"], "{:.0f}"), _num(v["gc_ms"], "{:.1f}"),
                     _num(v["others_cores"]), _num(v["steal_pct"], "{:.1f}%")])
    doc.table(["Phase", "Wall", "CPU (process)", "CPU/wall", "Involuntary switches", "Page faults", "GC ms",
               "Others (cores)", "Steal"], rows, "lrrrrrrrr")
    doc.p("CPU is every thread of the process; *Others* is the machine's busy time (/proc/stat) minus ours, in "
          "cores; steal is time the hypervisor gave to other guests. Sampled every "
          f"{use.get('sample_interval_s', 0) * 1e3:.0f} ms and shared out over the phases' spans by overlap.")
    if a["named"]:
        doc.p("**Contention**: " + "; ".join(a["evidence"]) + f". About {ms(a['lost_ms'])} of decode "
              f"({a['lost_pct']:.0f}%) went to waiting.")
    else:
        doc.p("**No contention named**" + (": " + "; ".join(a["quiet"]) if a["quiet"] else "")
              + (" (but: " + "; ".join(a["evidence"]) + ")" if a["evidence"] else "") + ".")
    doc.p(f"Rules (pyml/report/contention.py): others >= {contention.OTHERS_CORES} cores while threads + others "
          f"exceed the cores, or a load average {contention.OTHERS_CORES} or more above the cores; else two of: "
          f"CPU/wall < {contention.CPU_PER_WALL}, >= {contention.NIVCSW_PER_S} involuntary switches a second, "
          f"layer spikes in multiples of a {contention.QUANTUM_MS[0]}–{contention.QUANTUM_MS[1]} ms time slice, "
          f"prefill slower per token than decode.")


def jitter_causes_section(doc, run) -> None:
    rows = contention.attribute_steps(run)
    gaps = contention.drains(run)
    doc.h("Where the jitter came from")
    if rows:
        doc.table(["Step", "Time", "Over the median", "What the record shows"],
                  [[r["step"], ms(r["ms"]), ms(r["over_ms"]), "; ".join(r["causes"])] for r in rows], "rrrl")
    else:
        doc.p(f"No decode step ran {contention.SPIKE_MS:.0f} ms (or 20%) over the median step.")
    if not (run.info.get("machine_use") or {}).get("decode_steps"):
        doc.p("The record has no per-step machine figures (context switches, GC pauses, page faults): only the "
              "layers' spikes attribute the slow steps.")
    if gaps:
        doc.p(f"Between decode steps (outside their times: the drain that makes records and `[perf]` lines, the "
              f"generator's loop): median {ms(gaps['median_ms'])}, longest {ms(gaps['max_ms'])} over "
              f"{gaps['n']} gaps.")
