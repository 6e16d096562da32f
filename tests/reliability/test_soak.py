"""Soak: 2,000 decode steps on the real SmolLM2 with every trace-level perf event recorded.

Resident memory must not grow once the KV cache is full-size (allocated and written before
the first step), and a late step may be slower than an early one only by what attention over
the longer context costs. Both are compared within this one run, so a slow or busy machine
shifts both sides alike: no absolute timing is asserted.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
import pytest

import pyml
from pyml.core import perf
from pyml.core.runtime import RuntimeConfig
from pyml.nlp.generator import Generator
from pyml.nn import attention_kernels

STEPS = 2000
EARLY, LATE = (100, 200), (STEPS - 100, STEPS)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def attention_cost(model, cache, context: int, repeats: int = 21) -> float:
    """Median CPU seconds of one decode step's attention over `context` positions: every layer's
    kernel on that layer's own cache arrays, so memory traffic is the real one, not cache-hot."""
    n_heads = model.blocks[0].attn.n_heads
    q = np.random.default_rng(1).standard_normal((n_heads, model.head_dim)).astype(np.float32)
    out, times = np.empty_like(q), []
    for _ in range(repeats):
        t0 = time.thread_time()
        for layer in range(len(model.blocks)):
            attention_kernels.attend_decode(q, *cache.layer(layer), 0, context, 0.125, out)
        times.append(time.thread_time() - t0)
    return statistics.median(times)


@pytest.mark.deep  # the soak: 2,000 steps at trace level, ~2-5 min on a shared 2-core machine; trace-level steps: tests/core/test_perf.py, tests/nn/test_fused.py
def test_2000_decode_steps_at_trace_level_no_memory_growth_no_unexplained_slowdown(smollm2_gguf, request):
    lm = pyml.load_model(gguf=str(smollm2_gguf), threads=1)
    request.addfinalizer(lambda: RuntimeConfig().apply())  # back to every core for later tests
    prompt = lm.encode("Once upon a time")
    events, step_ms, step_cpu, last = [0], [], [], [None]

    drained = [None]  # steps done when the first drain of decode steps delivered their records

    def collect(record):  # trace level on for every logger, nothing printed
        events[0] += 1
        if record["name"] == "generator::decode_step":
            step_ms.append(record["dur_ms"])
            if drained[0] is None:
                drained[0] = len(step_cpu)

    rss = {}

    def on_token(_):  # called once per token: the CPU time between two calls is one step
        now = time.thread_time()
        if last[0] is not None:
            step_cpu.append(now - last[0])
        last[0] = now
        n = len(step_cpu)  # steps done (their records come in batches, made after the steps)
        if n in (EARLY[0], EARLY[1], LATE[0], LATE[1]) and n not in rss:
            rss[n] = rss_bytes()
        if drained[0] is not None and "after the first drain" not in rss:
            rss["after the first drain"] = rss_bytes()

    # the KV cache, full-size and written once, so its pages are resident before the first step
    # (np.zeros memory is committed only when written: filling it would look like growth)
    cache = lm.model.new_cache(len(prompt) + STEPS + 1)
    for array in cache.k + cache.v:
        array.fill(0.0)
    perf.add_collector(collect, perf.TRACE)
    try:
        res = Generator(lm.model).generate(prompt, STEPS + 1, on_token=on_token, cache=cache)
    finally:
        perf.remove_collector(collect)
    assert res.stop_reason == "max_tokens" and len(step_ms) == STEPS
    assert events[0] > 100 * STEPS  # every linear, norm, rope and attention span was recorded

    # memory: flat after the first drain of decode steps (the KV cache was allocated before step 1).
    # Drains come about once a second; the first makes its ~1 s of spans into records at once, whose
    # memory the later ones reuse: +44 MB at step ~230 of a Zen 5 (then flat to step 2000), before
    # step 100 on a slower machine. Growth is what comes after it.
    grown = rss[LATE[1]] - rss["after the first drain"]
    assert grown < 32 << 20, f"resident memory grew by {grown / 2**20:.1f} MB over {STEPS} steps"

    # time: late steps may cost more than early ones only by the attention over more positions
    early = statistics.median(step_cpu[EARLY[0]:EARLY[1]])
    late = statistics.median(step_cpu[LATE[0]:LATE[1]])
    wall = [statistics.median(step_ms[a:b]) for a, b in (EARLY, LATE)]
    ctx = len(prompt)
    extra_attention = attention_cost(lm.model, cache, ctx + LATE[0]) - attention_cost(lm.model, cache, ctx + EARLY[0])
    print(f"\nsoak: {events[0]} events, rss {rss[EARLY[0]] / 2**20:.1f} at step {EARLY[0]}, "
          f"{rss['after the first drain'] / 2**20:.1f} after the first drain (step {drained[0]}) -> "
          f"{rss[LATE[1]] / 2**20:.1f} MB, "
          f"median step CPU {early * 1e3:.2f} -> {late * 1e3:.2f} ms (wall {wall[0]:.2f} -> {wall[1]:.2f} ms), "
          f"attention explains {extra_attention * 1e3:.2f} ms")
    allowed = early + 2.0 * max(extra_attention, 0.0) + 0.35 * early  # generous: a shared, noisy machine
    assert late <= allowed, (f"median step {early * 1e3:.2f} ms at ~{EARLY[0]} -> {late * 1e3:.2f} ms at "
                             f"~{LATE[0]}; attention over the longer context explains "
                             f"{extra_attention * 1e3:.2f} ms")
