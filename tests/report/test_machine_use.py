"""run.json's machine_use: samples shared out over the run's top-level spans (hand-made samples)."""

import gc
import time

import pytest

from pyml.report import machine_use
from pyml.report.machine_use import MachineSampler, summarize


def _samples():
    # (wall, cpu, nivcsw, nvcsw, faults, busy, total, steal); every 10 ms: our CPU 5 ms, the
    # machine's busy 18 ms of 20 (2 cores), 2 involuntary switches, 1 ms stolen
    return [(1.0 + 0.01 * i, 0.005 * i, 2 * i, i, 10 * i, 0.018 * i, 0.02 * i, 0.001 * i) for i in range(11)]


def test_intervals_are_shared_out_by_overlap():
    spans = [("prefill", 0, 1.0, 1.03), ("decode", 1, 1.03, 1.045), ("decode", 2, 1.05, 1.1)]
    got = summarize(_samples(), [(1.06, 4.0)], spans, threads=2, load_start=[3.0, 1, 1], load_end=[3.5, 1, 1])
    dec = got["phases"]["decode"]
    assert dec["wall_s"] == pytest.approx(0.065) and dec["cpu_s"] == pytest.approx(0.0325)
    assert dec["cpu_per_wall"] == pytest.approx(0.5) and dec["nivcsw"] == pytest.approx(13.0)
    assert dec["others_cores"] == pytest.approx((1.8 - 0.5) * 0.065 / 0.065, rel=1e-3)  # 1.8 cores busy, ours 0.5
    assert dec["machine_busy_pct"] == pytest.approx(90.0) and dec["steal_pct"] == pytest.approx(5.0)
    assert dec["gc_ms"] == 4.0 and got["phases"]["prefill"]["gc_ms"] == 0.0
    steps = got["decode_steps"]
    assert steps["step"] == [1, 2] and steps["wall_ms"] == pytest.approx([15.0, 50.0])
    assert steps["nivcsw"] == pytest.approx([3.0, 10.0]) and steps["gc_ms"] == [0.0, 4.0]
    assert got["threads_used"] == 2 and got["load_average_end"] == [3.5, 1, 1]
    assert got["run"]["wall_s"] == pytest.approx(0.1)


def test_no_proc_stat_leaves_the_machine_figures_empty():
    samples = [s[:5] + (None, None, None) for s in _samples()]
    got = summarize(samples, [], [("decode", 1, 1.0, 1.1)], 1, None, None)
    dec = got["phases"]["decode"]
    assert dec["others_cores"] is None and dec["steal_pct"] is None and dec["cpu_per_wall"] == pytest.approx(0.5)


def test_the_sampler_reads_this_process_and_times_gc_pauses():
    sampler = MachineSampler(interval_s=0.005)
    t0 = time.perf_counter()
    x = 0
    # Busy: our CPU keeps up with the wall clock. The sampler's thread needs the GIL this loop holds,
    # so on a loaded machine it may wake fewer times than 60 ms / 5 ms; keep busy until it has (bounded).
    while time.perf_counter() - t0 < 0.06 or (len(sampler.samples) < 4 and time.perf_counter() - t0 < 5):
        x += 1
    gc.collect()
    t1 = time.perf_counter()
    got = sampler.summary([("decode", 1, t0, t1)], threads=1)
    assert sampler._on_gc not in gc.callbacks and not sampler._thread.is_alive()
    dec = got["phases"]["decode"]
    assert got["samples"] >= 5 and dec["wall_s"] == pytest.approx(t1 - t0, rel=0.2)
    assert 0 < dec["cpu_per_wall"] <= 1.5 and dec["gc_ms"] > 0
    if machine_use.proc_stat() is not None:
        assert dec["others_cores"] is not None and dec["machine_busy_pct"] > 0
