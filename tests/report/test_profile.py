"""A real profiled run of a tiny GPT-2: every output, agreeing with each other and with the saved log."""

import io
import json
import logging
import os
import re
import statistics

import pytest

import pyml
from pyml.core import perf
from pyml.report.capture import profile
from pyml.report.timing import measure_decode_overhead, measure_timing_overhead
from pyml.report import aggregate
from pyml.report import load_run, write_reports
from pyml.report.chrome import chrome_trace, validate_chrome_trace
from pyml.cli.pyml_report import main as report_main
from pyml.cli.standins import write_gpt2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = write_gpt2(tmp_path_factory.mktemp("gpt2"), "gpt2-tiny", n_layer=3)
    (d / "tokenizer.json").unlink()  # token ids in, token ids out: no tokenizer needed
    return d


def _profiled(directory, checkpoint, warmup=True, log_spec=None):
    """Profile load + generate; with log_spec, also write the [perf] text log; returns its text."""
    stream = io.StringIO()
    root = logging.getLogger("pyml")
    saved = list(root.handlers)
    if log_spec:
        for h in saved:
            root.removeHandler(h)
        perf.configure(log_spec, stream=stream)
    try:
        with profile(directory, argv=["test"]) as prof:
            lm = pyml.load_model(safetensors=str(checkpoint), warmup=warmup)
            prof.set_model(lm)
            prof.set_result(lm.generate([1, 2, 3, 4, 5], max_tokens=6))
    finally:
        if log_spec:
            for h in list(root.handlers):
                root.removeHandler(h)
            for h in saved:
                root.addHandler(h)
            for name in list(logging.root.manager.loggerDict):
                if name.startswith("pyml"):
                    logging.getLogger(name).setLevel(logging.NOTSET)
            perf.configure("")
    return stream.getvalue()


@pytest.fixture
def log_to_stream():
    """Configure levels from a spec into a stream; restore pyml's logging afterwards."""
    root = logging.getLogger("pyml")
    saved = list(root.handlers)
    stream = io.StringIO()

    def apply(spec):
        root.handlers[:] = []
        perf.configure(spec, stream=stream)
        return stream

    yield apply
    root.handlers[:] = saved
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("pyml"):
            logging.getLogger(name).setLevel(logging.NOTSET)
    perf.configure("")


@pytest.fixture(scope="module")
def profiled(tmp_path_factory, checkpoint):
    d = tmp_path_factory.mktemp("prof")
    text = _profiled(d / "warm", checkpoint, log_spec="trace,warmup")  # the whole run: lines in tree order
    (d / "run.log").write_text("debug: gpt2: layers=3 linears=13 types={'F32': 13} fusions=0\n" + text)
    return d


def test_profile_directory_holds_events_and_run_info(profiled):
    events = (profiled / "warm" / "events.jsonl").read_text().splitlines()
    rec = json.loads(events[0])
    assert {"name", "module", "op", "parent", "phase", "step", "layer", "details", "dtype", "start", "dur_ms",
            "depth", "thread"} <= set(rec)
    info = json.loads((profiled / "warm" / "run.json").read_text())
    assert info["events"] == len(events) and info["status"] == "ok"
    assert info["model"]["arch"] == "gpt2" and info["model"]["layers"] == 3 and info["threads"] >= 1
    assert {"cpu", "cores", "memory_bytes", "python", "numpy", "numba"} <= set(info["machine"])
    # the settings that change the figures, as this process had them (the suite's workers: a wait policy)
    assert info["env"].get("OMP_WAIT_POLICY") == os.environ.get("OMP_WAIT_POLICY")
    assert info["env"].get("NUMBA_CACHE_DIR") == os.environ.get("NUMBA_CACHE_DIR") and "HOME" not in info["env"]
    assert info["command"] == ["test"] and info["generation"]["decode_steps"] == 5
    assert info["timing"]["span_overhead_us"] > 0
    phases = {json.loads(line)["phase"] for line in events}
    assert {"load", "warmup", "prefill", "decode"} <= phases
    # what recording added, measured after the run on steps that are not in the profile
    over = info["overhead"]
    assert over["off_ms"] > 0 and over["on_ms"] > 0 and over["steps"] == 30 and over["lines"] is True
    assert len(over["pairs"]) == 5 and over["pct"] == pytest.approx((statistics.median(over["pairs"]) - 1) * 100)
    assert "calibration" not in phases
    # what the machine did meanwhile, per phase, and per decode step
    use = info["machine_use"]
    assert use["threads_used"] == info["threads"] and use["usable_cores"] >= 1 and use["samples"] >= 2
    assert {"load", "warmup", "prefill", "decode"} <= set(use["phases"])
    dec = use["phases"]["decode"]
    assert dec["wall_s"] > 0 and dec["cpu_s"] >= 0 and dec["nivcsw"] >= 0
    assert use["decode_steps"]["step"] == [1, 2, 3, 4, 5]
    assert info["warmup_s"] > 0 and "compile_s" in info
    # the ceiling the decode step's weights are read against, at the run's thread count
    read = info["read_bandwidth"]
    assert read["gb_s"] > 0 and read["threads"] == info["threads"] and read["bytes"] >= 256 << 20


