"""Contention seen, one ranking, advice checked: hand-made runs whose answers are known (streams.py)."""

import re

import pytest

from pyml.report import advice, contention, findings, pages
from pyml.report.doc import render_md
from pyml.report.records import Run, normalize
from tests.report.streams import emit, generation

COMMAND = ["/usr/bin/pyml-infer", "-m", "smollm2-135m", "-p", "Hi", "-n", "8", "-t", "2", "--profile", "prof/"]


def _phase(wall, cpu, nivcsw, others, steal=0.0):
    return {"wall_s": wall, "cpu_s": cpu, "cpu_per_wall": cpu / wall, "nivcsw": nivcsw, "nvcsw": 1, "faults": 3,
            "gc_ms": 0.0, "others_cores": others, "machine_busy_pct": 100 * min(1.0, (cpu / wall + others) / 2),
            "steal_pct": steal}


def _machine_use(decode, load_end, n_steps, nivcsw_step=0.0):
    return {"load_average_start": [load_end, 1.0, 1.0], "load_average_end": [load_end, 1.0, 1.0],
            "threads_used": 2, "usable_cores": 2, "process_threads": 4, "sample_interval_s": 0.025, "samples": 9,
            "phases": {"decode": decode},
            "decode_steps": {"step": list(range(1, n_steps + 1)), "wall_ms": [10.0] * n_steps,
                             "cpu_ms": [10.0] * n_steps, "nivcsw": [nivcsw_step] * n_steps,
                             "faults": [0.0] * n_steps, "gc_ms": [0.0] * n_steps}}


def _spike(step, layer, ms):
    """Step `step` (an S tree) with layer `layer` `ms` longer, and its forward and step with it."""
    fwd = step.children[0]
    block = [c for c in fwd.children if c.name.startswith("transformer[")][layer]
    block.dur += ms
    fwd.dur += ms
    step.dur += ms


def _run(roots, info):
    recs, _ = normalize(emit(roots), main_thread=1)
    return Run(recs, info, "hand-made", "profile")


def contended_run():
    """Two busy loops on the 2 cores: another 1.9 cores busy, load 4.1, the process on the CPU 55% of the
    wall clock, layers 4.2 / 8.3 / 12.5 ms late (the scheduler's slices)."""
    roots = generation(8)
    for step_no, layer, ms in ((2, 0, 4.2), (4, 1, 8.3), (7, 0, 12.5)):
        _spike(roots[1 + step_no], layer, ms)
    info = {"threads": 2, "warmup": True, "command": COMMAND, "machine": {"usable_cores": 2},
            "machine_use": _machine_use(_phase(0.105, 0.058, 40, 1.9), 4.1, 8, nivcsw_step=5)}
    return _run(roots, info)


def quiet_run():
    info = {"threads": 2, "warmup": True, "command": COMMAND, "machine": {"usable_cores": 2},
            "machine_use": _machine_use(_phase(0.08, 0.082, 2, 0.05), 0.3, 8)}
    return _run(generation(8), info)


def _first_bottlenecks(run):
    ranking = findings.bottlenecks(run, {"span_overhead_us": 3.0, "span_floor_us": 1.0})
    report = render_md(pages.report_page(run, ranking=ranking))
    modules = render_md(pages.modules_page(run, ranking=ranking))
    jitter = render_md(pages.jitter_page(run, ranking=ranking))
    first = re.search(r"^### 1\. (.+?) — ", report, re.M).group(1)
    named = r"\*\*Primary bottleneck\*\*: (.+?) \(\d+% of decode time\)"
    return report, first, (re.search(named, modules).group(1), re.search(named, jitter).group(1))


def test_a_contended_run_names_contention_first_with_its_evidence_and_what_to_do():
    run = contended_run()
    a = contention.assess(run)
    assert a["named"] and a["first"]
    sp = a["spikes"]
    assert sp["count"] == 3 and sp["quantum_ms"] == pytest.approx(4.2) and sp["multiples_pct"] == 100
    assert a["lost_ms"] == pytest.approx(max(25.0, (1 - 0.058 / 0.105) * 105))
    report, first, others = _first_bottlenecks(run)
    assert first.startswith("machine contention") and others == (first, first)
    section = report.split("### 1. ")[1].split("### 2. ")[0]
    assert "other processes used 1.90 of 2 cores" in section and "load average 4.10" in section
    assert "multiples of ~4.2 ms" in section
    # what to do: -t 1 (the core the others left), the run's own command, and a quieter machine
    assert "`pyml-infer -m smollm2-135m -p Hi -n 8 --threads 1 --profile prof-t1`" in section
    assert "A quieter machine" in section
    # and the slow steps are put down to contention in jitter.md
    causes = {r["step"]: r["causes"] for r in contention.attribute_steps(run)}
    assert set(causes) == {2, 4, 7} and all(c[0].startswith("contention: ~5 involuntary") for c in causes.values())