def test_the_report_gives_the_weights_share_of_the_measured_read_bandwidth(profiled, tmp_path):
    run = load_run(profiled / "warm")
    write_reports(run, tmp_path, formats=("md",), plots=False, log=None)
    text = (tmp_path / "report.md").read_text()
    read = run.info["read_bandwidth"]
    achieved = float(re.search(r"= \*\*([0-9.]+) GB/s\*\* achieved", text).group(1))
    share = re.search(r"(\d+)% of the ([0-9.]+) GB/s this machine read at the run's end", text)
    assert share, text
    assert float(share.group(2)) == pytest.approx(read["gb_s"], rel=1e-2)
    assert int(share.group(1)) == pytest.approx(100 * achieved / read["gb_s"], abs=1)
    del run.info["read_bandwidth"]  # a run.json from before the measurement: said, not guessed
    write_reports(run, tmp_path, formats=("md",), plots=False, log=None)
    assert "no read bandwidth was measured for this run" in (tmp_path / "report.md").read_text()


def test_the_report_states_what_the_recording_added_to_this_run(profiled, tmp_path):
    run = load_run(profiled / "warm")
    write_reports(run, tmp_path, formats=("md",), plots=False, log=None)
    over = run.info["overhead"]
    text = (tmp_path / "report.md").read_text()
    assert f"added **{over['pct']:+.1f}%** to this run's decode steps" in text
    assert f"{over['on_ms']:.2f} ms per step recorded, {over['off_ms']:.2f} ms not" in text


def test_decode_overhead_measurement_leaves_logging_as_it_was(checkpoint, log_to_stream):
    stream = log_to_stream("pyml.nn=trace,pyml=debug")
    lm = pyml.load_model(safetensors=str(checkpoint), warmup=False)
    perf.flush()
    logged = stream.getvalue()
    before = (perf.get("pyml.nn.linear").trace_on, perf.get("pyml.core.ops").trace_on, list(perf._collectors),
              logging.getLogger("pyml.nn").level)
    got = measure_decode_overhead(lm, steps=2, rounds=1)
    assert got["lines"] is False and got["steps"] == 2  # the root is at debug: lines only from pyml.nn
    assert (perf.get("pyml.nn.linear").trace_on, perf.get("pyml.core.ops").trace_on, list(perf._collectors),
            logging.getLogger("pyml.nn").level) == before
    perf.flush()
    assert stream.getvalue() == logged  # the calibration steps wrote nothing where the log goes


def test_the_saved_log_gives_the_same_records_and_tables(profiled):
    a, b = load_run(profiled / "warm"), load_run(profiled / "run.log")
    assert [r.key() for r in a.records] == [r.key() for r in b.records]
    for phases in (aggregate.GENERATION, ("decode",), None):
        assert aggregate.module_table(a.records, phases) == aggregate.module_table(b.records, phases)
    assert aggregate.step_breakdowns(a) == aggregate.step_breakdowns(b)
    assert aggregate.layer_breakdown(a, 1) == aggregate.layer_breakdown(b, 1)
    assert aggregate.label_table(a.records, {"prefill"}) == aggregate.label_table(b.records, {"prefill"})


def test_all_outputs_agree(profiled, tmp_path):
    run = load_run(profiled / "warm")
    written = write_reports(run, tmp_path, formats=("md", "json", "html"), plots=True, log=None)
    names = {p.name for p in written}
    assert {"report.md", "modules.md", "jitter.md", "report.json", "report.html", "modules.html", "jitter.html",
            "trace.json", "decode_steps.png", "component_share.png", "layers.png"} <= names
    data = json.loads((tmp_path / "report.json").read_text())
    mods = data["modules"]
    assert sum(r["pct"] for r in mods["rows"]) == pytest.approx(100.0)
    for r in mods["rows"]:
        assert r["calls"] >= 1 and r["per_call_ms"] == pytest.approx(r["total_ms"] / r["calls"])
    steps = data["decode_steps"]
    for s in steps:  # components sum to the step, parts to the forward
        assert sum(s[k] for k in aggregate.COMPONENTS) == pytest.approx(s["total"])
        assert s["embedding"] + s["layers"] + s["norm"] + s["projection"] <= s["model"]
    assert sum(c["pct"] for k, c in data["components"].items() if k != "total") == pytest.approx(100.0)
    # the module table's decode total is the decode steps' total
    dec = aggregate.module_table(run.records, ("decode",))
    assert dec["total_ms"] == pytest.approx(sum(s["total"] for s in steps), abs=1e-6 * len(run.records))
    assert validate_chrome_trace(json.loads((tmp_path / "trace.json").read_text())) == len(run.records)
    md = (tmp_path / "modules.md").read_text()
    pcts = [float(m) for m in re.findall(r"^\| \S.*\| ([\d.]+) \|$", md.split("## Time per phase")[0], re.M)]
    assert sum(pcts[:-1]) == pytest.approx(100.0, abs=0.05 * len(pcts))  # the rows, to rounding
    report = (tmp_path / "report.md").read_text()
    for section in ("## High-level timing", "## Decode breakdown (per step)",
                    "## Per-layer breakdown (trace, single-token decode, median over 3 layers × 5 steps)",
                    "## The machine during the run",
                    "## Attention vs FFN", "## Output head", "## Top bottlenecks", "## Methodology"):
        assert section in report
    jitter = (tmp_path / "jitter.md").read_text()
    assert "**Primary bottleneck**" in jitter and "**Optimization potential**" in jitter
    assert "<table>" in (tmp_path / "report.html").read_text()


def test_trace_nests_on_one_track(profiled):
    trace = chrome_trace(load_run(profiled / "warm"))
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in xs} == {0}
    assert any(e["name"] == "thread_name" for e in trace["traceEvents"] if e["ph"] == "M")
    bad = {"traceEvents": [{"ph": "X", "pid": 1, "tid": 0, "name": "a", "ts": 0, "dur": 10},
                           {"ph": "X", "pid": 1, "tid": 0, "name": "b", "ts": 5, "dur": 10}]}
    with pytest.raises(pyml.PymlError, match="overlaps a"):
        validate_chrome_trace(bad)


def test_plots_are_skipped_in_one_line_without_matplotlib(profiled, tmp_path, monkeypatch):
    from pyml.report import plots, writer
    monkeypatch.setattr(writer, "matplotlib_available", lambda: False)
    log = io.StringIO()
    written = write_reports(profiled / "warm", tmp_path, plots=True, log=log)
    assert not any(p.suffix == ".png" for p in written)
    assert log.getvalue() == plots.MATPLOTLIB_MISSING + "\n"