def test_a_quiet_run_does_not_name_contention():
    run = quiet_run()
    a = contention.assess(run)
    assert not a["named"] and a["spikes"]["count"] == 0 and not a["evidence"]
    report, first, others = _first_bottlenecks(run)
    assert first == "glue (Python/NumPy between ops)" and others == (first, first)
    assert "machine contention" not in report and "**No contention named**" in report
    assert contention.attribute_steps(run) == []


def test_a_run_whose_own_threads_make_the_load_is_not_contended():
    run = quiet_run()
    run.info["machine_use"]["load_average_end"] = [2.3, 1.0, 1.0]  # our 2 threads, and a little more
    assert not contention.assess(run)["named"]


def test_contention_without_machine_figures_needs_two_signs():
    """A log has no run.json: spikes in slices alone are one sign, not a verdict."""
    run = contended_run()
    run.info = {}
    a = contention.assess(run)
    assert not a["named"] and len(a["evidence"]) == 1 and "multiples of ~4.2 ms" in a["evidence"][0]


def test_advice_never_suggests_what_the_run_uses_nor_what_pyml_refuses():
    run = contended_run()
    run.info["command"] = [*COMMAND[:7], "-t", "1", *COMMAND[9:]]
    run.info["threads"] = 1
    machine = next(i for i in findings.bottlenecks(run) if i["title"].startswith("machine contention"))
    assert machine["suggestions"] == []  # already -t 1: a quieter machine is what is left
    # the head already Q8_0 (SmolLM2 Q4_1's): --lm-head-quant q4_0 is refused by pyml, so never said
    run.info["model"] = {"lm_head": {"in": 64, "out": 512, "dtype": "Q8_0"}}
    head = {"ms": 3.0, "calls": 3, "in": 64, "dtype": "Q8_0"}
    assert advice.head_quant(run, head, 10.0) == []
    run.info["model"] = {"lm_head": {"in": 64, "out": 512, "dtype": "BF16"}}
    said = advice.head_quant(run, head, 10.0)
    assert [s["changes"] for s in said] == [{"--lm-head-quant": "q8_0"}, {"--lm-head-quant": "q4_0"}]
    assert said[0]["gain_ms"] == pytest.approx(1.0 * (1 - (34 / 32) / 2))
    assert said[0]["commands"][0][-4:] == ["--lm-head-quant", "q8_0", "--profile", "prof-head-q8_0"]
    run.info["warmup"] = True
    assert advice.warm_up(run, "drop it", 1.0) == []  # the run warmed up
    assert advice.greedy(run, "greedy", 1.0) == []    # the run was greedy (no --temp)


def test_options_are_edited_as_the_cli_spells_them():
    args = ["-m", "x", "--temp=0.7", "-t", "2", "--no-warmup", "--profile", "p"]
    assert advice.option_value(args, "--temperature") == "0.7" and advice.option_value(args, "--threads") == "2"
    assert advice.option_value(args, "--no-warmup") is True and advice.option_value(args, "--lm-head-quant") is None
    assert advice.with_options(args, {"--threads": 1, "--no-warmup": None, "--temperature": 0}) == \
        ["-m", "x", "--profile", "p", "--threads", "1", "--temperature", "0"]
    assert advice.infer_args(["python", "-c", "..."]) is None


def test_a_run_over_worker_processes_is_not_judged_by_the_drivers_machine_figures():
    """pyml-batch --ray: the workers' CPU is other processes' to the driver's sampler."""
    run = contended_run()
    run.info["workers"] = [{"worker": 1}, {"worker": 2}]
    a = contention.assess(run)
    assert not a["named"] and any("worker processes" in q for q in a["quiet"])
    assert len(a["evidence"]) == 1  # the slices in the step times alone


def test_quantizing_is_suggested_for_a_gguf_with_the_run_on_the_new_file(tmp_path):
    src = tmp_path / "m-f16.gguf"
    src.write_bytes(b"GGUF")
    run = quiet_run()
    run.info["model"] = {"source": str(src)}
    (said,) = advice.quantize_weights(run, "q8_0", "quantize", 1.5)
    dst = str(tmp_path / "m-f16-q8_0.gguf")
    assert said["commands"] == [["pyml-quantize", str(src), dst, "--type", "q8_0"],
                                ["pyml-infer", "-p", "Hi", "-n", "8", "-t", "2", "--model", dst,
                                 "--profile", "prof-q8_0"]]
    run.info["model"] = {"source": str(tmp_path)}  # a safetensors directory: pyml-quantize reads GGUF only
    assert advice.quantize_weights(run, "q8_0", "quantize", 1.5) == []