def test_cli_on_directory_and_log(profiled, tmp_path, capsys):
    assert report_main([str(profiled / "run.log"), "--out", str(tmp_path / "fromlog"), "--no-plots"]) == 0
    assert report_main([str(profiled / "warm"), "--out", str(tmp_path / "fromdir"), "--no-plots"]) == 0
    # the step and layer tables agree; what the machine did (run.json) is in the profile only
    a = (tmp_path / "fromdir" / "jitter.md").read_text().split("## Decode step timings")[1]
    b = (tmp_path / "fromlog" / "jitter.md").read_text().split("## Decode step timings")[1]
    assert a.split("## Where the jitter came from")[0] == b.split("## Where the jitter came from")[0]
    a = (tmp_path / "fromdir" / "modules.md").read_text().split("## Time per phase")[1]
    b = (tmp_path / "fromlog" / "modules.md").read_text().split("## Time per phase")[1]
    assert a == b


def test_cli_errors_are_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "events.jsonl").write_text('{"id": 1, "name": "x", "dur_ms": 1.0, "start": 0.0}\n{"id": 2,\n')
    assert report_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.match(r"pyml-report: error: .*events.jsonl:2: not a JSON record", err)
    with pytest.raises(Exception):
        report_main([str(tmp_path), "--debug"])
    with pytest.raises(SystemExit) as e:  # argparse: one line, exit 2
        report_main([str(tmp_path), "--format", "pdf"])
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1
    assert report_main(["compare", str(tmp_path), str(tmp_path / "nope")]) == 2
    assert "error:" in capsys.readouterr().err
    prompts = tmp_path / "prompts.jsonl"  # a JSONL that is not a profile (pyml-batch's input)
    prompts.write_text('{"id": "a", "prompt": "Hello"}\n{"id": "b", "prompt": "Bye"}\n')
    assert report_main([str(prompts)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prompts.jsonl: not a pyml profile" in err


def test_compare_cold_and_warm_shows_the_warmup(profiled, checkpoint, tmp_path, capsys):
    _profiled(tmp_path / "cold", checkpoint, warmup=False)
    assert report_main(["compare", str(tmp_path / "cold"), str(profiled / "warm"), "--labels", "COLD,WARM"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\| Warm-up \| — \| [\d.]+ms \| — \|$", out, re.M)
    assert "● **COLD**" in out and "**TOP HOTSPOT (WARM)**" in out and "## Per-module change" in out
    assert re.search(r"● \*\*[+-][\d.]+%\*\* total measured time, WARM vs COLD", out)
    assert report_main(["compare", str(tmp_path / "cold"), str(profiled / "warm"), "--format", "json",
                        "--out", str(tmp_path / "c.json")]) == 0
    numbers = json.loads((tmp_path / "c.json").read_text())
    assert numbers["timeline"][0]["warmup_ms"] is None and numbers["timeline"][1]["warmup_ms"] > 0


def test_profiles_do_not_nest(tmp_path):
    with profile(tmp_path / "a"):
        with pytest.raises(pyml.PymlError, match="do not nest"):
            with profile(tmp_path / "b"):
                pass


def test_timing_overhead_measurement_leaves_logging_as_it_was():
    before = (perf.get("pyml.nn.linear").trace_on, list(perf._collectors))
    t = measure_timing_overhead(n=50, repeats=2, with_lines=True)
    assert t["span_overhead_us"] > 0 and t["span_floor_us"] >= 0 and "line_us" in t
    assert (perf.get("pyml.nn.linear").trace_on, list(perf._collectors)) == before


def test_an_old_log_of_the_same_run_gives_the_same_step_and_category_tables(profiled, tmp_path):
    old = tmp_path / "old.log"
    lines = (profiled / "run.log").read_text().splitlines()
    flat = [lines[r.line - 1].split(" | ")[0] for r in load_run(profiled / "run.log").records]  # in end order
    old.write_text("".join("[perf] " + line[len("[perf] "):].lstrip() + "\n" for line in flat))
    a, b = load_run(profiled / "warm"), load_run(old)
    assert [(r.name, r.depth, r.phase, r.step) for r in a.records] == [(r.name, r.depth, r.phase, r.step)
                                                                       for r in b.records]
    assert aggregate.step_breakdowns(a) == aggregate.step_breakdowns(b)
    assert aggregate.category_table(a.records, {"decode"}) == aggregate.category_table(b.records, {"decode"})
